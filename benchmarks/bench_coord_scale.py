"""Coordination at scale: many light members against one etcd (issue 13).

``python -m benchmarks.bench_coord_scale [--members 64,1000] [--rest-s 60] [--ttl 5]
[--per-client 50] [--reads-s 0] [--json OUT]`` (or ``make bench-coord-scale``). No FUSE, no
daemon: the coordination code (mtcfs/tiers/coord/membership.py, steps.py, rounds.py) runs
as many light members, sharing one :class:`Etcd` client (one gRPC channel) per
``--per-client`` members. The memberships (leases, keepalive threads, views) live in one
child process (:class:`MembersProc`), the deciding and reading members in this one, so the
deciders' CPU does not starve the keepalives. Each member size gets a fresh one-member etcd
on /dev/shm (tests/support/etcd.EtcdCluster). The TTL defaults to the daemon's (5 s: the
daemon's ``ttl_s = max(2, round(liveness_s))``, liveness 5 s), so a keepalive every 1.7 s.

Phases, one after the other, per member count N:

``idle``      the baseline: etcd with no member, ``--idle-s`` seconds
``baseline``  plain etcd through this client, no member: N puts of a step-record-sized
              value (32 at a time), then ``--baseline-s`` seconds of ranges over those N
              keys (8 at a time); the puts/s and kvs/s this etcd and this harness reach
``join``      every member registers (lease + record) and starts its keepalive and its
              membership watch, 32 at a time; ends when every member's view shows N members
``rest``      ``--rest-s`` seconds of keepalives only
``save``      every member records its steps (one put each, ``--record-steps`` steps, as a
              daemon's record of the newest 16; 32 at a time), then one member reads the
              newest step complete everywhere (one range); ends when that read returns it
``reads``     the daemon at rest: every member reads every rank's step record
              (``StepRecords.newest_complete_everywhere``) once per the daemon's interval,
              ``COMPLETE_EVERY_S * max(1, N / COMPLETE_SCALE_NODES)`` (10 s; 20 s at 1,000),
              the N readers spread evenly over it, keepalives running; ``--reads-s``
              seconds (0: one interval, so every member reads once)
``current``   a whole-job restart as the daemon restores (wiped stores): all N call
              ``StepRecords.decide_current(N)`` at once (released by a barrier); ends when
              the last holds a decision; checks every decision names the same step
``rounds``    an Orbax restart: all N (one ``RestoreRounds`` each) call ``agree_sync`` at
              once, rank 0 lacking the newest step (so the answer is the one before);
              ends when the last has the step; then ``rounds2``: all N again at once (the
              next restart: round 2 opens), same checks
``restart``   the older API, not the daemon's path (kept for comparison): every member
              leaves (lease revoked), then all N call ``decide_restore`` at once

Measured per phase: wall time; etcd's keys (a count-only range of the whole keyspace);
requests etcd received, per second and per method (``grpc_server_msg_received_total``
from etcd's own /metrics, read before and after the phase); the calls the harness made
(more received than made: retries after the 2 s per-attempt deadline) and the kvs and
bytes etcd returned to them (Range and Txn responses); watch events etcd sent
(``etcd_debugging_mvcc_events_total``) and events the members' watches delivered; etcd's
db size, RSS and CPU (``/proc/<pid>``); the harness's own CPU (when it is near 200% the
two cores, not etcd, bound the phase); members whose keepalive failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import re
import resource
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from mtcfs.tiers.coord.etcd import Etcd, EtcdError, prefix_end  # noqa: E402
from mtcfs.tiers.coord.membership import Membership, MemberView  # noqa: E402
from mtcfs.tiers.coord.rounds import RestoreRounds  # noqa: E402
from mtcfs.tiers.coord.steps import StepRecords  # noqa: E402
from mtcfs.tiers.peer.tier_membership import (  # noqa: E402
    COMPLETE_EVERY_S, COMPLETE_SCALE_NODES,
)
from support.etcd import EtcdCluster  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")
_METRIC = re.compile(r'^(\w+)(?:\{([^}]*)\})?\s+([0-9.eE+-]+)$')


def scrape(url: str) -> dict[str, float]:
    """The etcd metrics this benchmark reads, flattened (method-labelled ones per method)."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            m = _METRIC.match(line)
            if not m:
                continue
            name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
            if name == "grpc_server_msg_received_total":
                meth = re.search(r'grpc_method="(\w+)"', labels)
                out["req." + (meth.group(1) if meth else "?")] = \
                    out.get("req." + (meth.group(1) if meth else "?"), 0) + value
            elif name == "grpc_server_msg_sent_total":
                meth = re.search(r'grpc_method="(\w+)"', labels)
                if meth and meth.group(1) == "Watch":
                    out["watch_responses"] = out.get("watch_responses", 0) + value
            elif name in ("etcd_debugging_mvcc_events_total", "etcd_mvcc_db_total_size_in_bytes",
                          "etcd_debugging_mvcc_watcher_total",
                          "etcd_debugging_mvcc_watch_stream_total",
                          "etcd_debugging_lease_granted_total",
                          "etcd_debugging_lease_renewed_total",
                          "etcd_debugging_lease_revoked_total",
                          "etcd_debugging_mvcc_keys_total"):
                out[name] = value
    return out


def proc_stats(pid: int) -> tuple[float, int]:
    """(CPU seconds, RSS bytes) of a process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / CLK
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return cpu, rss


def self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class Served:
    """Counts the calls the harness makes through its clients and the kvs and bytes etcd
    returns to them (Range and Txn responses; keepalives and watches are not counted)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls = 0
        self.kvs = 0
        self.bytes = 0

    def wrap(self, client: Etcd) -> Etcd:
        inner = client._call

        def call(service: str, method: str, request: Any, **kw: Any) -> Any:
            r = inner(service, method, request, **kw)
            kvs = 0
            if method == "Range":
                kvs = len(r.kvs)
            elif method == "Txn":
                kvs = sum(len(x.response_range.kvs) for x in r.responses)
            size = r.ByteSize() if kvs else 0
            with self.lock:
                self.calls += 1
                self.kvs += kvs
                self.bytes += size
            return r

        client._call = call  # type: ignore[method-assign]
        return client

    def snap(self) -> tuple[int, int, int]:
        with self.lock:
            return self.calls, self.kvs, self.bytes


class Probe:
    """Reads etcd's counters before and after a phase."""

    def __init__(self, cluster: EtcdCluster, client: Etcd, served: Served) -> None:
        self.metrics_url = f"http://{cluster.endpoints[0]}/metrics"
        self.pid = cluster.procs[0].pid  # type: ignore[union-attr]
        self.client = client
        self.served = served
        self.pids: list[int] = []  # the members process

    def snap(self) -> dict[str, Any]:
        served = self.served.snap()
        cpu, rss = proc_stats(self.pid)
        _kvs, _rev, _more, keys = self.client.range(b"\0", b"\0", count_only=True)
        return {"t": time.monotonic(), "m": scrape(self.metrics_url), "cpu": cpu, "rss": rss,
                "keys": keys, "self_cpu": self_cpu(), "served": served,
                "members_cpu": sum(proc_stats(p)[0] for p in self.pids)}

    @staticmethod
    def delta(a: dict[str, Any], b: dict[str, Any], delivered: int) -> dict[str, Any]:
        dt = b["t"] - a["t"]
        req = {k[4:]: b["m"].get(k, 0) - a["m"].get(k, 0) for k in b["m"] if k.startswith("req.")}
        req = {k: int(v) for k, v in sorted(req.items()) if v}
        total = sum(req.values())
        ev = b["m"].get("etcd_debugging_mvcc_events_total", 0) - \
            a["m"].get("etcd_debugging_mvcc_events_total", 0)
        calls, kvs, nbytes = (y - x for x, y in zip(a["served"], b["served"]))
        return {
            "wall_s": round(dt, 3),
            "keys": b["keys"],
            "requests": total, "requests_per_s": round(total / dt, 1) if dt else 0,
            "requests_by_method": req,
            "harness_calls": calls,
            "kvs_served": kvs, "kvs_per_s": round(kvs / dt, 1) if dt else 0,
            "bytes_served": nbytes,
            "mib_served_per_s": round(nbytes / dt / 2**20, 2) if dt else 0,
            "watch_events_sent": int(ev),
            "watch_events_per_s": round(ev / dt, 1) if dt else 0,
            "watch_events_delivered": delivered,
            "watchers": int(b["m"].get("etcd_debugging_mvcc_watcher_total", 0)),
            "db_bytes": int(b["m"].get("etcd_mvcc_db_total_size_in_bytes", 0)),
            "etcd_rss_mib": round(b["rss"] / 2**20, 1),
            "etcd_cpu_pct": round(100 * (b["cpu"] - a["cpu"]) / dt, 1) if dt else 0,
            "harness_cpu_pct": round(100 * (b["self_cpu"] - a["self_cpu"]) / dt, 1) if dt else 0,
            "members_proc_cpu_pct": round(100 * (b["members_cpu"] - a.get("members_cpu", 0))
                                          / dt, 1) if dt else 0,
            "load1": round(os.getloadavg()[0], 2),
        }


def _members_main(conn: Any, endpoints: list[str], lo: int, hi: int, n: int, prefix: str,
                  ttl: int, per_client: int, view_mode: str, gather: bool) -> None:
    """A members process: the memberships of ranks ``lo..hi-1`` of ``n`` (leases,
    records, keepalive threads, views), driven over ``conn``: ``join``, ``health``,
    ``leave``, ``stop``. Apart from the process that decides, so the decision's CPU load
    does not starve the keepalives (a daemon's keepalive runs on its own host).
    ``view_mode`` ``per-member`` is a daemon's shape: each member its own view, told the
    job's size when ``gather`` (as the daemon tells it ``nodes=``)."""
    threading.stack_size(512 * 1024)
    ranks = range(lo, hi)
    clients = [Etcd(endpoints, timeout_s=30.0)
               for _ in range((len(ranks) + per_client - 1) // per_client)]

    def client(r: int) -> Etcd:
        return clients[(r - lo) // per_client]

    views: list[MemberView] = []
    if view_mode == "per-client":
        views = [MemberView(c, prefix, progress_s=30.0) for c in clients]
    members = [Membership(client(r), prefix, r,
                          f"10.{r // 65536}.{r // 256 % 256}.{r % 256}:7070",
                          {"zone": f"z{r % 4}", "rack": f"r{r // 32}"}, ttl_s=ttl,
                          progress_s=30.0,
                          view=views[(r - lo) // per_client] if views else None,
                          expect=n if gather else None)
               for r in ranks]
    if not views:
        views = [m.members_view for m in members if m.members_view is not None]
    while True:
        cmd = conn.recv()
        if cmd == "join":
            t0 = time.monotonic()
            if view_mode == "per-client":
                for v in views:
                    v.start()
            with ThreadPoolExecutor(32) as pool:
                retries = sum(pool.map(join, members))
            conn.send({"join_retries": retries, "registered_s": time.monotonic() - t0,
                       "boots": [m.record.boot for m in members]})
        elif cmd == "complete":
            for v in views:
                v.wait_for(n, timeout=300)
            conn.send({"views": len(views)})
        elif cmd == "health":
            conn.send({"delivered": sum(v.counters["watch_events"] for v in views),
                       "gather_polls": sum(v.counters.get("gather_polls", 0) for v in views),
                       "gathered_s_max": max((v.gathered_s or 0.0) for v in views),
                       "members_in_error": sum(1 for m in members if m.error),
                       "reregistrations": sum(m.counters["reregistrations"] for m in members),
                       "keepalive_errors": sum(m.counters.get("etcd_errors", 0)
                                               for m in members),
                       "view_sizes_min": min(len(v.view()) for v in views)})
        elif cmd == "leave":
            t0 = time.monotonic()
            with ThreadPoolExecutor(32) as pool:
                list(pool.map(lambda m: m.leave(), members))
            conn.send({"leave_s": round(time.monotonic() - t0, 3)})
        elif cmd == "stop":
            for m in members:
                m._stop.set()
            for v in views:
                v.stop()
            for c in clients:
                c.close()
            conn.send("stopped")
            return


class MembersProc:
    """The parent's handle on ``--procs`` processes of :func:`_members_main`, each with an
    equal share of the ranks; a command goes to all of them at once, and their answers
    are merged (counts summed, the boots in rank order, a time the largest)."""

    def __init__(self, endpoints: list[str], n: int, prefix: str,
                 args: argparse.Namespace) -> None:
        ctx = multiprocessing.get_context("spawn")
        k = max(1, min(args.procs, n))
        cuts = [n * i // k for i in range(k + 1)]
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for lo, hi in zip(cuts, cuts[1:]):
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=_members_main, daemon=True, args=(
                child, endpoints, lo, hi, n, prefix, args.ttl, args.per_client, args.view,
                args.gather == "on"))
            proc.start()
            self.conns.append(conn)
            self.procs.append(proc)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def ask(self, cmd: str, timeout: float = 600.0) -> Any:
        for conn in self.conns:
            conn.send(cmd)
        answers = []
        deadline = time.monotonic() + timeout
        for conn in self.conns:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"a members process did not answer {cmd!r}")
            answers.append(conn.recv())
        if not isinstance(answers[0], dict):
            return answers[0]
        out: dict[str, Any] = {}
        for a in answers:
            for key, v in a.items():
                if key == "boots":
                    out[key] = out.get(key, []) + v
                elif key.endswith("_s") or key.endswith("_max") or key == "view_sizes_min":
                    pick = min if key == "view_sizes_min" else max
                    out[key] = pick(out[key], v) if key in out else v
                else:
                    out[key] = out.get(key, 0) + v
        return out

    def stop(self) -> None:
        try:
            if any(p.is_alive() for p in self.procs):
                self.ask("stop", 30)
        except (OSError, EOFError, TimeoutError):
            pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def join(m: Membership, tries: int = 5) -> int:
    """``m.join``, tried again when it fails (a daemon tries again every membership round):
    on a loaded machine a lease can expire between its grant and the record's write
    (etcd: "requested lease not found"). Returns the retries it took."""
    for i in range(tries):
        try:
            m.join(wait_s=0)
            return i
        except EtcdError:
            if i == tries - 1:
                raise
    return tries


def all_at_once(n: int, fn: Any, join_s: float = 300.0) -> tuple[list[Any], list[float]]:
    """``fn(r)`` for r in 0..n-1, one thread each (small stacks), released together by one
    barrier: (results, seconds from the release until each returned); an exception is
    kept as ``{"error": ...}``."""
    out: list[Any] = [None] * n
    done_at: list[float] = [0.0] * n
    barrier = threading.Barrier(n + 1)
    t0 = 0.0

    def run(r: int) -> None:
        barrier.wait()
        try:
            out[r] = fn(r)
        except Exception as exc:  # noqa: BLE001 (reported)
            out[r] = {"error": f"{type(exc).__name__}: {exc}"}
        done_at[r] = time.monotonic()

    old = threading.stack_size(256 * 1024)
    ts = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
    threading.stack_size(old)
    for t in ts:
        t.start()
    barrier.wait()
    t0 = time.monotonic()
    for t in ts:
        t.join(max(1.0, join_s - (time.monotonic() - t0)))
    return out, [(d - t0) if d else float("nan") for d in done_at]


def timing(done: list[float]) -> dict[str, Any]:
    ok = sorted(d for d in done if d == d)
    return {"decide_s": round(max(ok), 3) if ok else None,
            "decide_median_s": round(ok[len(ok) // 2], 3) if ok else None,
            "unfinished": len(done) - len(ok)}


def run_size(n: int, args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="mtcfs-coordscale-", dir="/dev/shm"))
    cluster = EtcdCluster(root, 1).start()
    prefix = "/mtcfs/scale/"
    served = Served()
    clients = [served.wrap(Etcd(cluster.endpoints, timeout_s=30.0))
               for _ in range((n + args.per_client - 1) // args.per_client)]
    admin = Etcd(cluster.endpoints, timeout_s=30.0)
    probe = Probe(cluster, admin, served)
    interval = COMPLETE_EVERY_S * max(1.0, n / COMPLETE_SCALE_NODES)
    res: dict[str, Any] = {"members": n, "ttl_s": args.ttl, "clients": len(clients),
                           "record_steps": args.record_steps, "read_interval_s": interval}
    mp: MembersProc | None = None
    my_steps = [100 * (i + 1) for i in range(args.record_steps)]
    newest = my_steps[-1]
    h0: dict[str, Any] = {}

    def delivered() -> int:
        nonlocal h0
        h0 = mp.ask("health") if mp else {}
        return h0.get("delivered", 0)

    def health(d: dict[str, Any], rereg0: int) -> None:
        h = mp.ask("health") if mp else {}
        d["members_in_error"] = h.get("members_in_error", 0)
        d["reregistrations"] = h.get("reregistrations", 0) - rereg0
        d["keepalive_errors"] = h.get("keepalive_errors", 0)

    def rereg() -> int:
        return h0.get("reregistrations", 0)

    try:
        # idle: the baseline
        a = probe.snap()
        time.sleep(args.idle_s)
        res["idle"] = probe.delta(a, probe.snap(), 0)
        print(f"[{n}] idle done", flush=True)

        # baseline: plain puts and ranges through this client, no member
        bprefix = b"/mtcfs/baseline/"
        sample = StepRecords(clients[0], prefix, 0, boot="x" * 32)
        body = json.dumps({"rank": 0, "boot": "x" * 32, "steps": my_steps,
                           "at": round(time.time(), 3)}, separators=(",", ":")).encode()
        a = probe.snap()
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda r: clients[r // args.per_client].put(
                bprefix + f"{r:06d}".encode(), body), range(n)))
        puts_s = time.monotonic() - a["t"]
        stop_at = time.monotonic() + args.baseline_s
        ranges = [0] * 8

        def ranger(i: int) -> None:
            c = clients[i % len(clients)]
            while time.monotonic() < stop_at:
                c.range(bprefix, prefix_end(bprefix))
                ranges[i] += 1
        t_r = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(ranger, range(8)))
        range_s = time.monotonic() - t_r
        res["baseline"] = probe.delta(a, probe.snap(), 0)
        res["baseline"].update({
            "puts": n, "puts_s": round(puts_s, 3), "puts_per_s": round(n / puts_s, 1),
            "ranges": sum(ranges), "ranges_per_s": round(sum(ranges) / range_s, 1),
            "range_kvs_per_s": round(sum(ranges) * n / range_s, 1),
            "record_bytes": len(body) + len(sample.key)})
        admin.delete(bprefix, prefix_end(bprefix))
        print(f"[{n}] baseline {res['baseline']['puts_per_s']} puts/s, "
              f"{res['baseline']['range_kvs_per_s']} kvs/s in ranges", flush=True)

        # join: one membership view per client (per --per-client members), or per member;
        # the members live in their own process (MembersProc)
        mp = MembersProc(cluster.endpoints, n, prefix, args)
        probe.pids.extend(mp.pids)
        a = probe.snap()
        joined = mp.ask("join")
        res["views"] = mp.ask("complete")["views"]
        joined["registered_s"] = round(joined["registered_s"], 3)
        res["join"] = probe.delta(a, probe.snap(), delivered())
        res["join"]["registered_s"] = joined["registered_s"]
        res["join"]["join_retries"] = joined["join_retries"]
        res["join"]["gather_polls"] = h0.get("gather_polls", 0)
        res["join"]["gathered_s_max"] = h0.get("gathered_s_max", 0.0)
        print(f"[{n}] join {res['join']['wall_s']} s", flush=True)

        # rest
        d0, r0 = delivered(), rereg()
        a = probe.snap()
        time.sleep(args.rest_s)
        res["rest"] = probe.delta(a, probe.snap(), delivered() - d0)
        health(res["rest"], r0)
        res["rest"]["view_sizes_min"] = h0.get("view_sizes_min")
        print(f"[{n}] rest {res['rest']['requests_per_s']} req/s", flush=True)

        # save: one step record per member
        steps = [StepRecords(clients[r // args.per_client], prefix, r, boot=joined["boots"][r])
                 for r in range(n)]
        d0, r0 = delivered(), rereg()
        a = probe.snap()
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda s: s.record(my_steps), steps))
        puts_s = time.monotonic() - a["t"]
        got = steps[0].newest_complete_everywhere(n)
        res["save"] = probe.delta(a, probe.snap(), delivered() - d0)
        health(res["save"], r0)
        res["save"]["puts_s"] = round(puts_s, 3)
        res["save"]["newest_complete_everywhere"] = got
        assert got == newest, got
        print(f"[{n}] save {res['save']['wall_s']} s", flush=True)

        # reads: every member reads every record once per interval, spread evenly
        window = args.reads_s or interval
        due = sorted((r / n * interval + k * interval, r) for r in range(n)
                     for k in range(int(window // interval) + 1)
                     if r / n * interval + k * interval < window)
        late: list[float] = []
        wrong: list[Any] = []

        def read(when: float, r: int) -> None:
            late.append(time.monotonic() - when)
            v = steps[r].newest_complete_everywhere(n)
            if v != newest:
                wrong.append(v)
        d0, r0 = delivered(), rereg()
        a = probe.snap()
        with ThreadPoolExecutor(args.read_threads) as pool:
            for off, r in due:
                when = a["t"] + off
                time.sleep(max(0.0, when - time.monotonic()))
                pool.submit(read, when, r)
            time.sleep(max(0.0, a["t"] + window - time.monotonic()))
        res["reads"] = probe.delta(a, probe.snap(), delivered() - d0)
        health(res["reads"], r0)
        late.sort()
        res["reads"].update({
            "window_s": window, "reads": len(due),
            "reads_target_per_s": round(n / interval, 2),
            "reads_per_s": round(len(due) / res["reads"]["wall_s"], 2),
            "late_median_s": round(late[len(late) // 2], 3) if late else None,
            "late_max_s": round(late[-1], 3) if late else None,
            "wrong": len(wrong)})
        print(f"[{n}] reads {res['reads']['reads_per_s']}/s, "
              f"{res['reads']['kvs_per_s']} kvs/s, {res['reads']['requests_per_s']} req/s",
              flush=True)

        # current: the daemon's whole-job restore decision, all N at once
        d0, r0 = delivered(), rereg()
        a = probe.snap()
        out, done = all_at_once(n, lambda r: steps[r].decide_current(n, timeout=120))
        res["current"] = probe.delta(a, probe.snap(), delivered() - d0)
        health(res["current"], r0)
        res["current"].update(timing(done))
        res["current"]["errors"] = sum(1 for o in out if not o or "error" in o)
        res["current"]["all_same_step"] = len({(o or {}).get("step") for o in out}) == 1
        res["current"]["step"] = (out[0] or {}).get("step")
        res["current"]["writers_won"] = len({(o or {}).get("decided_by") for o in out})
        res["current"]["decision"] = out[0]
        print(f"[{n}] current: decide {res['current']['decide_s']} s, "
              f"same={res['current']['all_same_step']} step={res['current']['step']}",
              flush=True)

        # rounds: Orbax restore rounds, twice
        rounds = [RestoreRounds(clients[r // args.per_client], prefix, r, n) for r in range(n)]
        mine = [my_steps[:-1] if r == 0 else my_steps for r in range(n)]
        for name in ("rounds", "rounds2"):
            d0, r0 = delivered(), rereg()
            a = probe.snap()
            out, done = all_at_once(n, lambda r: rounds[r].agree_sync(mine[r],
                                                                      wait_s=args.round_wait_s))
            d = res[name] = probe.delta(a, probe.snap(), delivered() - d0)
            health(d, r0)
            d.update(timing(done))
            d["errors"] = [o["error"] for o in out if isinstance(o, dict)][:3]
            d["all_same_step"] = len({o for o in out if not isinstance(o, dict)}) == 1 \
                and not d["errors"]
            d["step"] = out[0]
            d["expected_step"] = my_steps[-2] if len(my_steps) > 1 else None
            d["round"] = sorted({x.last_round for x in rounds})
            print(f"[{n}] {name}: decide {d['decide_s']} s, same={d['all_same_step']} "
                  f"step={d['step']} round={d['round']}", flush=True)

        # restart (older API, not the daemon's path): every member drops, then all decide
        d0 = delivered()
        a = probe.snap()
        left_s = mp.ask("leave")["leave_s"]
        a2 = probe.snap()
        out, done = all_at_once(n, lambda r: steps[r].decide_restore(
            n, incarnation=2, wait_s=args.wait_s, timeout=120), join_s=180)
        res["restart"] = probe.delta(a, probe.snap(), delivered() - d0)
        res["restart"]["leave_s"] = round(left_s, 3)
        res["restart"].update(timing(done))
        res["restart"]["decide_phase"] = probe.delta(a2, probe.snap(), 0)
        same = all(o == out[0] for o in out)
        res["restart"]["all_same"] = same
        res["restart"]["decision"] = out[0]
        res["restart"]["writers_won"] = len({(o or {}).get("decided_by") for o in out})
        print(f"[{n}] restart (decide_restore): decide {res['restart']['decide_s']} s, "
              f"same={same}", flush=True)
    finally:
        if mp is not None:
            mp.stop()
        for c in clients:
            c.close()
        admin.close()
        cluster.stop()
    return res


PHASES = ("idle", "baseline", "join", "rest", "save", "reads", "current", "rounds",
          "rounds2", "restart")


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| members | phase | wall s | keys | requests/s | (by method) | kvs served/s "
            "(MiB/s) | watch events sent (/s) | delivered | db MiB | etcd RSS MiB | "
            "etcd CPU % | harness CPU % | load |",
            "| ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: "
            "| ---: | ---: |"]
    for r in results:
        for ph in PHASES:
            d = r.get(ph)
            if not d:
                continue
            by = ", ".join(f"{k} {v}" for k, v in d["requests_by_method"].items())
            wall = d["wall_s"]
            if d.get("decide_s") is not None:
                wall = f"{wall} (decide {d['decide_s']})"
            rows.append(f"| {r['members']} | {ph} | {wall} | {d['keys']} | "
                        f"{d['requests_per_s']} | {by} | {d['kvs_per_s']} "
                        f"({d['mib_served_per_s']}) | {d['watch_events_sent']} "
                        f"({d['watch_events_per_s']}) | {d['watch_events_delivered']} | "
                        f"{d['db_bytes'] / 2**20:.1f} | {d['etcd_rss_mib']} | "
                        f"{d['etcd_cpu_pct']} | {d['harness_cpu_pct']} | {d['load1']} |")
    rows.append("")
    rows.append("| members | decision | last s | median s | same step | step | requests "
                "(harness calls) | kvs served | MiB served | errors | keepalive failures |")
    rows.append("| ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: |")
    for r in results:
        for ph in ("current", "rounds", "rounds2", "restart"):
            d = r.get(ph)
            if not d:
                continue
            same = d.get("all_same_step", d.get("all_same"))
            step = d.get("step", (d.get("decision") or {}).get("step"))
            rows.append(f"| {r['members']} | {ph} | {d['decide_s']} | {d['decide_median_s']} | "
                        f"{same} | {step} | {d['requests']} ({d['harness_calls']}) | "
                        f"{d['kvs_served']} | {d['bytes_served'] / 2**20:.1f} | "
                        f"{d.get('errors', '')} | {d.get('members_in_error', '')} |")
    rows.append("")
    for r in results:
        d = r.get("reads")
        if d:
            rows.append(f"[{r['members']}] reads at rest: interval {r['read_interval_s']} s, "
                        f"{d['reads']} reads in {d['wall_s']} s = {d['reads_per_s']}/s "
                        f"(target {d['reads_target_per_s']}/s, late median "
                        f"{d['late_median_s']} s, max {d['late_max_s']} s), "
                        f"{d['kvs_per_s']} kvs/s, {d['mib_served_per_s']} MiB/s")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--members", default="64,1000")
    ap.add_argument("--rest-s", type=float, default=60.0)
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--ttl", type=int, default=5, help="lease TTL (the daemon's: 5 s)")
    ap.add_argument("--per-client", type=int, default=50)
    ap.add_argument("--wait-s", type=float, default=5.0, help="decide_restore's wait")
    ap.add_argument("--record-steps", type=int, default=16,
                    help="steps in each record (a daemon keeps the newest 16)")
    ap.add_argument("--baseline-s", type=float, default=5.0)
    ap.add_argument("--reads-s", type=float, default=0.0,
                    help="window of the at-rest record reads (0: one read interval)")
    ap.add_argument("--read-threads", type=int, default=16)
    ap.add_argument("--round-wait-s", type=float, default=180.0,
                    help="RestoreRounds wait (the replicator's ROUND_WAIT_S)")
    ap.add_argument("--view", choices=("per-client", "per-member"), default="per-client",
                    help="one membership watch per client (default) or per member")
    ap.add_argument("--procs", type=int, default=1,
                    help="processes the members are spread over (each its share)")
    ap.add_argument("--gather", choices=("on", "off"), default="on",
                    help="per-member views told the job's size (the daemon's: on) or not")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    threading.stack_size(512 * 1024)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop etcd on the way out
    results = []
    started = datetime.datetime.now(datetime.timezone.utc)
    for n in [int(x) for x in args.members.split(",")]:
        results.append(run_size(n, args))
    out = {"command": " ".join(sys.argv), "started": started.isoformat(),
           "nproc": os.cpu_count(), "load_at_start": os.getloadavg(), "results": results}
    path = Path(args.json) if args.json else (
        REPO / "bench-results" / f"coord-scale-{started:%Y%m%d-%H%M%S}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(table(results))
    print(f"\nwritten: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
