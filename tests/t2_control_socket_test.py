"""The control socket in-process (control.serve, no mount): who may connect, and a socket
file that is never open to other users, not even for a moment (docs/security-local.md).
"""

from __future__ import annotations

import errno
import os
import stat

import pytest
import trio

from mtcfs import control


def serve_and(path, fn, uids=None, handler=None):
    """Serve ``path`` under trio, run ``fn()`` in a thread (a blocking client), stop."""
    calls = []

    async def default(req, progress):
        calls.append(req)
        return {"pong": req["cmd"]}

    async def main():
        async with trio.open_nursery() as n:
            await n.start(lambda task_status: control.serve(
                str(path), handler or default, uids=uids, task_status=task_status))
            try:
                return await trio.to_thread.run_sync(fn)
            finally:
                n.cancel_scope.cancel()
    return trio.run(main), calls


def test_the_socket_is_0600_before_it_has_its_name(tmp_path, monkeypatch):
    """Bound in a private 0700 directory and made 0600 there, then renamed into place:
    even under umask 0 no other user could connect at any moment."""
    seen = []
    real_rename = os.rename

    def rename(src, dst):
        seen.append((stat.S_IMODE(os.stat(src).st_mode),
                     stat.S_IMODE(os.stat(os.path.dirname(src)).st_mode), dst))
        return real_rename(src, dst)
    monkeypatch.setattr(os, "rename", rename)
    path = tmp_path / "control.sock"
    old = os.umask(0)
    try:
        got, _calls = serve_and(path, lambda: (
            stat.S_IMODE(os.stat(path).st_mode), control.call(str(path), "status", timeout=10)))
    finally:
        os.umask(old)
    assert seen == [(0o600, 0o700, str(path))]
    assert got == (0o600, {"pong": "status"})
    assert not path.exists() and not (tmp_path / ".ctl").exists()


def test_a_caller_of_another_uid_is_refused(tmp_path):
    """SO_PEERCRED on every connection: a uid not served gets EACCES with a clear message,
    and its request never reaches the handler."""
    path = tmp_path / "control.sock"

    def client():
        with pytest.raises(control.ControlError) as ei:
            control.call(str(path), "gc", timeout=10)
        return ei.value
    exc, calls = serve_and(path, client, uids=frozenset({12345}))
    assert exc.errno == errno.EACCES
    assert str(exc).startswith("permission denied: only root")
    assert f"(you are uid {os.geteuid()})" in str(exc)
    assert calls == []


def test_root_and_the_daemons_user_are_served(tmp_path):
    assert control.allowed_uids() == {0, os.geteuid()}
    got, calls = serve_and(tmp_path / "c.sock",
                           lambda: control.call(str(tmp_path / "c.sock"), "checkpoints"))
    assert got == {"pong": "checkpoints"} and [c["cmd"] for c in calls] == ["checkpoints"]


def test_a_killed_daemons_leftovers_are_replaced(tmp_path):
    """A stale socket and bind directory (SIGKILL at the wrong moment) do not stop the next
    daemon; a bind directory that is not a directory of this uid does."""
    path = tmp_path / "control.sock"
    (tmp_path / ".ctl").mkdir(mode=0o755)
    (tmp_path / ".ctl" / "s").write_bytes(b"")
    path.write_bytes(b"stale")
    got, _ = serve_and(path, lambda: control.call(str(path), "status"))
    assert got == {"pong": "status"}
    (tmp_path / ".ctl").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(BaseExceptionGroup) as ei:  # the serving nursery's
        serve_and(path, lambda: None)
    [exc] = ei.value.exceptions
    assert isinstance(exc, OSError) and exc.errno == errno.EEXIST
    assert "is not this daemon's directory" in str(exc)
