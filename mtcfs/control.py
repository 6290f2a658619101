"""The control channel between ``mtcfs`` subcommands and a running daemon.

A Unix socket in the store directory (its path is the root's ``user.mtcfs.control``
xattr, so a subcommand needs only the mount point). One request per connection: the client
sends one JSON line ``{"cmd": ..., ...}``; the server answers with zero or more progress
lines ``{"progress": [done, total]}`` and one final line ``{"ok": true, "result": ...}`` or
``{"ok": false, "error": "...", "errno": N}``.

Who may use it (docs/security-local.md): root and the daemon's own user only. The socket
file is mode 0600 from the moment it exists (bound inside a private 0700 directory, then
renamed into place), and every connection's peer uid is read with ``SO_PEERCRED``: any
other uid gets ``{"ok": false, "errno": EACCES}`` and nothing it sent is read.

The client side checks the other way: :func:`request` reads the uid of the process
serving the socket (``SO_PEERCRED``) before it sends a byte, and talks only to the uids it
is given (the CLI: the mount's user and root); every answer line is parsed under a size
limit and checked to be of the protocol's form, so a malformed or hostile answer is a
:class:`ControlError` with a one-line message, never an exception of another kind. Which
socket belongs to which mount is the CLI's part (``mtcfs.cli.find_control_socket``).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import struct
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


#: The private directory, beside the socket, that the socket is bound in before it is
#: renamed into place (mode 0700; a leftover of a killed daemon is removed first).
_BIND_DIR = ".ctl"


def allowed_uids() -> frozenset[int]:
    """The uids that may use this process's control socket: root and its effective uid."""
    return frozenset({0, os.geteuid()})


def peer_uid(sock: Any) -> int:
    """The uid of the process at the other end of Unix socket ``sock`` (``SO_PEERCRED``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def refusal(uid: int) -> str:
    """The message a caller of another uid gets (also printed by the CLI)."""
    me = os.geteuid()
    who = "root" if me == 0 else f"root and uid {me}, the user who mounted it"
    return (f"permission denied: only {who} may use this mount's control socket "
            f"(you are uid {uid})")


def _private_dir(parent: str) -> str:
    """A new directory ``parent/.ctl`` of mode 0700 that this process created (a leftover
    of a killed daemon, the store's lock makes sure, is removed first).

    Raises:
        OSError: it cannot be made, or a leftover that is not a directory of this uid.
    """
    d = os.path.join(parent, _BIND_DIR)
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(errno.EEXIST, f"{d} exists and is not this daemon's directory")
        for name in os.listdir(d):
            os.unlink(os.path.join(d, name))
        os.rmdir(d)
    os.mkdir(d, 0o700)  # fails if anyone made it meanwhile
    os.chmod(d, 0o700)
    return d


async def serve(path: str, handler: Handler, *, uids: frozenset[int] | None = None,
                task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Serve requests on Unix socket ``path`` until cancelled.

    Args:
        path: the socket's path (its directory must exist).
        handler: ``await handler(request, progress)`` -> the result (JSON-able).
        uids: the peer uids served; None: :func:`allowed_uids` (root and this process's
            effective uid). Any other gets an EACCES reply, and its request is not read.

    The socket file is mode 0600 from its first moment: it is bound in a private 0700
    directory and renamed over ``path``.
    """
    allowed = allowed_uids() if uids is None else uids
    parent = os.path.dirname(os.path.abspath(path))
    private = _private_dir(parent)
    tmp = os.path.join(private, "s")
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await sock.bind(tmp)
        os.chmod(tmp, 0o600)
        os.rename(tmp, path)  # replaces a stale socket of a killed daemon
    except BaseException:
        sock.close()
        raise
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        os.rmdir(private)
    sock.listen(16)
    listener = trio.SocketListener(sock)
    task_status.started()
    try:
        await trio.serve_listeners(lambda s: _one(s, handler, allowed), [listener])
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


async def _one(stream: trio.SocketStream, handler: Handler, allowed: frozenset[int]) -> None:
    async with stream:
        try:
            uid = peer_uid(stream.socket)
        except OSError:
            return
        if uid not in allowed:
            reply = {"ok": False, "error": refusal(uid), "errno": errno.EACCES}
            try:
                await stream.send_all(json.dumps(reply).encode() + b"\n")
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            return
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


#: The longest answer line a client reads (a longer one is refused, not read into memory).
MAX_REPLY = 64 << 20


def denied(sock_path: str) -> ControlError:
    """The error of a caller whom the socket's file modes keep out (EACCES)."""
    return ControlError(
        f"permission denied: only root and the user who mounted it may use this "
        f"mount's control socket ({sock_path}; you are uid {os.geteuid()})", errno.EACCES)


def printable(text: str, limit: int = 2000) -> str:
    """``text`` as one printable line of at most ``limit`` characters (another program's
    words for a terminal: a newline, tab or carriage return becomes a space, any other
    control character ``?``)."""
    out = "".join(c if c.isprintable() else " " if c in "\n\r\t" else "?"
                  for c in text[:limit])
    return out + "..." if len(text) > limit else out


def _uid_names(uids: frozenset[int]) -> str:
    """``{0}`` -> "root", ``{0, 1000}`` -> "uid 1000 or root"."""
    names = [f"uid {u}" for u in sorted(uids) if u != 0] + (["root"] if 0 in uids else [])
    return " or ".join(names)


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _answer(line: bytes) -> dict[str, Any]:
    """One answer line as a JSON object, checked to be of the protocol's form.

    Raises:
        ControlError: it is too long, not JSON, not an object, or a progress line whose
            value is not two counts.
    """
    if len(line) > MAX_REPLY:
        raise ControlError(f"the mtcfs daemon's answer is longer than {MAX_REPLY} bytes")
    try:
        msg = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise ControlError(f"the mtcfs daemon's answer is not JSON ({printable(str(exc), 80)})"
                           ) from None
    if not isinstance(msg, dict):
        raise ControlError(f"the mtcfs daemon's answer is not a JSON object but "
                           f"{type(msg).__name__}")
    if "progress" in msg:
        p = msg["progress"]
        if not (isinstance(p, list) and len(p) == 2 and all(map(_is_count, p))):
            raise ControlError("the mtcfs daemon's answer has a malformed progress line")
    return msg


def request(sock_path: str, cmd: str, timeout: float | None = None,
            peer_uids: frozenset[int] | None = None, **args: Any) -> Iterator[dict[str, Any]]:
    """Send one request (blocking client). Yields progress dicts ``{"progress": [done,
    total]}`` (two counts), then the result as the generator's final ``{"result": ...}``
    item (any JSON value: the caller checks its shape).

    Args:
        sock_path: the control socket.
        timeout: seconds for each socket operation (None: no limit).
        peer_uids: the uids the process serving the socket may run as (``SO_PEERCRED`` of
            the connection, read before a byte is sent). None: root and this process's
            effective uid.

    Raises:
        ControlError: the daemon is not reachable, is served by another uid, reported an
            error, or answered what is not of the protocol's form (not JSON, an answer line
            over :data:`MAX_REPLY` bytes, ...). Its message is one printable line.
    """
    allowed = allowed_uids() if peer_uids is None else peer_uids
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(sock_path)
        uid = peer_uid(s)
    except OSError as exc:
        s.close()
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise denied(sock_path) from None
        raise ControlError(f"cannot reach the mtcfs daemon at {sock_path}: "
                           f"{exc.strerror or exc}", exc.errno or 0) from None
    if uid not in allowed:
        s.close()
        raise ControlError(f"refusing the control socket {sock_path}: the process serving it "
                           f"runs as uid {uid}, not as {_uid_names(allowed)}", errno.EPERM)
    with s, s.makefile("rb") as f:
        try:
            s.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before it read the request: its reply is still to be read
        try:
            while line := f.readline(MAX_REPLY + 1):
                msg = _answer(line)
                if "progress" in msg:
                    yield msg
                    continue
                if msg.get("ok") is not True:
                    error, code = msg.get("error"), msg.get("errno")
                    raise ControlError(
                        printable(error) if isinstance(error, str) and error else
                        "the mtcfs daemon reported an error and did not say which",
                        code if isinstance(code, int) and not isinstance(code, bool) and
                        0 <= code < 4096 else 0)
                yield {"result": msg.get("result")}
                return
        except OSError as exc:  # a timeout, a reset connection
            raise ControlError(f"the mtcfs daemon's answer did not arrive: "
                               f"{exc.strerror or exc}", exc.errno or 0) from None
    raise ControlError("the mtcfs daemon closed the connection")


def call(sock_path: str, cmd: str, timeout: float | None = None,
         peer_uids: frozenset[int] | None = None, **args: Any) -> Any:
    """Like :func:`request` but ignores progress and returns the result."""
    result = None
    for msg in request(sock_path, cmd, timeout=timeout, peer_uids=peer_uids, **args):
        if "result" in msg:
            result = msg["result"]
    return result
