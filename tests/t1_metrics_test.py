"""mtcfs metrics: the status dict rendered as Prometheus text, parsed back (with
prometheus-client's own parser). No mount: pure functions."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from mtcfs.metrics import prometheus_text

STATUS = {
    "job": "llama", "node": "host-a", "ram": {"capacity": 100, "used": 40, "checkpoints": 2},
    "errors": ["x"],
    "counters": {"bytes_written": 7, "enospc": 0},
    "backup": {"backups": 3, "failures": 1, "total_bytes_uploaded": 9, "pending": ["step_2"],
               "last_seconds": 1.5},
    "restore": {"pending_chunks": 4, "pending_bytes": 16, "chunks_from": {"peers": 5,
                                                                          "backup": 0}},
    "peers": {"rank": 1, "nodes": 3, "membership": {"registered": True},
              "latest_complete": {"step": "step_20", "number": 20},
              "members": [{"rank": 0, "alive": True, "member_for_s": 0.5},
                          {"rank": 2, "alive": False, "member_for_s": 31.0}],
              "replication": [{"peer": 2, "state": "unreachable", "lag_steps": 2,
                               "lag_bytes": 1024, "bytes_sent": 10, "chunks_skipped": 1}],
              "replica_store": {"used_bytes": 77, "corrupt_deleted": 1},
              "bad_peers": {"0": 2}},
}

def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample, keyed by (name, frozenset of (label, value))."""
    assert text.endswith("\n")
    out = {}
    for family in text_string_to_metric_families(text):
        assert family.type in ("gauge", "counter") and family.documentation, family.name
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def test_metrics_cover_ram_backup_restore_and_peers():
    s = samples(prometheus_text(STATUS))
    job = {("job", "llama"), ("rank", "1"), ("node", "host-a")}

    def get(name, **labels):
        return s[(name, frozenset(job | {(k, str(v)) for k, v in labels.items()}))]

    assert get("mtcfs_ram_used_bytes") == 40 and get("mtcfs_errors") == 1
    assert get("mtcfs_bytes_written_total") == 7
    assert get("mtcfs_backup_failures_total") == 1 and get("mtcfs_backup_pending") == 1
    assert get("mtcfs_restore_chunks_total", tier="peers") == 5
    assert get("mtcfs_peer_registered") == 1
    assert get("mtcfs_peer_latest_complete_step") == 20
    assert get("mtcfs_peer_member_alive", member=2) == 0
    assert get("mtcfs_peer_replication_lag_steps", peer=2) == 2
    assert get("mtcfs_peer_replication_up", peer=2) == 0
    assert get("mtcfs_peer_bad_chunks_total", peer=0) == 2


def test_metrics_of_a_single_node_without_tiers():
    text = prometheus_text({"job": 'a"b', "ram": {"capacity": 1, "used": 0,
                                                   "checkpoints": 0},
                            "counters": {}, "errors": [], "backup": None, "restore": None,
                            "peers": None})
    s = samples(text)
    assert 'job="a\\"b"' in text  # escaped in the text, the same value parsed back
    assert s[("mtcfs_ram_capacity_bytes", frozenset({("job", 'a"b')}))] == 1
    assert not any(name.startswith("mtcfs_peer") for name, _ in s)
