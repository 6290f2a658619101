"""Malformed records in the job's etcd keys, against real daemons (issue 39, items 3 and 4).

Any member of a job (or anyone, on an etcd without auth) can put any bytes under the job's
prefix. A record that does not decode must be skipped and reported (``mtcfs status``:
``etcd: N records refused``), and must never kill the member view's watch, a mount, or a
restore:

* bad member records (``members/<rank>`` = ``[1]``, ``null``, ``5``, ``{"rank":1e400}``,
  ``{"rank":1,"labels":5}``, ``not json``): a node mounts while they are there, and a rank
  killed with -9 afterwards is still seen dead by the others (their watch lives on);
* a bad restore decision (``restore/current`` = ``not json``): a replacement node (kill -9,
  store wiped) still gets its step back from its peer, as if there were no decision;
* a bad step record of its own rank (``steps/000001`` = ``{"rank":1,"steps":[1e400]}``):
  that rank still mounts, restores from its peer, and writes a good record again.

Each test is one small real cluster (2 ranks, the tests' shared etcd, liveness 5 s).
"""

from __future__ import annotations

import json
import random

import pytest

from mtcfs.tiers.coord.etcd import Etcd
from support.etcd import shared_etcd
from support.poll import wait_with_logs as _wait

MiB = 1 << 20

#: Member records that broke every node's member view before issue 39 (and the mount).
BAD_MEMBERS = {9: b"[1]", 8: b"null", 7: b"5", 6: b'{"rank":1e400}',
               5: b'{"rank":1,"labels":5}', 4: b"not json",
               3: b'{"rank":1,"address":"127.0.0.1:1"}'}  # key and body disagree


@pytest.fixture
def etcd():
    c = Etcd(shared_etcd().endpoints, timeout_s=5.0)
    yield c
    c.close()


def _prefix(cluster) -> str:
    return cluster.coord_prefix + "/"


def _alive(cluster, rank: int) -> list[bool]:
    """Which members ``rank`` sees alive, by rank (its view of etcd's leases)."""
    return [m["alive"] for m in cluster.status(rank)["peers"]["members"]]


def _write_step(mount, step: str, files: dict[str, bytes]) -> None:
    d = mount.path(step)
    d.mkdir()
    for name, data in files.items():
        (d / name).write_bytes(data)
    (d / "commit_success.txt").write_bytes(b"ok")  # commits the step


def _files(rank: int) -> dict[str, bytes]:
    return {"model.bin": random.Random(rank).randbytes(MiB + 4321), "meta.json": b"{}"}


def _assert_step(mount, step: str, files: dict[str, bytes]) -> None:
    assert sorted(p.name for p in mount.mnt.iterdir()) == [step]
    for name, data in files.items():
        assert mount.path(step, name).read_bytes() == data, f"{step}/{name} differs"


def test_bad_member_records_break_neither_mounts_nor_the_member_view(make_cluster, etcd):
    c = make_cluster(2)
    _wait(lambda: all(_alive(c, r) == [True, True] for r in (0, 1)), 15,
          "both ranks see each other alive", c, (0, 1))
    members = _prefix(c) + "members/"
    for rank, body in BAD_MEMBERS.items():
        etcd.put(f"{members}{rank:06d}".encode(), body)

    # rank 0's view still follows etcd's leases: rank 1 killed is seen dead one TTL later
    c.kill9(1)
    _wait(lambda: _alive(c, 0) == [True, False], 15, "rank 0 sees rank 1 dead", c, (0,))
    # a node of the job mounts while they are there (rank 1 restarts on the same store)
    c.restart(1)
    _wait(lambda: all(_alive(c, r) == [True, True] for r in (0, 1)), 15,
          "both ranks see each other alive after rank 1's restart", c, (0, 1))

    # each bad record is refused and shown, never taken as a member
    st = c.status(0)
    rej = st["rejected_records"]
    assert rej["by_kind"].get("member", 0) >= len(BAD_MEMBERS), rej
    assert {x["key"] for x in rej["last"]} & {f"{members}{r:06d}" for r in BAD_MEMBERS}, rej
    assert [m["rank"] for m in st["peers"]["members"]] == [0, 1]
    out = c.node(0).cli("status", str(c.node(0).mnt)).stdout
    [line] = [x for x in out.splitlines() if x.strip().startswith("etcd:")]
    assert "records refused and skipped" in line and f"{members}0000" in line, line
    assert "(member)" in line, line


def test_a_bad_restore_decision_or_step_record_does_not_stop_a_restore(make_cluster, etcd):
    c = make_cluster(2)
    files = {r: _files(r) for r in (0, 1)}
    for r in (0, 1):
        _write_step(c.node(r), "step_10", files[r])
    for r in (0, 1):
        c.wait_replicated(r, "step_10", timeout=30)
    prefix = _prefix(c)

    # a decision that is not JSON, newer than every record: taken as no decision (decided
    # again); rank 1 is replaced (crash, store wiped) and gets step_10 back from rank 0
    c.kill9(1)
    etcd.put(f"{prefix}restore/current".encode(), b"not json")
    m1 = c.restart(1, wipe=True)
    _assert_step(m1, "step_10", files[1])
    st = c.status(1)
    assert st["restore"]["step"] == "step_10", st["restore"]
    assert st["restore"]["manifest_from"] == "peer rank 0", st["restore"]
    assert st["errors"] == [], st["errors"]
    assert st["peers"]["restore"]["decision"]["step"] == 10, st["peers"]["restore"]
    assert st["rejected_records"]["by_kind"].get("restore", 0) >= 1, st["rejected_records"]

    # its own step record spoiled (a step number past any integer): it mounts, restores
    # from its peer, and writes a good record again
    _wait(lambda: c.status(1)["restore"]["pending_chunks"] == 0, 20, "restore finished",
          c, (1,))
    c.kill9(1)
    key = f"{prefix}steps/000001".encode()
    etcd.put(key, b'{"rank":1,"steps":[1e400]}')
    m1 = c.restart(1, wipe=True)
    _assert_step(m1, "step_10", files[1])
    st = c.status(1)
    assert st["errors"] == [], st["errors"]
    assert st["rejected_records"]["by_kind"].get("steps", 0) >= 1, st["rejected_records"]

    def recorded() -> list | None:
        kv, _rev = etcd.get(key)
        try:
            return json.loads(kv.value, parse_constant=float)["steps"]
        except (AttributeError, ValueError, KeyError, TypeError):
            return None

    _wait(lambda: recorded() == [10], 15, "rank 1's step record names step 10 again", c, (1,))
