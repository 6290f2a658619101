"""Tier-9 tests: foreign or malformed records under a scope=job namespace's keys in etcd
(issue 39, item 2). Two real mounts, the session's real etcd, ``etcdctl put`` as an
attacker or a slip of an operator would. What a user checks: ``stat`` and ``touch`` work on
every node at once, the bad record is shown in ``mtcfs status`` and counted, and every node
skipped it the same way (same files, same log position, nothing diverged).
"""

from __future__ import annotations

import os
import time
import uuid

import pytest

from support.etcd import etcd_server  # noqa: F401 (fixture)


def _cluster(make_cluster, etcd, nodes: int = 2, start: bool = True):
    job = f"nb{uuid.uuid4().hex[:8]}"
    c = make_cluster(nodes, start=start, job=job,
                     options={"scope": "job", "replicas": 1, "coord": etcd.url,
                              "coord_timeout": "5s"})
    return c, c.coord_prefix.rstrip("/") + "/"


def _rejected(m) -> dict[str, str]:
    """{key: kind} of the records the node refused (``mtcfs status --json``)."""
    return {r["key"]: r["kind"] for r in m.status()["rejected_records"]["last"]}


def test_a_foreign_write_to_ns_last_does_not_wedge_the_namespace(make_cluster,
                                                                 etcd_server):  # noqa: F811
    """Before: ``put <prefix>ns/last x`` made stat of an existing file and touch of a new
    one EIO on every node (each read waited for an op at that revision, which never
    came). Now both work at once on both nodes, and status names the refused key."""
    c, prefix = _cluster(make_cluster, etcd_server)
    (c[0].mnt / "existing").write_bytes(b"kept")
    etcd_server.etcdctl("put", prefix + "ns/last", "x")
    for r in range(2):
        t0 = time.monotonic()
        assert os.stat(c[r].path("existing")).st_size == 4, r
        (c[r].mnt / f"new-{r}").touch()
        assert time.monotonic() - t0 < 4, (r, c[r].log()[-2000:])  # not a barrier timeout
    for r in range(2):
        assert sorted(os.listdir(c[r].mnt)) == ["existing", "new-0", "new-1"], r
        assert c[r].path("existing").read_bytes() == b"kept"
        c[r].wait_for(lambda r=r: _rejected(c[r]).get(prefix + "ns/last") == "ns_last",
                      timeout=10, what="the foreign ns/last shown in status")
        assert f"{prefix}ns/last (ns_last)" in c[r].cli("status", str(c[r].mnt)).stdout


def test_junk_ops_in_the_log_are_skipped_by_every_node_alike(make_cluster,
                                                             etcd_server):  # noqa: F811
    """Ops no node wrote: not JSON, a JSON array, a name of the wrong type, a uid past
    int64 (before: applied in memory, refused by SQLite: every node 'diverged'). Each is
    skipped by both nodes, reported with its key, and the namespace goes on: both nodes
    end at the same position with the same files and nothing diverged."""
    c, prefix = _cluster(make_cluster, etcd_server)
    os.mkdir(c[0].path("before"))
    junk = {
        "ns/op/000009/a": "not json",
        "ns/op/000009/b": "[1]",
        "ns/op/000009/c": '{"op":"mkdir","parent":1,"name":5,"mode":493,"uid":0,"gid":0}',
        "ns/op/000009/d": ('{"op":"mkdir","parent":1,"name":"huge","mode":493,'
                           '"uid":100000000000000000000000,"gid":0}'),
        "ns/op/000009/e": '{"op":"setattr","ino":1,"mode":1e400}',
    }
    for key, value in junk.items():
        etcd_server.etcdctl("put", prefix + key, value)
    os.mkdir(c[1].path("after"))
    for r in range(2):
        assert sorted(os.listdir(c[r].mnt)) == ["after", "before"], r
        c[r].wait_for(lambda r=r: all(_rejected(c[r]).get(prefix + k) == "ns_op"
                                      for k in junk),
                      timeout=10, what="every junk op reported")
    st = [c[r].status()["namespace"] for r in range(2)]
    assert st[0]["seq"] == st[1]["seq"] and st[0]["epoch"] == st[1]["epoch"], st
    assert st[0]["diverged"] == "" and st[1]["diverged"] == "", st
    os.mkdir(c[0].path("still-works"))
    assert c[1].path("still-works").is_dir()
    for r in range(2):  # the nodes' own ops are never taken for foreign ones
        assert prefix + "ns/last" not in _rejected(c[r]), _rejected(c[r])


def test_a_malformed_base_is_refused_at_join_and_running_nodes_go_on(make_cluster,
                                                                    etcd_server):  # noqa: F811
    """A base that does not decode: a node that joins fails at once with one line naming
    the key (before: a ValueError from int()), nothing is installed; the running nodes keep
    their namespace and go on changing it."""
    c, prefix = _cluster(make_cluster, etcd_server, nodes=3, start=False)
    c.start([0, 1])
    (c[0].mnt / "kept").write_bytes(b"kept")
    etcd_server.etcdctl("put", prefix + "ns/base", '{"incarnation":"x","rev":0}')
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as got:
        c.start([2])
    assert time.monotonic() - t0 < 30
    first = str(got.value).splitlines()[0]
    assert "cannot join the job's namespace in etcd" in first and \
        f"{prefix}ns/base in etcd is malformed (incarnation is a JSON string" in first, first
    os.mkdir(c[1].path("after"))
    for r in range(2):
        assert sorted(os.listdir(c[r].mnt)) == ["after", "kept"], r
        assert c[r].path("kept").read_bytes() == b"kept"
