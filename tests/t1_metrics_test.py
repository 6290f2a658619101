"""mtcfs metrics: the status dict rendered as Prometheus text, parsed back (with
prometheus-client's own parser). No mount: pure functions."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

import pytest

from mtcfs.base.counters import Histogram
from mtcfs.core.records import StepRecord
from mtcfs.core.step_registry import backup_lag
from mtcfs.metrics import prometheus_text

STATUS = {
    "job": "llama", "node": "host-a", "ram": {"capacity": 100, "used": 40, "checkpoints": 2},
    "fuse": {"libfuse": "3.17.2", "killpriv_v2": True, "direct_writes": True,
             "direct_handles_opened": 12, "small_writer_threads": 2, "small_writer_opens": 5},
    "errors": ["x"],
    "counters": {"bytes_written": 7, "enospc": 0, "fault_waits": 3, "fault_timeouts": 1},
    "histograms": {"seal_seconds": {"bounds": [0.1, 1.0], "counts": [2, 0, 1], "sum": 7.25,
                                    "count": 3}},
    "backup": {"backups": 3, "failures": 1, "total_bytes_uploaded": 9, "pending": ["step_2"],
               "last_seconds": 1.5, "lag_steps": 2, "lag_seconds": 30.5,
               "store": {"corrupt_chunks": 0}},
    "restore": {"step": "step_20", "bytes": 100, "manifest_from": "peer rank 0",
                "files": 3, "pending_files": 1, "corrupt_chunks": 0,
                "pending_chunks": 4, "pending_bytes": 16, "chunks_from": {"peers": 5,
                                                                          "backup": 0}},
    "peers": {"rank": 1, "nodes": 3,
              "membership": {"registered": True, "connected": False, "lease_ttl_s": 10,
                             "lease_renewed_ago_s": 12.5, "etcd_errors": 4,
                             "reregistrations": 1},
              "latest_complete": {"step": "step_20", "number": 20},
              "members": [{"rank": 0, "alive": True, "member_for_s": 0.5},
                          {"rank": 2, "alive": False, "member_for_s": 31.0}],
              "replication": [{"peer": 2, "state": "unreachable", "lag_steps": 2,
                               "lag_bytes": 1024, "lag_seconds": 61.0, "bytes_sent": 10, "chunks_skipped": 1}],
              "replica_store": {"used_bytes": 77, "corrupt_deleted": 1},
              "bad_peers": {"0": 2}},
}

def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample, keyed by (name, frozenset of (label, value))."""
    assert text.endswith("\n")
    out = {}
    for family in text_string_to_metric_families(text):
        assert family.type in ("gauge", "counter", "histogram") and family.documentation, \
            family.name
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def test_metrics_cover_ram_backup_restore_and_peers():
    s = samples(prometheus_text(STATUS))
    job = {("job", "llama"), ("rank", "1"), ("node", "host-a")}

    def get(name, **labels):
        return s[(name, frozenset(job | {(k, str(v)) for k, v in labels.items()}))]

    assert get("mtcfs_ram_used_bytes") == 40 and get("mtcfs_errors") == 1
    assert get("mtcfs_direct_writes") == 1 and get("mtcfs_direct_handles_opened_total") == 12
    assert get("mtcfs_small_writer_threads") == 2
    assert get("mtcfs_small_writer_opens_total") == 5
    assert get("mtcfs_bytes_written_total") == 7
    assert get("mtcfs_backup_failures_total") == 1 and get("mtcfs_backup_pending") == 1
    assert get("mtcfs_restore_chunks_total", tier="peers") == 5
    assert get("mtcfs_peer_registered") == 1
    assert get("mtcfs_peer_latest_complete_step") == 20
    assert get("mtcfs_peer_member_alive", member=2) == 0
    assert get("mtcfs_peer_replication_lag_steps", peer=2) == 2
    assert get("mtcfs_peer_replication_up", peer=2) == 0
    assert get("mtcfs_peer_bad_chunks_total", peer=0) == 2
    assert get("mtcfs_peer_bad_chunks_total", peer=2) == 0  # present before the first one
    assert get("mtcfs_peer_replication_lag_seconds", peer=2) == 61
    assert get("mtcfs_peer_etcd_connected") == 0 and get("mtcfs_peer_lease_ttl_seconds") == 10
    assert get("mtcfs_peer_lease_renewed_age_seconds") == 12.5
    assert get("mtcfs_peer_etcd_errors_total") == 4
    assert get("mtcfs_fault_waits_total") == 3 and get("mtcfs_fault_timeouts_total") == 1
    assert get("mtcfs_backup_lag_steps") == 2 and get("mtcfs_backup_lag_seconds") == 30.5
    assert get("mtcfs_restore_total_bytes", tier="peers") == 100
    assert get("mtcfs_restore_done_bytes", tier="peers") == 84
    assert get("mtcfs_restore_done_files", tier="peers") == 2
    # the histogram: cumulative buckets, +Inf = count, sum
    assert [get("mtcfs_seal_seconds_bucket", le=le) for le in ("0.1", "1.0", "+Inf")] \
        == [2, 2, 3]
    assert get("mtcfs_seal_seconds_count") == 3 and get("mtcfs_seal_seconds_sum") == 7.25


def test_metrics_of_a_single_node_without_tiers():
    text = prometheus_text({"job": 'a"b', "ram": {"capacity": 1, "used": 0,
                                                   "checkpoints": 0},
                            "counters": {}, "errors": [], "backup": None, "restore": None,
                            "peers": None})
    s = samples(text)
    assert 'job="a\\"b"' in text  # escaped in the text, the same value parsed back
    assert s[("mtcfs_ram_capacity_bytes", frozenset({("job", 'a"b')}))] == 1
    assert not any(name.startswith("mtcfs_peer") for name, _ in s)


def test_a_histogram_counts_each_value_in_the_first_bucket_that_holds_it():
    h = Histogram([0.5, 2.0])
    for v in (0.1, 0.5, 0.6, 2.0, 9.0):
        h.observe(v)
    snap = h.snapshot()
    assert snap == {"bounds": [0.5, 2.0], "counts": [2, 2, 1], "sum": 12.2, "count": 5}
    s = samples(prometheus_text({"job": "j", "histograms": {"seal_seconds": snap}}))
    assert s[("mtcfs_seal_seconds_bucket", frozenset({("job", "j"), ("le", "0.5")}))] == 2
    assert s[("mtcfs_seal_seconds_bucket", frozenset({("job", "j"), ("le", "+Inf")}))] == 5
    with pytest.raises(ValueError):
        Histogram([1.0, 1.0])
    with pytest.raises(ValueError):
        Histogram([])


def test_backup_lag_counts_from_the_newest_backed_up_step():
    def rec(n: int, committed_s: int, backed: bool) -> StepRecord:
        return StepRecord(name=f"step_{n}", number=n, ino=n, committed_ns=committed_s * 10**9,
                          source="test", backed_up_ns=1 if backed else None)

    now = 1000 * 10**9
    assert backup_lag([], now) == (0, 0.0)
    assert backup_lag([rec(1, 900, False), rec(2, 950, False)], now) == (2, 100.0)
    assert backup_lag([rec(1, 900, True), rec(2, 950, False), rec(3, 990, False)],
                      now) == (2, 50.0)
    assert backup_lag([rec(1, 900, False), rec(2, 950, True)], now) == (0, 0.0)
