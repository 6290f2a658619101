"""Tier-4: the series a dashboard reads, from real daemons scraped over HTTP.

Each test scrapes ``/metrics`` (``metrics=HOST:PORT``) with urllib and reads it with
prometheus-client's parser, before and after what an application does: files written and
closed move the seal-latency histogram by exactly the files sealed and the byte counters by
exactly the bytes; a checkpoint not yet backed up shows as backup lag until ``mtcfs backup``;
a read of an evicted checkpoint counts fault-in waits. The Grafana dashboard in
deploy/kubernetes/monitoring may name only series a running job serves (so it cannot drift
from the code).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from support.cluster import free_ports
from support.mount import drop_page_cache
from support.peer import blob
from support.prom import Series, only, scrape

MiB = 1024 * 1024
DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes" / "monitoring" \
    / "grafana-dashboard.json"


def _address() -> str:
    return f"127.0.0.1:{free_ports(1)[0]}"


def _buckets(series: Series, name: str) -> list[tuple[float, float]]:
    """(le, cumulative count) of histogram ``name``'s one series, by le."""
    rows = [(float(dict(lab)["le"]), v) for lab, v in series[f"{name}_bucket"].items()]
    return sorted(rows)


def test_seal_latency_is_a_histogram_of_every_file_sealed(make_mount):
    address = _address()
    # (on the daemon's path: with passthrough the kernel moves the bytes, and the byte
    # counters count only what the daemon moved, docs/operations.md)
    m = make_mount(size="128M", chunk_size="1M", metrics=address, passthrough="no")
    before, types = scrape(address)
    assert types["mtcfs_seal_seconds"] == "histogram"
    assert types["mtcfs_bytes_written"] == types["mtcfs_bytes_read"] == "counter"
    sizes = [0, 1, 4096, 3 * MiB + 7, 9 * MiB]
    os.makedirs(m.path("step_5"))
    for i, n in enumerate(sizes):
        m.path("step_5", f"shard_{i}.bin").write_bytes(blob(i, n))
    m.wait_for(lambda: m.status()["counters"]["seals"] >= len(sizes), 60, "the seals")
    after, _ = scrape(address)
    seals = only(after, "mtcfs_seals_total") - only(before, "mtcfs_seals_total")
    assert seals == len(sizes)
    count = only(after, "mtcfs_seal_seconds_count") - only(before, "mtcfs_seal_seconds_count")
    assert count == len(sizes)
    buckets = _buckets(after, "mtcfs_seal_seconds")
    assert buckets[-1] == (float("inf"), only(after, "mtcfs_seal_seconds_count"))
    assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), buckets  # cumulative
    assert 0 < only(after, "mtcfs_seal_seconds_sum") < 60
    written = only(after, "mtcfs_bytes_written_total") - only(before,
                                                             "mtcfs_bytes_written_total")
    assert written == sum(sizes)
    # reads that reach the daemon (the page cache dropped) count what they returned
    p = m.path("step_5", "shard_4.bin")
    drop_page_cache(p)
    assert p.read_bytes() == blob(4, sizes[4])
    read = only(scrape(address)[0], "mtcfs_bytes_read_total") - only(
        after, "mtcfs_bytes_read_total")
    assert sizes[4] <= read < 2 * sizes[4]


def test_backup_lag_until_backed_up_and_fault_in_waits(make_mount, tmp_path):
    address = _address()
    m = make_mount(size="64M", chunk_size="1M", keep="1", metrics=address,
                   backup=f"file://{tmp_path}/backup", backup_interval="1000ckpt")
    s, _ = scrape(address)
    assert only(s, "mtcfs_backup_lag_steps") == 0 and only(s, "mtcfs_backup_lag_seconds") == 0
    data = {"step_1": blob(1, 6 * MiB), "step_2": blob(2, 5 * MiB)}
    for step, body in data.items():
        m.path(step).mkdir()
        m.path(step, "model.bin").write_bytes(body)
        m.path(step, "commit_success.txt").write_bytes(b"ok")
    m.wait_for(lambda: len(m.checkpoints()) == 2, 30, "both committed")
    time.sleep(1.1)
    s, _ = scrape(address)
    assert only(s, "mtcfs_backup_lag_steps") == 2  # 1000ckpt: nothing backed up yet
    assert only(s, "mtcfs_backup_lag_seconds") >= 1.0
    uploaded = only(s, "mtcfs_backup_uploaded_bytes_total")
    m.cli("backup", str(m.mnt))  # the newest (step_2), now
    s, _ = scrape(address)
    assert only(s, "mtcfs_backup_lag_steps") == 0 and only(s, "mtcfs_backup_lag_seconds") == 0
    assert only(s, "mtcfs_backup_uploaded_bytes_total") - uploaded >= 5 * MiB * 0.9
    assert only(s, "mtcfs_backup_corrupt_chunks_total") == 0
    m.cli("backup", str(m.mnt), "--step", "step_1")
    m.cli("gc", str(m.mnt))  # step_1 leaves RAM: in the backup, not the newest
    m.wait_for(lambda: m.status()["ram"]["used"] < 6 * MiB, 30, "step_1 out of RAM")
    before, _ = scrape(address)
    p = m.path("step_1", "model.bin")
    drop_page_cache(p)
    assert p.read_bytes() == data["step_1"]  # each chunk faulted in from the backup tier
    s, _ = scrape(address)

    def delta(name: str) -> float:
        return only(s, name) - only(before, name)

    assert delta("mtcfs_chunks_faulted_total") == 6
    assert delta("mtcfs_fault_waits_total") == 6
    assert delta("mtcfs_fault_errors_total") == delta("mtcfs_fault_timeouts_total") == 0


#: a metric name in PromQL: mtcfs_ followed by name characters
_NAME = re.compile(r"\bmtcfs_[a-zA-Z0-9_]+")


def _dashboard_names() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs: list[str] = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))

    walk(dash["panels"])
    for var in dash.get("templating", {}).get("list", []):
        q = var.get("query")
        exprs.append(q.get("query", "") if isinstance(q, dict) else str(q or ""))
    assert len(exprs) >= 15, exprs
    return {n for e in exprs for n in _NAME.findall(e)}


def test_the_dashboard_reads_only_series_a_running_job_serves(make_cluster, tmp_path):
    """Two ranks with the backup tier; rank 1 wiped and restored from its peer: every tier's
    families are then on its endpoint, and every name in the dashboard's PromQL with them."""
    addrs = {r: _address() for r in (0, 1)}
    c = make_cluster(2, options={"size": "64M", "chunk_size": "1M",
                                 "backup": f"file://{tmp_path}/backup"},
                     per_rank_options={r: {"metrics": a} for r, a in addrs.items()})
    for r in (0, 1):
        m = c.node(r)
        m.path("step_1").mkdir()
        m.path("step_1", "model.bin").write_bytes(blob(r, 3 * MiB))
        m.path("step_1", "commit_success.txt").write_bytes(b"ok")
    for r in (0, 1):  # each rank's step_1 confirmed by its peer (backed up, too)
        c.node(r).wait_for(lambda: all(row["lag_steps"] == 0 for row in
                                       c.status(r)["peers"]["replication"]), 60,
                           "replicated")
    c.restart(1, wipe=True)
    c.node(1).wait_for(lambda: c.status(1)["restore"]["pending_chunks"] == 0, 60,
                       "restore finished")
    served, types = scrape(addrs[1])
    samples = set(served)
    wanted = _dashboard_names()
    missing = {n for n in wanted if n not in samples}
    assert not missing, f"the dashboard asks for series no daemon serves: {sorted(missing)}"
    # and docs/operations.md lists every series served
    docs = (DASHBOARD.parents[3] / "docs" / "operations.md").read_text()
    hist = {n for n, t in types.items() if t == "histogram"}
    undocumented = {n for n in samples if n not in docs and not any(
        n == h + sfx for h in hist for sfx in ("_bucket", "_sum", "_count"))}
    assert not undocumented, f"docs/operations.md does not list {sorted(undocumented)}"
    # histograms: the dashboard reads the samples (_bucket), the family name is not a series
    assert "mtcfs_seal_seconds_bucket" in wanted and types["mtcfs_seal_seconds"] == "histogram"
    # what the panels show, on the restored rank
    assert only(served, "mtcfs_restore_done_bytes", tier="peers") == \
        only(served, "mtcfs_restore_total_bytes", tier="peers") == 3 * MiB + 2
    assert only(served, "mtcfs_restore_done_files", tier="peers") == \
        only(served, "mtcfs_restore_total_files", tier="peers") == 2
    assert only(served, "mtcfs_peer_registered") == only(served, "mtcfs_peer_etcd_connected") == 1
    assert 0 <= only(served, "mtcfs_peer_lease_renewed_age_seconds") < \
        only(served, "mtcfs_peer_lease_ttl_seconds")
    assert only(served, "mtcfs_peer_replication_lag_seconds", peer=0) >= 0
    assert only(served, "mtcfs_peer_bad_chunks_total", peer=0) == 0
