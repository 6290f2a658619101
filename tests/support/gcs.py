"""Real GCS plumbing for tests: the gcp-storage-emulator in a subprocess, and a faulty proxy.

* :class:`GcsEmulator` runs ``python -m gcp_storage_emulator start --in-memory`` on a free
  loopback port, waits until it answers, and creates a bucket. Clients reach it with
  ``GCSBackend(bucket, prefix, endpoint=emu.url)`` or by setting ``STORAGE_EMULATOR_HOST``
  to ``emu.url``.
* :class:`FlakyProxy` is a small threaded HTTP reverse proxy in front of it that answers
  503, resets the connection, or forwards the request and then drops the response, for the
  first N requests and/or a random fraction of them. It injects transient faults through
  the real google-cloud-storage client, with no mocking of the library.
* ``gcs_emulator`` is a session-scoped pytest fixture: ``from support.gcs import
  gcs_emulator`` in a test module makes it available there.

The emulator is single-threaded and HTTP/1.0 (a connection per request); fine for tests.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

DEFAULT_BUCKET = "mtcfs-test"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that no other test process is handed (support/ports.py)."""
    from .ports import free_port as port
    return port(host)


class GcsEmulator:
    """A gcp-storage-emulator subprocess with in-memory storage on a loopback port.

    Args:
        bucket: bucket created at start.
        host: address to listen on.
        startup_timeout: seconds to wait for the emulator to answer.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(self, bucket: str = DEFAULT_BUCKET, *, host: str = "127.0.0.1",
                 startup_timeout: float = 30.0) -> None:
        self.bucket = bucket
        self.host = host
        self.port = 0
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None
        self._log_path = ""

    @property
    def url(self) -> str:
        """Endpoint URL, e.g. ``http://127.0.0.1:40123`` (the STORAGE_EMULATOR_HOST value)."""
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "GcsEmulator":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, limit: int = 4000) -> str:
        """The last ``limit`` characters of the emulator's output."""
        try:
            with open(self._log_path, "rb") as f:
                return f.read()[-limit:].decode(errors="replace")
        except OSError:
            return ""

    def start(self) -> "GcsEmulator":
        """Start the emulator and wait until it serves requests.

        Raises:
            RuntimeError: if it exits or does not answer within ``startup_timeout`` (the
                message includes its output).
        """
        self._workdir = tempfile.TemporaryDirectory(prefix="gcs-emulator-")
        self._log_path = os.path.join(self._workdir.name, "emulator.log")
        env = {k: v for k, v in os.environ.items() if k != "STORAGE_EMULATOR_HOST"}
        last = ""
        for _ in range(3):  # the free port may be taken between probing and binding
            self.port = free_port(self.host)
            log = open(self._log_path, "ab")
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "gcp_storage_emulator", "start",
                     "--host", self.host, "--port", str(self.port), "--in-memory",
                     "--default-bucket", self.bucket, "--quiet"],
                    cwd=self._workdir.name, env=env, stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT)
            finally:
                log.close()
            deadline = time.monotonic() + self.startup_timeout
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    break
                if self._answers():
                    return self
                time.sleep(0.05)
            last = self.log_tail()
            self._kill()
        self.stop()
        raise RuntimeError(f"gcp-storage-emulator did not start on {self.url}:\n{last}")

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/storage/v1/b/{self.bucket}",
                                        timeout=1) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def create_bucket(self, name: str) -> None:
        """Create another bucket."""
        req = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=test", data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def stop(self) -> None:
        """Stop the emulator (its data is gone) and remove its work directory."""
        self._kill()
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None


_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
    "upgrade", "content-length", "server", "date",
})


class FlakyProxy:
    """A loopback HTTP reverse proxy that injects transient faults.

    Each request is either forwarded, or turned into a fault: a 503 answer with a GCS-style
    JSON error, a connection reset before anything is forwarded, or (``lost``) forwarded and
    then answered with a reset, so the request took effect but its response was lost.

    Args:
        upstream: base URL of the server to forward to.
        fail_first: the first N requests all fail.
        fail_rate: fraction (0..1) of later requests that fail.
        reset_fraction: of the failing requests, the fraction that are resets.
        lost_fraction: of the failing requests, the fraction forwarded and then reset.
        seed: seed of the fault choices, for reproducible runs.
        host: loopback address to listen on (the port is chosen by the OS).

    Attributes:
        counts: ``requests``, ``forwarded``, ``status_503``, ``resets``, ``lost`` so far.
        log: ``(method, path, outcome)`` of every request, outcome one of ``forward``,
            ``status_503``, ``resets``, ``lost``.
    """

    def __init__(self, upstream: str, *, fail_first: int = 0, fail_rate: float = 0.0,
                 reset_fraction: float = 0.0, lost_fraction: float = 0.0, seed: int = 0,
                 host: str = "127.0.0.1") -> None:
        up = urlsplit(upstream)
        self._up_host, self._up_port = up.hostname or "127.0.0.1", up.port or 80
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self.configure(fail_first=fail_first, fail_rate=fail_rate,
                       reset_fraction=reset_fraction, lost_fraction=lost_fraction)
        self.counts = {"requests": 0, "forwarded": 0, "status_503": 0, "resets": 0, "lost": 0}
        self.log: list[tuple[str, str, str]] = []  # (method, path, outcome) per request
        self._server = ThreadingHTTPServer((host, 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def configure(self, *, fail_first: int | None = None, fail_rate: float | None = None,
                  reset_fraction: float | None = None,
                  lost_fraction: float | None = None) -> None:
        """Change fault settings; ``fail_first`` counts from the next request."""
        with self._lock:
            if fail_first is not None:
                self._fail_budget = fail_first
            if fail_rate is not None:
                self._fail_rate = fail_rate
            if reset_fraction is not None:
                self._reset_fraction = reset_fraction
            if lost_fraction is not None:
                self._lost_fraction = lost_fraction

    def faults(self) -> int:
        """Requests that failed so far."""
        with self._lock:
            return self.counts["status_503"] + self.counts["resets"] + self.counts["lost"]

    def _decide(self, method: str, path: str) -> str:
        kind = self._choose()
        with self._lock:
            self.log.append((method, path, kind))
        return kind

    def _choose(self) -> str:
        with self._lock:
            self.counts["requests"] += 1
            if self._fail_budget > 0:
                self._fail_budget -= 1
            elif self._rng.random() >= self._fail_rate:
                self.counts["forwarded"] += 1
                return "forward"
            r = self._rng.random()
            if r < self._reset_fraction:
                kind = "resets"
            elif r < self._reset_fraction + self._lost_fraction:
                kind = "lost"
                self.counts["forwarded"] += 1
            else:
                kind = "status_503"
            self.counts[kind] += 1
            return kind

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                length = self.headers.get("Content-Length")
                if length:
                    return self.rfile.read(int(length))
                if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            self.rfile.readline()
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return b""

            def _reset(self) -> None:
                self.close_connection = True
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                           struct.pack("ii", 1, 0))
                self.connection.close()

            def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in _HOP_BY_HOP}
                if body or self.command in ("POST", "PUT", "PATCH"):
                    headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection(proxy._up_host, proxy._up_port, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    return resp.status, resp.reason, resp.getheaders(), resp.read()
                finally:
                    conn.close()

            def _handle(self) -> None:
                body = self._body()
                kind = proxy._decide(self.command, self.path)
                if kind == "resets":
                    self._reset()
                    return
                if kind == "status_503":
                    payload = json.dumps({"error": {
                        "code": 503, "message": "injected by FlakyProxy",
                        "errors": [{"reason": "backendError",
                                    "message": "injected by FlakyProxy"}]}}).encode()
                    self.send_response(503, "Service Unavailable")
                    self.send_header("Content-Type", "application/json; charset=UTF-8")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                status, reason, headers, data = self._forward(body)
                if kind == "lost":
                    self._reset()
                    return
                self.send_response(status, reason)
                for k, v in headers:
                    if k.lower() not in _HOP_BY_HOP:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _handle

        return Handler

    def start(self) -> "FlakyProxy":
        """Serve in a daemon thread."""
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="flaky-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the listening socket."""
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> "FlakyProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[GcsEmulator]:
    """A running emulator with bucket ``mtcfs-test`` for the whole session.

    Tests share it: give each test its own object prefix (e.g. a uuid).
    """
    pytest.importorskip("gcp_storage_emulator")
    with GcsEmulator() as emu:
        yield emu
