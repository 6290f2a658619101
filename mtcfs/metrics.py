"""Prometheus metrics of a mount's status: an HTTP endpoint and ``mtcfs metrics``.

With the mount option ``metrics=HOST:PORT`` the daemon serves them over HTTP at
``http://HOST:PORT/metrics`` (prometheus-client's server, :func:`serve`), built at each
scrape from the daemon's status (:class:`StatusCollector`). ``mtcfs metrics MOUNTPOINT``
prints the same families in the Prometheus text format (version 0.0.4), for
node_exporter's textfile collector or any scraper that runs a command, e.g. every 15 s::

    mtcfs metrics /mnt/ckpt > /var/lib/node_exporter/textfile/mtcfs.prom.tmp &&
        mv /var/lib/node_exporter/textfile/mtcfs.prom.tmp /var/lib/node_exporter/textfile/mtcfs.prom

Every series carries the ``job`` label (the mtcfs job, not Prometheus's), ``node`` (the
host name) and, on several nodes, ``rank``. Units are in the names (``_bytes``, ``_seconds``); counters end in
``_total``; seal latency is a histogram (``mtcfs_seal_seconds_bucket``/``_sum``/``_count``,
its bucket counts kept by the core in a :class:`~mtcfs.base.counters.Histogram`). Every
family is listed in docs/operations.md (Metrics).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)
from prometheus_client.metrics_core import Metric


class _Out:
    """The metric families of one status dict, in the order first added; a collector of a
    :class:`~prometheus_client.CollectorRegistry`."""

    def __init__(self, base: Mapping[str, object]) -> None:
        self.base = {k: str(v) for k, v in base.items()}
        self.families: dict[str, Metric] = {}

    def add(self, name: str, kind: str, help_: str, value: Any,
            labels: Mapping[str, object] | None = None) -> None:
        """Add one sample of ``name`` (a ``"gauge"`` or a ``"counter"`` ending in ``_total``);
        a value that is None or not a number is left out, a bool counts as 0 or 1."""
        if value is None:
            return
        if isinstance(value, bool):
            value = int(value)
        if not isinstance(value, (int, float)):
            return
        items = {**self.base, **{k: str(v) for k, v in (labels or {}).items()}}
        family = self.families.get(name)
        if family is None:
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                name, help_, labels=list(items))
            self.families[name] = family
        assert isinstance(family, (CounterMetricFamily, GaugeMetricFamily)), name
        family.add_metric(list(items.values()), value)

    def histogram(self, name: str, help_: str, snap: object,
                  labels: Mapping[str, object] | None = None) -> None:
        """Add one histogram sample of ``name`` from a :meth:`Histogram.snapshot
        <mtcfs.base.counters.Histogram.snapshot>` (bounds, per-bucket counts, sum); the
        family gets Prometheus's cumulative ``_bucket{le=...}``, ``_sum`` and ``_count``.
        A snapshot that is missing or malformed is left out."""
        if not isinstance(snap, Mapping):
            return
        bounds, counts = snap.get("bounds"), snap.get("counts")
        if not isinstance(bounds, list) or not isinstance(counts, list) \
                or len(counts) != len(bounds) + 1:
            return
        items = {**self.base, **{k: str(v) for k, v in (labels or {}).items()}}
        family = self.families.get(name)
        if family is None:
            family = HistogramMetricFamily(name, help_, labels=list(items))
            self.families[name] = family
        assert isinstance(family, HistogramMetricFamily)
        buckets, running = [], 0
        for le, n in zip([*(_le(b) for b in bounds), "+Inf"], counts):
            running += int(n)
            buckets.append((le, running))
        family.add_metric(list(items.values()), buckets, float(snap.get("sum") or 0.0))

    def collect(self) -> Iterator[Metric]:
        yield from self.families.values()


def _le(bound: float) -> str:
    """A bucket's ``le`` as Prometheus writes it: ``0.25``, ``1.0``, ``600.0``."""
    return repr(float(bound))


_COUNTER_HELP = {
    "bytes_written": "Bytes written by applications through the mount.",
    "bytes_read": "Bytes read by applications through the mount.",
    "seals": "File versions sealed (hashed) after their last close.",
    "chunks_faulted": "Chunks brought into RAM from another tier.",
    "bytes_faulted": "Bytes brought into RAM from another tier.",
    "fault_errors": "Chunk fetches by reads that failed with EIO (no source served a valid "
                    "copy within the fault-in deadline).",
    "enospc": "Writes refused because the RAM tier was full.",
    "evicted_steps": "Checkpoints evicted from RAM.",
    "fault_in_over_size": "Chunks a read brought into a full RAM tier that no eviction could"
                          " make room for (the tier goes past size= until evictions catch up).",
    "corrupt_chunks": "Chunks in RAM found not to match their hash (first read after a start,"
                      " scrub, mtcfs verify); dropped and fetched from another tier.",
    "deleted_unsaved_steps": "Checkpoints deleted from RAM under memory pressure while no"
                             " other tier held them (lost; evict_unsaved=yes).",
    "evicted_leftovers": "Incomplete leftovers of saves a crash interrupted, deleted under"
                         " memory pressure.",
    "fault_waits": "Chunk fetches from another tier (peers, backup) that a read or the"
                   " restore prefetcher waited for.",
    "seal_bytes_hashed": "Bytes read and hashed by seals (a rewrite of a sealed file hashes"
                         " only the chunks it changed).",
    "file_hash_bytes": "Bytes hashed to compute the whole-file blake3 of a file of more"
                       " than one chunk when it was asked for (user.mtcfs.blake3).",
    "foreign_getxattrs": "GETXATTRs of names outside user.*: the kernel's security.capability"
                         " before every write(2) when the mount could not negotiate"
                         " FUSE_HANDLE_KILLPRIV_V2 (docs/fuse-build.md).",
    "fault_timeouts": "Chunk fetches that ended at the fault-in deadline (read_deadline)"
                      " with no copy; the read got EIO. Also counted in"
                      " mtcfs_fault_errors_total.",
}

_HISTOGRAM_HELP = {
    "seal_seconds": "Seconds from the release (last close) of a written file to its version"
                    " sealed: hashed into chunks and recorded.",
}


log = logging.getLogger(__name__)


def prometheus_text(status: Mapping[str, Any]) -> str:
    """Render ``mtcfs status --json`` output as Prometheus text (one string, newline-ended;
    the text format 0.0.4 written by prometheus-client's ``generate_latest``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(status_families(status))
    return generate_latest(registry).decode()


class StatusCollector:
    """A prometheus-client collector that reads the daemon's status at each scrape.

    Args:
        fetch: returns the status dict (as ``mtcfs status --json``), or raises (e.g.
            TimeoutError: the daemon's loop did not answer in time). Called on the HTTP
            server's thread.

    Every scrape yields ``mtcfs_up`` (1: the status was read; 0: it was not, and then no
    other family) and the families of :func:`prometheus_text`.
    """

    def __init__(self, fetch: Callable[[], Mapping[str, Any]]) -> None:
        self.fetch = fetch

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("mtcfs_up", "1 if the daemon answered this scrape with its "
                               "status in time, else 0.")
        try:
            status = self.fetch()
        except Exception as exc:  # noqa: BLE001 (a scrape must answer, with up=0)
            log.warning("metrics scrape: no status: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from status_families(status).collect()


def serve(address: str, fetch: Callable[[], Mapping[str, Any]]) -> tuple[Any, threading.Thread]:
    """Serve ``/metrics`` at ``address`` (``HOST:PORT``; port 0: any free port) on a thread.

    Returns prometheus-client's (server, thread); ``server.server_address`` is where it
    listens, ``server.shutdown()`` stops it.

    Raises:
        OSError: the address cannot be bound (in use, not this host's).
    """
    host, _, port = address.rpartition(":")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(fetch))
    server, thread = start_http_server(int(port), host.strip("[]"), registry=registry)
    return server, thread


def status_families(status: Mapping[str, Any]) -> "_Out":
    """The metric families of one status dict (a collector)."""
    peers = status.get("peers") or None
    base: dict[str, object] = {"job": status.get("job", "")}
    if status.get("node"):
        base["node"] = status["node"]
    if peers:
        base["rank"] = peers.get("rank", 0)
    out = _Out(base)
    ram = status.get("ram") or {}
    out.add("mtcfs_ram_capacity_bytes", "gauge", "RAM tier budget (size=).",
            ram.get("capacity"))
    out.add("mtcfs_ram_used_bytes", "gauge",
            "RAM tier bytes in use (own files and peer replicas).", ram.get("used"))
    out.add("mtcfs_checkpoints", "gauge", "Committed checkpoints on this node.",
            ram.get("checkpoints"))
    out.add("mtcfs_errors", "gauge", "Errors currently listed by mtcfs status.",
            len(status.get("errors") or []))
    reads = status.get("reads") or {}
    out.add("mtcfs_read_deadline_seconds", "gauge",
            "Seconds a read waits for a missing chunk, every source included, before EIO.",
            reads.get("deadline_s"))
    out.add("mtcfs_suspect_peers", "gauge",
            "Peers asked last for chunks because they failed a fetch lately.",
            len(reads.get("suspect_peers") or []))
    fuse = status.get("fuse") or {}
    out.add("mtcfs_direct_writes", "gauge", "1 if handles that create or truncate a file are"
            " opened FOPEN_DIRECT_IO (mount option direct_writes, granted by the kernel).",
            fuse.get("direct_writes"))
    out.add("mtcfs_direct_handles_opened_total", "counter", "Handles opened FOPEN_DIRECT_IO"
            " (direct writes).", fuse.get("direct_handles_opened"))
    out.add("mtcfs_small_writer_threads", "gauge", "Threads whose new files go through the"
            " page cache because they wrote earlier ones in small pieces (direct_writes.py).",
            fuse.get("small_writer_threads"))
    out.add("mtcfs_small_writer_opens_total", "counter", "Handles opened through the page"
            " cache because their thread writes small pieces.", fuse.get("small_writer_opens"))
    if "passthrough" in fuse:
        out.add("mtcfs_passthrough", "gauge", "1 if the kernel reads and writes the store's"
                " files itself (FUSE passthrough; why not: mtcfs status).",
                fuse.get("passthrough"))
        for mode in ("read", "write"):
            out.add("mtcfs_passthrough_opens_total", "counter", "Handles the kernel serves"
                    " itself (FUSE passthrough), by open mode.",
                    fuse.get(f"passthrough_opens_{mode}"), {"mode": mode})
        for why, n in sorted((fuse.get("daemon_path_opens") or {}).items()):
            out.add("mtcfs_daemon_path_opens_total", "counter", "Handles served by the"
                    " daemon although passthrough is on, by reason.", n, {"reason": why})
    rejected = status.get("rejected_records") or {}
    for kind, n in sorted((rejected.get("by_kind") or {}).items()):
        out.add("mtcfs_rejected_records_total", "counter", "Records read back from etcd that"
                " did not parse as their kind and were skipped (mtcfs/base/untrusted.py).",
                n, {"kind": kind})
    for name, row in sorted((status.get("restarted_loops") or {}).items()):
        out.add("mtcfs_loop_restarts_total", "counter", "Restarts of a background loop (an"
                " etcd watch, a lease keepalive) after it failed.", row.get("restarts"),
                {"loop": name})
    for key, value in sorted((status.get("counters") or {}).items()):
        out.add(f"mtcfs_{key}_total", "counter", _COUNTER_HELP.get(key, key), value)
    for key, snap in sorted((status.get("histograms") or {}).items()):
        out.histogram(f"mtcfs_{key}", _HISTOGRAM_HELP.get(key, key), snap)
    scrub = status.get("scrub") or {}
    out.add("mtcfs_scrub_passes_total", "counter", "Scrub passes over the RAM tier finished.",
            scrub.get("passes"))
    out.add("mtcfs_scrub_last_finished_timestamp_seconds", "gauge",
            "Unix time the last scrub pass finished.", scrub.get("last_finished"))
    out.add("mtcfs_scrub_running", "gauge", "1 while a scrub pass runs.", scrub.get("running"))
    out.add("mtcfs_scrub_done_bytes", "gauge", "Bytes hashed so far by the scrub pass running"
            " (or the last one).", scrub.get("done_bytes"))
    out.add("mtcfs_scrub_total_bytes", "gauge", "Bytes the scrub pass running (or the last one)"
            " hashes.", scrub.get("total_bytes"))
    out.add("mtcfs_unverified_chunks", "gauge", "Chunks in RAM not hashed since the daemon"
            " started (verified on first read).", scrub.get("unverified_chunks"))
    out.add("mtcfs_start_verify_seconds", "gauge", "Seconds the verification at start took"
            " (every chunk in RAM at the daemon's start hashed in the background; absent"
            " while it runs).", scrub.get("start_seconds"))
    budget = status.get("budget") or {}
    cpu = budget.get("cpu") or {}
    out.add("mtcfs_background_cpu_seconds_total", "counter", "CPU seconds of the threads"
            " doing background work (seal hashing, replication, backup, scrub).",
            cpu.get("cpu_s"))
    out.add("mtcfs_background_runqueue_wait_seconds_total", "counter", "Seconds background"
            " threads were ready to run and waited for a CPU (bg_sched=, bg_cpus= hold them"
            " back while the job uses the CPUs).", cpu.get("runqueue_wait_s"))
    for tier in ("peers", "backup"):
        row = budget.get(tier)
        if isinstance(row, dict):
            out.add("mtcfs_budget_bytes_total", "counter", "Bytes background transfers sent"
                    " under their rate budget, by tier.", row.get("bytes"), {"tier": tier})
            out.add("mtcfs_budget_wait_seconds_total", "counter", "Seconds background"
                    " transfers waited for their rate budget (replicate_rate=, backup_rate=),"
                    " by tier.", row.get("waited_s"), {"tier": tier})
            out.add("mtcfs_budget_rate_bytes_per_second", "gauge", "The rate budget of a"
                    " tier's background transfers (0: unbounded).", row.get("rate"),
                    {"tier": tier})
    backup = status.get("backup")
    if backup:
        out.add("mtcfs_backup_behind", "gauge", "1 when backups fall behind their interval"
                " (why: mtcfs status).", backup.get("behind") is not None)
        out.add("mtcfs_backup_backups_total", "counter", "Checkpoints backed up.",
                backup.get("backups"))
        out.add("mtcfs_backup_failures_total", "counter", "Failed backup attempts.",
                backup.get("failures"))
        out.add("mtcfs_backup_uploaded_bytes_total", "counter",
                "Compressed bytes uploaded to the backup tier.",
                backup.get("total_bytes_uploaded"))
        out.add("mtcfs_backup_pending", "gauge", "Checkpoints waiting to be backed up.",
                len(backup.get("pending") or []))
        out.add("mtcfs_backup_last_seconds", "gauge", "Duration of the last backup.",
                backup.get("last_seconds"))
        out.add("mtcfs_backup_lag_steps", "gauge",
                "Committed checkpoints on this node newer than the newest one backed up.",
                backup.get("lag_steps"))
        out.add("mtcfs_backup_lag_seconds", "gauge",
                "Seconds since the oldest committed checkpoint newer than the newest one "
                "backed up was committed (0: the newest is backed up).",
                backup.get("lag_seconds"))
        out.add("mtcfs_backup_last_success_timestamp_seconds", "gauge",
                "Unix time the last backup finished.", backup.get("last_finished"))
        store = backup.get("store") or {}
        out.add("mtcfs_backup_corrupt_chunks_total", "counter",
                "Chunks downloaded from the backup tier that failed verification.",
                store.get("corrupt_chunks"))
    restore = status.get("restore")
    if restore:
        _restore_progress(out, restore)
        out.add("mtcfs_restore_pending_chunks", "gauge", "Chunks still to be restored.",
                restore.get("pending_chunks"))
        out.add("mtcfs_restore_pending_bytes", "gauge", "Bytes still to be restored.",
                restore.get("pending_bytes"))
        for tier, n in sorted((restore.get("chunks_from") or {}).items()):
            out.add("mtcfs_restore_chunks_total", "counter", "Chunks restored, by tier.", n,
                    {"tier": tier})
    if peers:
        _peer_metrics(out, peers)
    if status.get("mtc"):
        _mtc_metrics(out, status["mtc"])
    ns = status.get("namespace") or None
    if ns:
        _namespace_metrics(out, ns)
    return out


def _restore_progress(out: _Out, r: Mapping[str, Any]) -> None:
    """The restore at mount (or by ``mtcfs restore``): the step's bytes and files, done and
    in all, labelled with the tier its manifest came from (``peers`` or ``backup``)."""
    total = r.get("bytes")
    src = str(r.get("manifest_from") or "")
    lab = {"tier": "peers" if src.startswith("peer") else src or "none"}
    pending = r.get("pending_bytes") or 0
    if isinstance(total, int):
        out.add("mtcfs_restore_total_bytes", "gauge",
                "Bytes of the checkpoint being (or last) restored on this node.", total, lab)
        out.add("mtcfs_restore_done_bytes", "gauge",
                "Bytes of that checkpoint in RAM now (total less those still to fetch).",
                max(0, total - pending), lab)
    files = r.get("files")
    if isinstance(files, int):
        out.add("mtcfs_restore_total_files", "gauge",
                "Files of the checkpoint being (or last) restored on this node.", files, lab)
        out.add("mtcfs_restore_done_files", "gauge",
                "Files of that checkpoint with all their chunks in RAM.",
                max(0, files - int(r.get("pending_files") or 0)), lab)
    out.add("mtcfs_restore_corrupt_chunks_total", "counter",
            "Chunks a restore fetched that failed verification (fetched again elsewhere).",
            r.get("corrupt_chunks"))


def _mtc_metrics(out: _Out, m: Mapping[str, Any]) -> None:
    """Option mtc: the Orbax replicator protocol (docs/orbax-mtc.md)."""
    r = m.get("last_restore") or {}
    out.add("mtcfs_mtc_yamls_total", "counter",
            "replicator.yaml files handled (trainer starts).", m.get("yamls_handled", 0))
    out.add("mtcfs_mtc_failed", "gauge",
            "1 if the last replicator.yaml ended in replicator.failed.",
            int(m.get("state") == "failed"))
    if r:
        out.add("mtcfs_mtc_restore_seconds", "gauge",
                "Seconds from the last replicator.yaml to its restore marker.", r.get("seconds"))


def _namespace_metrics(out: _Out, ns: Mapping[str, Any]) -> None:
    """scope=job: the job namespace log (docs/consistency.md)."""
    out.add("mtcfs_namespace_seq", "gauge", "Namespace ops applied on this node.", ns.get("seq"))
    out.add("mtcfs_namespace_epoch", "gauge", "Epoch of the namespace leader.", ns.get("epoch"))
    out.add("mtcfs_namespace_leading", "gauge", "1 if this node orders the job's namespace.",
            ns.get("leading"))
    out.add("mtcfs_namespace_lease_seconds", "gauge",
            "Seconds left of this node's read lease from the leader.", ns.get("lease_s"))
    out.add("mtcfs_namespace_diverged", "gauge",
            "1 if an op failed here that succeeded on the leader.",
            int(bool(ns.get("diverged"))))
    out.add("mtcfs_namespace_waiting_for_room", "gauge",
            "1 while this node waits at a namespace op its store has no room for.",
            int(bool(ns.get("waiting_for_room"))))
    out.add("mtcfs_namespace_ops_submitted_total", "counter",
            "Namespace changes made through this mount.", ns.get("ops_submitted", 0))
    out.add("mtcfs_namespace_takeovers_total", "counter",
            "Times this node took over the namespace.", ns.get("takeovers", 0))
    out.add("mtcfs_namespace_unavailable_seconds", "gauge",
            "Seconds this node has not been able to change or read the job's namespace "
            "(0: it can).", ns.get("unavailable_s") or 0)
    out.add("mtcfs_namespace_etcd_errors_total", "counter",
            "Failed calls to etcd (coord=etcd).", ns.get("etcd_errors",
            0 if ns.get("engine") == "etcd" else None))


def _peer_metrics(out: _Out, p: Mapping[str, Any]) -> None:
    out.add("mtcfs_peer_nodes", "gauge", "Ranks in the job.", p.get("nodes"))
    ms: Mapping[str, Any] = p["membership"] if isinstance(p.get("membership"), Mapping) \
        else {}
    out.add("mtcfs_peer_registered", "gauge",
            "1 while this node holds its membership lease in etcd.", ms.get("registered"))
    out.add("mtcfs_peer_etcd_connected", "gauge",
            "1 if etcd answered this node's last membership call (registration or lease "
            "keepalive).", ms.get("connected"))
    out.add("mtcfs_peer_lease_ttl_seconds", "gauge", "TTL of this node's membership lease.",
            ms.get("lease_ttl_s"))
    out.add("mtcfs_peer_lease_renewed_age_seconds", "gauge",
            "Seconds since the membership lease was last renewed (above the TTL: it "
            "expired).", ms.get("lease_renewed_ago_s"))
    out.add("mtcfs_peer_etcd_errors_total", "counter",
            "Membership calls to etcd that failed.", ms.get("etcd_errors"))
    out.add("mtcfs_peer_reregistrations_total", "counter",
            "Times the membership lease expired and this node registered again.",
            ms.get("reregistrations"))
    lc = p.get("latest_complete") or {}
    out.add("mtcfs_peer_latest_complete_step", "gauge",
            "Newest step complete on all ranks.", lc.get("number"))
    for m in _rows(p.get("members")):
        lab = {"member": m.get("rank")}
        out.add("mtcfs_peer_member_alive", "gauge",
                "1 while the member's etcd lease is alive.", m.get("alive"), lab)
    for r in _rows(p.get("replication")):
        lab = {"peer": r.get("peer")}
        out.add("mtcfs_peer_replication_lag_steps", "gauge",
                "Checkpoints not yet confirmed by the peer.", r.get("lag_steps"), lab)
        out.add("mtcfs_peer_replication_lag_bytes", "gauge",
                "Bytes of checkpoints not yet confirmed by the peer.", r.get("lag_bytes"), lab)
        out.add("mtcfs_peer_replication_lag_seconds", "gauge",
                "Seconds since the oldest checkpoint not yet confirmed by the peer was "
                "committed (0: none).", r.get("lag_seconds"), lab)
        out.add("mtcfs_peer_replication_up", "gauge",
                "1 if replication to the peer works (state ok or lagging).",
                r.get("state") in ("ok", "lagging"), lab)
        out.add("mtcfs_peer_sent_bytes_total", "counter",
                "Chunk payload bytes sent to the peer.", r.get("bytes_sent"), lab)
        out.add("mtcfs_peer_skipped_chunks_total", "counter",
                "Chunks not sent because the peer held them.", r.get("chunks_skipped"), lab)
    store = p.get("replica_store") or {}
    out.add("mtcfs_peer_replica_bytes", "gauge", "Bytes held for other ranks.",
            store.get("used_bytes"))
    out.add("mtcfs_peer_replica_corrupt_deleted_total", "counter",
            "Replica chunks found corrupt and deleted.", store.get("corrupt_deleted"))
    bad = {str(r): n for r, n in (p.get("bad_peers") or {}).items()}
    for m in _rows(p.get("members")):  # every other member, at 0 until one sends a bad one
        if m.get("rank") is not None and m.get("rank") != p.get("rank"):
            bad.setdefault(str(m["rank"]), 0)
    for rank, n in sorted(bad.items(), key=lambda kv: (len(kv[0]), kv[0])):
        out.add("mtcfs_peer_bad_chunks_total", "counter",
                "Chunks that failed verification, by the peer that sent them.", n,
                {"peer": rank})


def _rows(value: object) -> Iterable[Mapping[str, Any]]:
    return [r for r in value if isinstance(r, Mapping)] if isinstance(value, list) else []
