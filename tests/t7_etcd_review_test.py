"""Review of issue 39's etcd side: what a job member with etcdctl, or an unlucky operator,
could still do after the strict decoders went in (each test failed before its fix).

* A bad record read again on every periodic read (the step records every ~10 s) is one
  refusal: ``mtcfs status``'s ``etcd: N records refused`` and the metric do not climb for
  ever, and the record refused once (a member's) is still among the last shown.
"""

from __future__ import annotations

from mtcfs.base import untrusted
from mtcfs.tiers.coord.membership import MemberView, member_key
from mtcfs.tiers.coord.steps import StepRecords
from support.etcd import etcd_client, etcd_prefix, etcd_server  # noqa: F401 (fixtures)


def test_a_bad_record_read_on_every_round_is_one_refusal(client, etcd_prefix,  # noqa: F811
                                                         monkeypatch):
    """Before: the membership loop's read of the step records (every ~10 s) counted the
    same bad record again each time: 31 refusals after 30 reads, and the last ten shown in
    status were all that one record, pushing out the member record refused before it."""
    rejected = untrusted.RejectedRecords()
    monkeypatch.setattr(untrusted, "REJECTED", rejected)
    client.put(member_key(etcd_prefix, 5), b"[5]")
    view = MemberView(client, etcd_prefix)
    view._load_view()  # the member view's first read (and its reload after a failure)
    view._load_view()
    steps = StepRecords(client, etcd_prefix, 0)
    steps.record([1, 2])
    client.put(f"{etcd_prefix}steps/000001".encode(), b'{"rank":1,"steps":[1e400]}')
    for _ in range(30):  # five minutes of the membership loop
        assert steps.newest_complete_everywhere(2) is None
    snap = rejected.snapshot()
    assert snap["total"] == 2 and snap["by_kind"] == {"member": 1, "steps": 1}, snap
    assert sorted(x["kind"] for x in snap["last"]) == ["member", "steps"], snap["last"]
    # a record that changes and is refused again, for another reason, counts again
    client.put(f"{etcd_prefix}steps/000001".encode(), b'{"rank":1,"steps":"x"}')
    steps.newest_complete_everywhere(2)
    assert rejected.snapshot()["by_kind"] == {"member": 1, "steps": 2}
