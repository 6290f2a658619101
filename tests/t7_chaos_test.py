"""Tier-11: the short chaos run (tests/support/chaos.py; the long form is examples/chaos.py,
docs/reliability.md).

Four real daemons per test on loopback, scope=node and scope=job, a DCP-style save loop, and
a fixed seed's schedule of faults: every kind at least once (SIGKILL with a replacement on a
wiped store and with a restart on the same store, SIGSTOP/SIGCONT, a partition, a chunk
corrupted in a RAM tier, a replica store, the backup tier and all of them, a backup
outage). Each test asserts that no invariant was violated (no wrong bytes, no read over the
bound, every committed step restorable unless the chaos destroyed it, durable means
durable, corruption in RAM is found by ``mtcfs verify``, progress after the faults, every
daemon serving, nothing left mounted or running), and that every kind of fault happened.
About 1-2 minutes each on 2 cores.
"""

from __future__ import annotations

import pytest

from support.chaos import FAULT_KINDS, ChaosConfig, run_chaos

# One fixed seed per scope: every kind once, in a seeded order (the long form, make chaos,
# draws many more).
FAULTS = len(FAULT_KINDS)


@pytest.mark.parametrize("scope,seed", [("node", 11), ("job", 12)])
def test_chaos_short(shm_dir, scope, seed):
    cfg = ChaosConfig(seed=seed, nodes=4, scope=scope, faults=FAULTS, read_timeout_s=15,
                      max_wall_s=300)
    res = run_chaos(cfg, root=shm_dir / "chaos")
    report = res.report()
    print(report)
    assert res.violations == [], report
    missing = [k for k in FAULT_KINDS if res.faults.get(k, 0) < 1]
    assert not missing, f"fault kinds that never happened: {missing}\n{report}"
    assert res.steps_committed >= FAULTS, report
    assert res.bytes_verified > 0 and res.final_files_checked > 0, report
