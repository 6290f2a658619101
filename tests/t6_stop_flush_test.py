"""The flush at a stop (mtcfs/flush.py): a node told to go away (SIGTERM: a preemption
notice, a drain, the pod's preStop, ``systemctl stop``) first gets its newest committed step
to the tiers that outlive it, within ``stop_flush=``, then exits; what it could not flush is
said, and said again by the next daemon on the same store.

Real daemons on loopback, a real etcd, a ``file://`` backup tier; replication made slow
with a failpoint (each chunk the peer stores takes 50 ms), so the step is certainly not on
the peer yet when the signal comes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from support.mount import MTCFS
from support.peer import blob

MiB = 1 << 20


def _wait_exit(pid: int, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"daemon {pid} still runs {timeout} s after the stop")


def _commit(step_dir, files: dict[str, bytes]) -> None:
    step_dir.mkdir()
    for name, data in files.items():
        (step_dir / name).write_bytes(data)
    (step_dir / "commit_success.txt").write_bytes(b"ok")


@pytest.mark.parametrize("how", ["sigterm", "umount --flush"])
def test_a_step_committed_just_before_the_stop_is_on_the_peer_and_in_the_bucket(
        make_cluster, tmp_path, monkeypatch, how):
    monkeypatch.setenv("MTCFS_FAILPOINTS", "peer.put_chunk=sleep(0.05)")
    bucket = tmp_path / "bucket"
    c = make_cluster(2, options={"replicas": 1, "chunk_size": "1M",
                                 "backup": f"file://{bucket}",
                                 "backup_interval": "1000ckpt"})
    data = blob(5, 24 * MiB + 3)  # 25 chunks: 1.25 s of storing on the peer
    d = c[0].path("step_10")
    pid = c[0].pid
    _commit(d, {"model.bin": data})
    t0 = time.monotonic()
    if how == "sigterm":
        os.kill(pid, signal.SIGTERM)
    else:
        r = subprocess.run(MTCFS + ["umount", str(c[0].mnt), "--flush", "--timeout", "60"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "flushed step_10" in r.stderr
    _wait_exit(pid, 60)
    took = time.monotonic() - t0
    c[0].pid = None
    # on the peer: rank 1 holds rank 0's manifest of step_10 and every chunk it names
    replicas = c[1].store / "replicas"
    assert (replicas / "manifests" / "0" / "step_10.json").exists(), \
        c[0].log()[-4000:] + "\n--- rank 1\n" + c[1].log()[-2000:]
    manifest = json.loads((replicas / "manifests" / "0" / "step_10.json").read_text())
    hashes = {h for e in manifest["entries"] for h in e.get("chunks") or []}
    assert len(hashes) == 26  # model.bin's 25 and commit_success.txt's
    assert all((replicas / "chunks" / h[:2] / h).exists() for h in hashes)
    # in the bucket: rank 0's part of step_10 is complete
    assert (bucket / "steps" / "step_10" / "rank-0" / "COMPLETE").exists()
    log = c[0].log()
    assert "flush at stop: step_10 replicated 1/1, backed up" in log, log[-3000:]
    last = json.loads((c[0].store / "last-stop.json").read_text())
    assert last["complete"] and last["step"] == "step_10"
    assert took >= 1.0  # it waited for the slow peer rather than leaving at once


def test_what_could_not_be_flushed_is_said_then_and_at_the_next_start(make_cluster):
    c = make_cluster(2, options={"replicas": 1, "stop_flush": "2s"})
    c.kill9(1)  # the only peer is gone: the step can reach no other tier
    _commit(c[0].path("step_10"), {"model.bin": blob(6, 3 * MiB)})
    pid = c[0].pid
    t0 = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    _wait_exit(pid, 30)
    took = time.monotonic() - t0
    c[0].pid = None
    assert 2.0 <= took < 15, f"the stop took {took:.1f} s with stop_flush=2s"
    log = c[0].log()
    assert "flush at stop: step_10 NOT flushed within 2.0 s: replicated 0/1" in log, \
        log[-3000:]
    m = c.restart(0)
    st = m.status()["stop_flush"]
    assert st["last_stop"]["complete"] is False and st["last_stop"]["step"] == "step_10"
    text = m.cli("status", str(m.mnt)).stdout
    assert "last stop: step_10 was NOT flushed to the other tiers (replicated 0/1)" in text


def test_a_second_signal_ends_the_wait(make_cluster):
    c = make_cluster(2, options={"replicas": 1, "stop_flush": "60s"})
    c.kill9(1)
    _commit(c[0].path("step_10"), {"model.bin": blob(7, MiB)})
    pid = c[0].pid
    os.kill(pid, signal.SIGTERM)
    time.sleep(0.5)  # the flush is waiting for the dead peer
    t0 = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    _wait_exit(pid, 30)
    c[0].pid = None
    assert time.monotonic() - t0 < 10
    assert "cut short by a second signal" in c[0].log()
