"""The control channel between ``mtcfs`` subcommands and a running daemon.

A Unix socket in the store directory (its path is the root's ``user.mtcfs.control``
xattr, so a subcommand needs only the mount point). One request per connection: the client
sends one JSON line ``{"cmd": ..., ...}``; the server answers with zero or more progress
lines ``{"progress": [done, total]}`` and one final line ``{"ok": true, "result": ...}`` or
``{"ok": false, "error": "...", "errno": N}``.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import trio

Progress = Callable[[int, int], None]
Handler = Callable[[dict[str, Any], Progress], Awaitable[Any]]

MAX_REQUEST = 1 << 20


class ControlError(Exception):
    """The daemon reported a failure, or cannot be reached."""

    def __init__(self, msg: str, errno_: int = 0) -> None:
        super().__init__(msg)
        self.errno = errno_


async def serve(path: str, handler: Handler, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Serve requests on Unix socket ``path`` until cancelled."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(16)
    listener = trio.SocketListener(sock)
    task_status.started()
    try:
        await trio.serve_listeners(lambda s: _one(s, handler), [listener])
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


async def _one(stream: trio.SocketStream, handler: Handler) -> None:
    async with stream:
        buf = b""
        while b"\n" not in buf and len(buf) < MAX_REQUEST:
            data = await stream.receive_some(65536)
            if not data:
                return
            buf += data
        out: list[bytes] = []
        wake = trio.Event()

        def progress(done: int, total: int) -> None:
            out.append(json.dumps({"progress": [done, total]}).encode() + b"\n")
            wake.set()

        try:
            req = json.loads(buf.split(b"\n", 1)[0])
            if not isinstance(req, dict) or "cmd" not in req:
                raise ValueError("request must be a JSON object with 'cmd'")
        except ValueError as exc:
            await stream.send_all(json.dumps({"ok": False, "error": str(exc)}).encode() + b"\n")
            return

        async def pump() -> None:
            nonlocal wake
            while True:
                await wake.wait()
                wake = trio.Event()
                while out:
                    await stream.send_all(out.pop(0))

        reply: dict[str, Any]
        async with trio.open_nursery() as n:
            n.start_soon(pump)
            try:
                reply = {"ok": True, "result": await handler(req, progress)}
            except OSError as exc:
                reply = {"ok": False, "error": exc.strerror or str(exc), "errno": exc.errno or 0}
            except Exception as exc:  # reported to the client, the daemon keeps serving
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            n.cancel_scope.cancel()
        for line in out:
            await stream.send_all(line)
        await stream.send_all(json.dumps(reply, default=str).encode() + b"\n")


def request(sock_path: str, cmd: str, timeout: float | None = None,
            **args: Any) -> Iterator[dict[str, Any]]:
    """Send one request (blocking client). Yields progress dicts, then returns the result
    as the generator's final ``{"result": ...}`` item.

    Raises:
        ControlError: the daemon is not reachable or reported an error.
    """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(sock_path)
    except OSError as exc:
        raise ControlError(f"cannot reach the mtcfs daemon at {sock_path}: {exc.strerror}") from None
    with s, s.makefile("rb") as f:
        s.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        for line in f:
            msg = json.loads(line)
            if "progress" in msg:
                yield msg
                continue
            if not msg.get("ok"):
                raise ControlError(msg.get("error", "unknown error"), msg.get("errno", 0))
            yield {"result": msg.get("result")}
            return
    raise ControlError("the mtcfs daemon closed the connection")


def call(sock_path: str, cmd: str, timeout: float | None = None, **args: Any) -> Any:
    """Like :func:`request` but ignores progress and returns the result."""
    result = None
    for msg in request(sock_path, cmd, timeout=timeout, **args):
        if "result" in msg:
            result = msg["result"]
    return result
