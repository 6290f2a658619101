"""A Peer service in a process of its own, for tests that must see what a daemon sees: its
memory (RSS), whether it is still alive, and what it stores on disk.

``python -m tests.support.peer_daemon ROOT JOB NODES CAPACITY`` runs :func:`serve` over a
:class:`ReplicaStore` at ROOT on a free 127.0.0.1 port, prints ``ready <port>`` and serves
until its stdin closes. :class:`PeerDaemon` starts and stops it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class PeerDaemon:
    """A Peer server subprocess over a replica store at ``root``.

    Args:
        root: the replica store's directory (created by the server).
        job: the job it serves.
        nodes: ranks in the job.
        capacity: the store's capacity, bytes.
        log: where the server's log (stderr) goes.

    Raises:
        RuntimeError: if the server does not start (its log is in the message).
    """

    def __init__(self, root: Path, job: str, nodes: int, capacity: int, log: Path) -> None:
        self.root = Path(root)
        self.log = Path(log)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep)
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.support.peer_daemon", str(root), job, str(nodes),
                 str(capacity)],
                cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("ready "):
            self.kill()
            raise RuntimeError(f"peer daemon did not start: {line!r}\n{self.log_tail()}")
        self.port = int(line.split()[1])
        self.address = f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss(self) -> int:
        """Resident memory of the server process now, bytes."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for pid {self.pid}")

    def stored(self) -> dict[str, tuple[int, int, int]]:
        """What the store holds on disk: ``chunks/..`` and ``manifests/..`` file paths
        (relative to the root) -> ``(size, inode, mtime_ns)``. ``tmp/`` is left out."""
        out = {}
        for top in ("chunks", "manifests"):
            for dirpath, _dirs, files in os.walk(self.root / top):
                for name in files:
                    p = os.path.join(dirpath, name)
                    st = os.lstat(p)
                    out[os.path.relpath(p, self.root)] = (st.st_size, st.st_ino,
                                                          st.st_mtime_ns)
        return out

    def read(self, rel: str) -> bytes:
        return (self.root / rel).read_bytes()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def close(self, timeout: float = 30) -> int:
        """Close its stdin (it stops) and return its exit status."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def main(argv: list[str]) -> int:
    root, job, nodes, capacity = argv[0], argv[1], int(argv[2]), int(argv[3])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from mtcfs.tiers.peer import ReplicaStore, serve

    store = ReplicaStore(root, capacity)
    server = serve(store, "127.0.0.1:0", job, nodes, workers=4)
    print(f"ready {server.port}", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    server.stop(None).wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
