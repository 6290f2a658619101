"""The background budget on real mounts (issue 45): a seal's hashing runs on threads of the
budget's scheduling class and CPUs while the threads serving FUSE keep theirs; replication
and backup keep to their byte rates, and status says what the budget held back and when
backups fall behind their interval."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from support.mount import one_line_error

MiB = 1 << 20
SCHED_NAMES = {os.SCHED_OTHER: "normal", os.SCHED_BATCH: "batch", os.SCHED_IDLE: "idle"}


def _threads(pid: int) -> dict[int, tuple[str, frozenset[int]]]:
    """tid -> (scheduling class, CPUs) of every thread of ``pid``, as ``chrt -p`` and
    ``taskset -p`` show them."""
    out = {}
    for name in os.listdir(f"/proc/{pid}/task"):
        tid = int(name)
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[tid] = (SCHED_NAMES.get(int(fields[38]), fields[38]),
                        frozenset(os.sched_getaffinity(tid)))
        except (OSError, ValueError):
            continue  # ended meanwhile
    return out


@pytest.mark.parametrize("sched", ["idle", "batch", "normal"])
def test_a_seal_hashes_on_background_threads_and_fuse_keeps_its_class(make_mount, sched):
    cpu = max(os.sched_getaffinity(0))
    opts = {"bg_sched": sched, "bg_cpus": str(cpu), "chunk_size": "1M", "hash_threads": 2}
    if sched == "batch":
        opts["bg_nice"] = 5
    if sched == "idle":
        opts["daemon_nice"] = 7  # the daemon's own autogroup (it leads its session)
    m = make_mount("n", **opts)
    data = random.Random(1).randbytes(24 * MiB + 5)
    m.path("model.bin").write_bytes(data)
    m.wait_state("model.bin", "local", 60)
    assert m.path("model.bin").read_bytes() == data
    threads = _threads(m.pid)
    main_class, main_cpus = threads[m.pid]
    assert main_class == "normal" and main_cpus == frozenset(os.sched_getaffinity(0))
    bg = {tid for tid, (cls, cpus) in threads.items() if cpus == {cpu}}
    st = m.status()["budget"]["cpu"]
    assert st["sched"] == sched and st["cpus"] == str(cpu) and st["error"] is None
    assert st["threads"] >= 2 and st["cpu_s"] > 0  # the seal's thread and its helper
    assert len(bg) >= st["threads"], (threads, st)
    assert {threads[t][0] for t in bg} == {sched}
    if sched == "batch":
        assert all(os.getpriority(os.PRIO_PROCESS, t) == 5 for t in bg)
    with open(f"/proc/{m.pid}/autogroup") as f:
        group = f.read().split()
    assert group[-1] == ("7" if sched == "idle" else "0")
    assert group[-1] in m.status()["budget"]["daemon_group"]
    line = [ln for ln in m.cli("status", str(m.mnt)).stdout.splitlines()
            if ln.strip().startswith("budget:")]
    assert line and f"background work {sched}" in line[0] and f"CPUs {cpu}" in line[0]


def test_budget_options_are_checked_with_one_line_and_exit_2(make_mount):
    m = make_mount("n", start=False)
    for opts, words in ((f"bg_cpus={os.cpu_count() + 3}", ("bg_cpus", "may not run on")),
                        ("bg_sched=fast", ("bg_sched", "idle, batch or normal")),
                        ("bg_nice=3", ("bg_nice", "bg_sched=idle")),
                        ("replicate_rate=1M,chunk_size=64M", ("replicate_rate", "at least 7M")),
                        ("backup_threads=0", ("backup_threads",))):
        r = m.cli(m.job, str(m.mnt), "-o", f"store={m.store},{opts}", check=False)
        one_line_error(r, 2, *words)
    assert not os.path.ismount(m.mnt)


def _step(root: Path, name: str, size: int, seed: int) -> bytes:
    data = random.Random(seed).randbytes(size)
    (root / name).mkdir()
    (root / name / "model.bin").write_bytes(data)
    (root / name / "commit_success.txt").write_bytes(b"ok")
    return data


def test_replication_and_backup_keep_to_their_rates_and_status_says_so(make_cluster,
                                                                        tmp_path):
    """Rank 0 replicates and backs up at 1 MiB/s each: 4 MiB take about 3.75 s (the first
    0.25 s of the rate goes at once); a second step committed meanwhile makes the backup
    fall behind its interval of one checkpoint, and status says so."""
    c = make_cluster(2, options={"size": "256M", "chunk_size": "256K", "replicas": 1},
                     per_rank_options={0: {"backup": f"file://{tmp_path}/backup",
                                           "backup_interval": "1ckpt",
                                           "replicate_rate": "1M", "backup_rate": "1M"}})
    m = c.node(0)
    t0 = time.monotonic()
    _step(m.mnt, "step_1", 4 * MiB, 1)
    m.wait_for(lambda: (m.status()["backup"] or {}).get("uploading") == "step_1", 30,
               "the backup of step_1 to start")
    _step(m.mnt, "step_2", 4 * MiB, 2)  # committed while step_1 is being uploaded
    m.wait_for(lambda: [r.get("last_replicated") for r in
                        m.status()["peers"]["replication"]] != [None], 60, "replicated")
    took = time.monotonic() - t0
    m.wait_for(lambda: (m.status()["backup"] or {}).get("backups", 0) >= 1, 60, "a backup")
    st = m.status()
    peers, backup = st["budget"]["peers"], st["budget"]["backup"]
    assert peers["rate"] == backup["rate"] == MiB
    assert took >= 3.0 and peers["waited_s"] >= 2.5 and peers["bytes"] >= 4 * MiB, (took, peers)
    assert backup["waited_s"] >= 2.5 and backup["bytes"] >= 4 * MiB, backup
    assert st["backup"]["last_budget_wait_s"] >= 2.5
    behind = st["backup"]["behind"]
    assert behind and "committed during" in behind and "backup_rate" in behind, behind
    text = m.cli("status", str(m.mnt)).stdout
    assert "BEHIND its interval" in text and "replication at most 1.0 MiB/s" in text
    assert "backups fall behind backup_interval=1ckpt" in m.log()
