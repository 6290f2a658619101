"""Coordination at scale: many light members against one etcd (issue 13).

``python -m benchmarks.bench_coord_scale [--members 64,1000] [--rest-s 60] [--ttl 10]
[--per-client 50] [--json OUT]`` (or ``make bench-coord-scale``). No FUSE, no daemon: the
coordination code (replication/coord/membership.py and steps.py) runs in this process,
many members per process, members sharing one :class:`Etcd` client (one gRPC channel)
per ``--per-client`` members. Each member size gets a fresh one-member etcd on /dev/shm
(tests/support/etcd.EtcdCluster).

Phases, one after the other, per member count N:

``idle``     the baseline: etcd with no member, ``--idle-s`` seconds
``join``     every member registers (lease + record) and starts its keepalive and its
             membership watch, 32 at a time; ends when every member's view shows N members
``rest``     ``--rest-s`` seconds of keepalives only
``save``     every member records one step (one put each, 32 at a time), then one
             member reads the newest step complete everywhere (one range); ends when that
             read returns the step
``restart``  every member leaves (lease revoked), then all N call ``decide_restore`` at
             once (released together by a barrier); ends when the last one holds the
             decision; checks that every member got the same one

Measured per phase: wall time; etcd's keys (a count-only range of the whole keyspace);
requests etcd received, per second and per method (``grpc_server_msg_received_total``
from etcd's own /metrics, read before and after the phase); watch events etcd sent
(``etcd_debugging_mvcc_events_total``) and events the members' watches delivered; etcd's
db size, RSS and CPU (``/proc/<pid>``); and the harness's own CPU (when it is near 200%
the two cores, not etcd, bound the phase).
"""

from __future__ import annotations

import argparse
import datetime
import json
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

from replication.coord.etcd import Etcd  # noqa: E402
from replication.coord.membership import Membership, MemberView  # noqa: E402
from replication.coord.steps import StepRecords  # noqa: E402
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


class Probe:
    """Reads etcd's counters before and after a phase."""

    def __init__(self, cluster: EtcdCluster, client: Etcd) -> None:
        self.metrics_url = f"http://{cluster.endpoints[0]}/metrics"
        self.pid = cluster.procs[0].pid  # type: ignore[union-attr]
        self.client = client

    def snap(self) -> dict[str, Any]:
        cpu, rss = proc_stats(self.pid)
        _kvs, _rev, _more, keys = self.client.range(b"\0", b"\0", count_only=True)
        return {"t": time.monotonic(), "m": scrape(self.metrics_url), "cpu": cpu, "rss": rss,
                "keys": keys, "self_cpu": self_cpu()}

    @staticmethod
    def delta(a: dict[str, Any], b: dict[str, Any], delivered: int) -> dict[str, Any]:
        dt = b["t"] - a["t"]
        req = {k[4:]: b["m"].get(k, 0) - a["m"].get(k, 0) for k in b["m"] if k.startswith("req.")}
        req = {k: int(v) for k, v in sorted(req.items()) if v}
        total = sum(req.values())
        ev = b["m"].get("etcd_debugging_mvcc_events_total", 0) - \
            a["m"].get("etcd_debugging_mvcc_events_total", 0)
        return {
            "wall_s": round(dt, 3),
            "keys": b["keys"],
            "requests": total, "requests_per_s": round(total / dt, 1) if dt else 0,
            "requests_by_method": req,
            "watch_events_sent": int(ev),
            "watch_events_per_s": round(ev / dt, 1) if dt else 0,
            "watch_events_delivered": delivered,
            "watchers": int(b["m"].get("etcd_debugging_mvcc_watcher_total", 0)),
            "db_bytes": int(b["m"].get("etcd_mvcc_db_total_size_in_bytes", 0)),
            "etcd_rss_mib": round(b["rss"] / 2**20, 1),
            "etcd_cpu_pct": round(100 * (b["cpu"] - a["cpu"]) / dt, 1) if dt else 0,
            "harness_cpu_pct": round(100 * (b["self_cpu"] - a["self_cpu"]) / dt, 1) if dt else 0,
        }


def run_size(n: int, args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="mtcfs-coordscale-", dir="/dev/shm"))
    cluster = EtcdCluster(root, 1).start()
    prefix = "/mtcfs/scale/"
    clients = [Etcd(cluster.endpoints, timeout_s=30.0)
               for _ in range((n + args.per_client - 1) // args.per_client)]
    admin = Etcd(cluster.endpoints, timeout_s=30.0)
    probe = Probe(cluster, admin)
    res: dict[str, Any] = {"members": n, "ttl_s": args.ttl, "clients": len(clients)}
    members: list[Membership] = []
    views: list[MemberView] = []

    def delivered() -> int:
        return sum(v.counters["watch_events"] for v in views)

    try:
        # idle: the baseline
        a = probe.snap()
        time.sleep(args.idle_s)
        res["idle"] = probe.delta(a, probe.snap(), 0)
        print(f"[{n}] idle done", flush=True)

        # join: one membership view per client (per --per-client members), or per member
        if args.view == "per-client":
            views = [MemberView(c, prefix) for c in clients]
        else:
            views = [MemberView(clients[r // args.per_client], prefix) for r in range(n)]
        members = [Membership(clients[r // args.per_client], prefix, r,
                              f"10.{r // 65536}.{r // 256 % 256}.{r % 256}:7070",
                              {"zone": f"z{r % 4}", "rack": f"r{r // 32}"}, ttl_s=args.ttl,
                              view=views[r // args.per_client if args.view == "per-client"
                                         else r])
                   for r in range(n)]
        res["views"] = len(views)
        a = probe.snap()
        for v in views:
            v.start()
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda m: m.join(wait_s=0), members))
        registered = time.monotonic() - a["t"]
        for v in views:
            v.wait_for(n, timeout=300)
        res["join"] = probe.delta(a, probe.snap(), delivered())
        res["join"]["registered_s"] = round(registered, 3)
        print(f"[{n}] join {res['join']['wall_s']} s", flush=True)

        # rest
        d0 = delivered()
        a = probe.snap()
        time.sleep(args.rest_s)
        res["rest"] = probe.delta(a, probe.snap(), delivered() - d0)
        errors = [m.error for m in members if m.error]
        res["rest"]["members_in_error"] = len(errors)
        res["rest"]["reregistrations"] = sum(m.counters["reregistrations"] for m in members)
        res["rest"]["view_sizes_min"] = min(len(v.view()) for v in views)
        print(f"[{n}] rest {res['rest']['requests_per_s']} req/s", flush=True)

        # save: one step record per member
        steps = [StepRecords(clients[r // args.per_client], prefix, r, boot=members[r].record.boot)
                 for r in range(n)]
        d0 = delivered()
        a = probe.snap()
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda s: s.record([100, 200]), steps))
        puts_s = time.monotonic() - a["t"]
        newest = steps[0].newest_complete_everywhere(n)
        res["save"] = probe.delta(a, probe.snap(), delivered() - d0)
        res["save"]["puts_s"] = round(puts_s, 3)
        res["save"]["newest_complete_everywhere"] = newest
        assert newest == 200, newest
        print(f"[{n}] save {res['save']['wall_s']} s", flush=True)

        # restart: every member drops, then all decide at once
        d0 = delivered()
        a = probe.snap()
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda m: m.leave(), members))
        left_s = time.monotonic() - a["t"]
        out: list[Any] = [None] * n
        done_at: list[float] = [0.0] * n
        barrier = threading.Barrier(n + 1)

        def decide(r: int) -> None:
            barrier.wait()
            try:
                out[r] = steps[r].decide_restore(n, incarnation=2, wait_s=args.wait_s,
                                                 timeout=120)
            except Exception as exc:  # noqa: BLE001 (reported)
                out[r] = {"error": str(exc)}
            done_at[r] = time.monotonic()

        old = threading.stack_size(256 * 1024)
        ts = [threading.Thread(target=decide, args=(r,), daemon=True) for r in range(n)]
        threading.stack_size(old)
        for t in ts:
            t.start()
        a2 = probe.snap()
        barrier.wait()
        t0 = time.monotonic()
        for t in ts:
            t.join(180)
        decided_s = max(done_at) - t0
        res["restart"] = probe.delta(a, probe.snap(), delivered() - d0)
        res["restart"]["leave_s"] = round(left_s, 3)
        res["restart"]["decide_s"] = round(decided_s, 3)
        res["restart"]["decide_median_s"] = round(sorted(x - t0 for x in done_at)[n // 2], 3)
        res["restart"]["decide_phase"] = probe.delta(a2, probe.snap(), 0)
        same = all(o == out[0] for o in out)
        res["restart"]["all_same"] = same
        res["restart"]["decision"] = out[0]
        res["restart"]["writers_won"] = len({o.get("decided_by") for o in out if o})
        print(f"[{n}] restart: decide {decided_s:.2f} s, same={same}", flush=True)
    finally:
        for m in members:
            m._stop.set()
        for v in views:
            v.stop()
        for c in clients:
            c.close()
        admin.close()
        cluster.stop()
    return res


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| members | phase | wall s | keys | requests/s | (by method) | watch events "
            "sent (/s) | delivered | db MiB | etcd RSS MiB | etcd CPU % | harness CPU % |",
            "| ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        for ph in ("idle", "join", "rest", "save", "restart"):
            d = r.get(ph)
            if not d:
                continue
            by = ", ".join(f"{k} {v}" for k, v in d["requests_by_method"].items())
            wall = d["wall_s"]
            if ph == "restart":
                wall = f"{wall} (decide {d['decide_s']})"
            rows.append(f"| {r['members']} | {ph} | {wall} | {d['keys']} | "
                        f"{d['requests_per_s']} | {by} | {d['watch_events_sent']} "
                        f"({d['watch_events_per_s']}) | {d['watch_events_delivered']} | "
                        f"{d['db_bytes'] / 2**20:.1f} | {d['etcd_rss_mib']} | "
                        f"{d['etcd_cpu_pct']} | {d['harness_cpu_pct']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--members", default="64,1000")
    ap.add_argument("--rest-s", type=float, default=60.0)
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--ttl", type=int, default=10)
    ap.add_argument("--per-client", type=int, default=50)
    ap.add_argument("--wait-s", type=float, default=5.0)
    ap.add_argument("--view", choices=("per-client", "per-member"), default="per-client",
                    help="one membership watch per client (default) or per member")
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
