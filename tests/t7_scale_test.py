"""The scale run's short form (benchmarks/bench_scale.py; the long form is ``make
bench-scale``, docs/benchmarks.md "The scale run"): 3 scope=job daemons, each in a network
namespace of its own on one bridge, learning each other's addresses from one etcd, with
mutual TLS between them. Every phase of the long form runs: the join, two saves committed
job-wide and replicated to a peer across the bridge, a file-create burst, a replacement
host that reads its shard back bit-exact from its peer, and a whole-job restart after which
every rank reads its shard back bit-exact (the harness raises on any other bytes)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from support import netns
from support.poll import wait_for

pytestmark = pytest.mark.skipif(netns.available() is not None,
                                reason=f"network namespaces: {netns.available()}")


def test_scale_run_short_form_each_daemon_in_its_own_network(shm_dir: Path,
                                                           monkeypatch) -> None:
    from benchmarks import bench_scale
    args = argparse.Namespace(saves=2, shard="64K", files=5, insecure=False, timeout=120.0)
    seen: dict[str, object] = {}
    real_join = bench_scale.Run.join

    def join(run: bench_scale.Run) -> dict:
        out = real_join(run)
        seen["ns"] = {r: os.readlink(f"/proc/{pid}/ns/net") for r, pid in run.pids().items()}
        seen["root"] = os.readlink("/proc/self/ns/net")

        def peers() -> dict | None:
            # a daemon learns the others through its etcd watch, after its own mount is up:
            # the last to join may not be known to the first yet (CI, stop 55)
            st = {r: run.cluster.status(r)["peers"] for r in range(run.n)}
            seen["listen"] = {r: st[r].get("listen") for r in range(run.n)}
            seen["learned"] = {r: {m["rank"]: m["address"] for m in st[r].get("members", [])}
                               for r in range(run.n)}
            known = all(len(seen["learned"][r]) >= run.n - 1  # type: ignore[index]
                        for r in range(run.n))
            return st if known else None

        try:
            wait_for(peers, 30, "every daemon to learn the other two from etcd")
        except TimeoutError:
            pass  # the assertions below say which address is missing
        seen["addrs"] = {r: f"{run.fabric.addr(r)}:7400" for r in range(run.n)}
        return out

    monkeypatch.setattr(bench_scale.Run, "join", join)
    out = bench_scale.one_n(shm_dir, 3, "job", args)
    # three daemons, three network namespaces, none of them the test's own
    nss = seen["ns"]
    assert isinstance(nss, dict) and len(set(nss.values())) == 3, seen
    assert seen["root"] not in nss.values(), seen
    # each listens on its own namespace's address; the others learned it from etcd
    assert seen["listen"] == seen["addrs"], seen
    learned = seen["learned"]
    assert isinstance(learned, dict), seen
    for r in range(3):
        assert {k: v for k, v in learned[r].items() if k != r} == \
            {k: v for k, v in seen["addrs"].items() if k != r}, seen  # type: ignore[union-attr]
    # every phase ran and was measured; each save was committed by all three ranks
    assert [s["commit_s"] > 0 for s in out["saves"]] == [True, True], out
    assert out["files"]["per_writer_ops_s"] > 0, out
    assert out["replace"]["s"] > 0 and out["restart"]["up_s"] > 0, out
    assert out["save"]["etcd_requests"] > 0, out
    assert 0 < out["rss_mib"]["median"] < 1024, out
