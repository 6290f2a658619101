"""The scale run (issue 42): N real daemons, each in a network namespace of its own, one etcd.

``python -m benchmarks.bench_scale [--nodes 8,32,64] [--scopes node,job] [--saves 3]
[--shard 256K] [--files 20]`` as root (``make bench-scale``). Everything goes to
``bench-results/scale-<timestamp>.json``; the table is printed and belongs in
docs/benchmarks.md ("The scale run").

For each N and scope, on a :class:`~support.fabric.Fabric` of N namespaces on one bridge
(each daemon has its own address, its Peer port 7400, and reaches the others and etcd
through the bridge, as hosts on one switch), one etcd member on the bridge's address in the
root namespace, tiny stores on /dev/shm (``size=`` 64M), ``replicas=1``, mutual TLS between
the peers (``--insecure``: none), peers learned from etcd (no ``peers=``):

``join``
    All N mounts started at once (one thread each, as a scheduler starts a job); from the
    first ``mount`` until the last is up.
``save``
    ``--saves`` times: each rank writes ``step_k/shard-<rank>.bin`` (``--shard`` bytes,
    unique) and commits it (scope=node: its own ``commit_success.txt``; scope=job: rank 0
    writes ``commit_success.txt`` once every rank's shard is closed, as DCP's coordinator
    writes ``.metadata``). Timed from the first write until every rank's step record in
    etcd lists k (``commit``) and until every rank's step directory reads ``replicated
    1/1`` (``replicated``). The first save is left out of the per-save figures (it opens
    the peers' channels).
``files`` (scope=job)
    Each rank creates, writes 1 KiB into and closes ``--files`` files in one shared
    directory, all ranks at once: create+close per second per writer.
``replace``
    The last rank is SIGKILLed and its store wiped (a replacement host), then mounted
    again: from the mount's start until its newest shard was read back bit-exact.
``restart``
    Every rank unmounted cleanly, then all mounted again at once (stores kept): until
    every mount is up, and until every rank read its newest shard back bit-exact.

Measured per phase: wall seconds (on this machine N daemons share its cores: a phase whose
work is per node, such as a daemon's start, takes N times one node's CPU here and about one
node's CPU on a cluster); the CPU of the commands the harness ran for each node (its
``mount``, whose imports and option checks come before the daemon forks off, and one
``mtcfs status``: two Python starts); etcd's requests (by method), mvcc events and watch
responses sent (its /metrics before and after); the daemons' CPU seconds (sum, and per
node); each daemon's RSS after the saves. Per-save figures are divided by the saves
counted. The table fits each figure to ``a * N**k`` (least squares of the logarithms over
the Ns run), shows the exponent k (0: the same at any size; 1: linear; 2: every node pays
for every node) and projects it to 1,000 and 10,000 hosts. ``--table FILE`` prints the
table of an earlier run's JSON again.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import (
    REPO, SCRATCH_SHM, git_state, log, machine_info, scratch_dir, wait_until, write_json,
)
from mtcfs.options import parse_size

sys.path.insert(0, str(REPO / "tests"))

from benchmarks.bench_coord_scale import proc_stats, scrape  # noqa: E402
from mtcfs.tiers.coord.etcd import Etcd, prefix_end  # noqa: E402
from mtcfs.tiers.coord.steps import decode_step_record  # noqa: E402

JOB = "scale"
PREFIX = f"/mtcfs/{JOB}/".encode()


class Run:
    """One N and scope: the fabric, etcd, the cluster, and what was measured."""

    def __init__(self, root: Path, n: int, scope: str, args: argparse.Namespace) -> None:
        from support.cluster import Cluster
        from support.etcd import EtcdCluster
        from support.fabric import Fabric
        self.n, self.scope, self.args = n, scope, args
        #: every wait of a phase (a mount, a step recorded, a replica) ends by then
        self.timeout_s = float(args.timeout)
        self.fabric = Fabric(n).create()
        try:
            self.etcd = EtcdCluster(root / "etcd", 1, host=self.fabric.gateway,
                                    extra_args=["--quota-backend-bytes", str(4 << 30)]).start()
        except BaseException:
            self.fabric.destroy()
            raise
        self.metrics_url = f"http://{self.etcd.endpoints[0]}/metrics"
        self.kv = Etcd(list(self.etcd.endpoints), timeout_s=10.0)
        opts: dict[str, Any] = {"coord": self.etcd.url, "size": "64M", "replicas": 1,
                                "scope": scope}
        if args.insecure:
            opts["insecure"] = True
        self.cluster = Cluster(root / "c", n, job=JOB, options=opts, tls=not args.insecure,
                               learn_addresses=True, test_faults=False, own_prefix=False,
                               fabric=self.fabric)
        self.shard = parse_size(args.shard)
        self.written: dict[tuple[int, int], bytes] = {}  # (rank, step) -> bytes
        #: Range calls this harness made (the commit polls): taken out of etcd's figures
        self.own_calls = 0

    # -- observing ----------------------------------------------------------------------

    def pids(self) -> dict[int, int]:
        pids = {r: self.cluster.node(r).pid for r in range(self.n)}
        return {r: pid for r, pid in pids.items() if pid is not None}

    def sample(self) -> dict[str, Any]:
        cpu: dict[int, float] = {}
        rss: dict[int, int] = {}
        for r, pid in self.pids().items():
            try:
                cpu[r], rss[r] = proc_stats(pid)
            except OSError:
                pass
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return {"t": time.perf_counter(), "m": scrape(self.metrics_url), "cpu": cpu,
                "rss": rss, "own": self.own_calls, "children": ru.ru_utime + ru.ru_stime}

    @staticmethod
    def delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        """What happened between samples ``a`` and ``b``."""
        m = {k: b["m"].get(k, 0) - a["m"].get(k, 0)
             for k in b["m"] if k.startswith("req.") or k in (
                 "watch_responses", "etcd_debugging_mvcc_events_total")}
        m = {k: round(v, 1) for k, v in m.items() if v}
        cpu = [b["cpu"][r] - a["cpu"].get(r, 0.0) for r in b["cpu"]]
        own = b["own"] - a["own"]
        if own:
            m["req.Range"] = round(m.get("req.Range", 0) - own, 1)
        requests = sum(v for k, v in m.items() if k.startswith("req."))
        return {"s": round(b["t"] - a["t"], 3), "etcd_requests": round(requests, 1),
                "commands_cpu_s": round(b["children"] - a["children"], 3),
                "etcd_events": m.get("etcd_debugging_mvcc_events_total", 0),
                "watch_responses": m.get("watch_responses", 0), "etcd": m,
                "cpu_s": round(sum(cpu), 3),
                "cpu_s_per_node": round(sum(cpu) / max(1, len(cpu)), 4),
                "cpu_s_max_node": round(max(cpu, default=0.0), 4)}

    def recorded(self, step: int) -> int:
        """How many ranks' step records in etcd list ``step``."""
        self.own_calls += 1
        kvs, _rev, _more, _count = self.kv.range(PREFIX + b"steps/",
                                                 prefix_end(PREFIX + b"steps/"))
        n = 0
        for kv in kvs:
            try:
                rec = decode_step_record(kv.value)
            except Exception:  # noqa: BLE001 (a record that does not decode counts as none)
                continue
            if step in rec.steps:
                n += 1
        return n

    # -- phases -------------------------------------------------------------------------

    def each(self, fn: Callable[[int], Any]) -> list[Any]:
        """``fn(rank)`` for every rank at once (one thread each, 64 at most)."""
        with ThreadPoolExecutor(max_workers=min(64, self.n)) as ex:
            return list(ex.map(fn, range(self.n)))

    def join(self) -> dict[str, Any]:
        a = self.sample()
        self.cluster.start(timeout=self.timeout_s)
        out = self.delta(a, self.sample())
        out["commands_cpu_s_per_node"] = round(out["commands_cpu_s"] / self.n, 3)
        return out

    def _dir(self, rank: int, step: int) -> Path:
        return self.cluster.node(rank).mnt / f"step_{step}"

    def _shard(self, rank: int, step: int) -> Path:
        return self._dir(rank, step) / f"shard-{rank}.bin"

    def save(self, step: int) -> dict[str, Any]:
        data = {r: os.urandom(self.shard) for r in range(self.n)}
        a = self.sample()

        def one(r: int) -> None:
            d = self._dir(r, step)
            d.mkdir(exist_ok=True)
            self._shard(r, step).write_bytes(data[r])
            if self.scope == "node":
                (d / "commit_success.txt").write_bytes(b"ok")

        self.each(one)
        if self.scope == "job":
            (self._dir(0, step) / "commit_success.txt").write_bytes(b"ok")
        self.written.update({(r, step): data[r] for r in range(self.n)})
        wait_until(lambda: self.recorded(step) >= self.n, self.timeout_s,
                   f"every rank's step record to list step {step}", interval=0.05)
        t_commit = time.perf_counter() - a["t"]
        self.each(lambda r: self.cluster.wait_replicated(r, f"step_{step}",
                                                         timeout=self.timeout_s))
        out = self.delta(a, self.sample())
        out["commit_s"] = round(t_commit, 3)
        return out

    def files(self) -> dict[str, Any]:
        count = self.args.files
        (self.cluster.node(0).mnt / "many").mkdir()
        a = self.sample()
        per: dict[int, float] = {}

        def one(r: int) -> None:
            d = self.cluster.node(r).mnt / "many"
            t0 = time.perf_counter()
            for i in range(count):
                with open(d / f"r{r}-{i}", "wb") as f:
                    f.write(b"x" * 1024)
            per[r] = count / (time.perf_counter() - t0)

        self.each(one)
        out = self.delta(a, self.sample())
        rates = sorted(per.values())
        out["per_writer_ops_s"] = round(rates[len(rates) // 2], 1)
        out["summed_ops_s"] = round(self.n * count / out["s"], 1)
        return out

    def _read_back(self, rank: int, step: int) -> None:
        got = self._shard(rank, step).read_bytes()
        if got != self.written[(rank, step)]:
            raise RuntimeError(f"rank {rank}: step_{step} shard is not what was written "
                               f"({len(got)} bytes)")

    def replace(self, step: int) -> dict[str, Any]:
        r = self.n - 1
        self.cluster.kill9(r)
        self.cluster.wipe(r)
        a = self.sample()
        self.cluster.restart(r, timeout=self.timeout_s)
        self._read_back(r, step)
        return self.delta(a, self.sample())

    def restart(self, step: int) -> dict[str, Any]:
        self.each(lambda r: self.cluster.stop(r, timeout=self.timeout_s))
        a = self.sample()
        self.cluster.restart_many(range(self.n), timeout=self.timeout_s)
        t_up = time.perf_counter() - a["t"]
        self.each(lambda r: self._read_back(r, step))
        out = self.delta(a, self.sample())
        out["up_s"] = round(t_up, 3)
        return out

    def close(self) -> None:
        for what in (self.cluster.cleanup, self.kv.close, self.etcd.stop, self.fabric.destroy):
            try:
                what()
            except Exception as exc:  # noqa: BLE001 (clean up the rest)
                log(f"clean-up: {what}: {exc}")


def one_n(root: Path, n: int, scope: str, args: argparse.Namespace) -> dict[str, Any]:
    run = Run(root, n, scope, args)
    out: dict[str, Any] = {"n": n, "scope": scope}
    try:
        log(f"N={n} scope={scope}: join")
        out["join"] = run.join()
        saves = []
        for k in range(1, args.saves + 1):
            log(f"N={n} scope={scope}: save {k}")
            saves.append(run.save(k))
        out["saves"] = saves
        counted = saves[1:] or saves
        out["save"] = {key: round(sum(s[key] for s in counted) / len(counted), 4)
                       for key in ("s", "commit_s", "etcd_requests", "etcd_events",
                                   "watch_responses", "cpu_s", "cpu_s_per_node",
                                   "cpu_s_max_node")}
        rss = run.sample()["rss"]
        out["rss_mib"] = {"median": round(sorted(rss.values())[len(rss) // 2] / 2**20, 1),
                          "max": round(max(rss.values()) / 2**20, 1)}
        if scope == "job" and args.files:
            log(f"N={n} scope={scope}: files")
            out["files"] = run.files()
        log(f"N={n} scope={scope}: replace")
        out["replace"] = run.replace(args.saves)
        log(f"N={n} scope={scope}: restart")
        out["restart"] = run.restart(args.saves)
    finally:
        run.close()
    return out


#: (row, phase, figure): the table's rows, each one figure of one phase
ROWS = [
    ("join, s", "join", "s"),
    ("join, etcd requests", "join", "etcd_requests"),
    ("join, watch responses", "join", "watch_responses"),
    ("join, daemon CPU s per node", "join", "cpu_s_per_node"),
    ("join, mount + status command CPU s per node", "join", "commands_cpu_s_per_node"),
    ("save: commit job-wide, s", "save", "commit_s"),
    ("save: replicated everywhere, s", "save", "s"),
    ("save: etcd requests", "save", "etcd_requests"),
    ("save: etcd events", "save", "etcd_events"),
    ("save: watch responses", "save", "watch_responses"),
    ("save: daemon CPU s per node", "save", "cpu_s_per_node"),
    ("save: daemon CPU s, busiest node", "save", "cpu_s_max_node"),
    ("RSS per daemon, MiB (median)", "rss_mib", "median"),
    ("files: create+close/s per writer", "files", "per_writer_ops_s"),
    ("files: create+close/s summed", "files", "summed_ops_s"),
    ("files: daemon CPU s per node", "files", "cpu_s_per_node"),
    ("replace: replacement holds its shard, s", "replace", "s"),
    ("replace: etcd requests", "replace", "etcd_requests"),
    ("restart: every mount up, s", "restart", "up_s"),
    ("restart: every shard read back, s", "restart", "s"),
    ("restart: etcd requests", "restart", "etcd_requests"),
    ("restart: watch responses", "restart", "watch_responses"),
]


def fit(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least squares of ``log y = log a + k log x``: (a, k), so ``y = a * x**k``; None with
    fewer than two distinct x or a value that is not positive. The exponent says how a
    cost grows: 0 constant, 1 linear in N, 2 quadratic (every node pays for every node)."""
    import math
    pts = [(x, y) for x, y in zip(xs, ys) if x > 0]
    if len({x for x, _ in pts}) < 2 or any(y <= 0 for _, y in pts):
        return None
    lx = [math.log(x) for x, _ in pts]
    ly = [math.log(y) for _, y in pts]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    k = sum((x - mx) * (y - my) for x, y in zip(lx, ly)) / sum((x - mx) ** 2 for x in lx)
    return math.exp(my - k * mx), k


def table(results: list[dict[str, Any]]) -> str:
    lines = []
    for scope in sorted({o["scope"] for o in results}):
        rs = sorted((o for o in results if o["scope"] == scope), key=lambda o: o["n"])
        head = ["row (scope=" + scope + ")", *[f"N={o['n']}" for o in rs],
                "exponent k (a*N^k)", "at 1,000", "at 10,000"]
        lines.append(" | ".join(head))
        lines.append(" | ".join(["---"] + ["---:"] * (len(head) - 1)))
        for name, phase, key in ROWS:
            vals: list[float | None] = [o.get(phase, {}).get(key) for o in rs]
            if all(v is None for v in vals):
                continue
            pts = [(o["n"], v) for o, v in zip(rs, vals) if v is not None]
            f = fit([float(p[0]) for p in pts], [float(p[1]) for p in pts])
            proj = ["-", "-", "-"] if f is None else [
                f"{f[1]:.2f}", f"{f[0] * 1000 ** f[1]:.4g}", f"{f[0] * 10000 ** f[1]:.4g}"]
            lines.append(" | ".join([name, *["-" if v is None else f"{v:g}" for v in vals],
                                     *proj]))
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="8,32,64")
    p.add_argument("--scopes", default="node,job")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--shard", default="256K")
    p.add_argument("--files", type=int, default=20)
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds each wait of a phase may take")
    p.add_argument("--insecure", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--table", default=None, help="print the table of this JSON and exit")
    args = p.parse_args(argv)
    if args.table:
        import json
        print(table(json.loads(Path(args.table).read_text())["results"]))
        return 0
    if os.geteuid() != 0:
        print("bench_scale: needs root (network namespaces, FUSE)", file=sys.stderr)
        return 2
    ns = [int(x) for x in args.nodes.split(",") if x]
    scopes = [s for s in args.scopes.split(",") if s]
    started = time.time()
    load0 = os.getloadavg()
    results: list[dict[str, Any]] = []
    errors: list[str] = []
    for scope in scopes:
        for n in ns:
            with scratch_dir(SCRATCH_SHM, f"scale{n}{scope}") as root:
                try:
                    results.append(one_n(root, n, scope, args))
                except Exception as exc:  # noqa: BLE001 (reported; the other Ns still run)
                    errors.append(f"N={n} scope={scope}: {type(exc).__name__}: "
                                  f"{str(exc)[:2000]}")
                    log(errors[-1])
    text = table(results)
    print(f"\nThe scale run (issue 42), {time.time() - started:.0f} s, load "
          f"{load0} -> {os.getloadavg()}\n")
    print(text)
    for e in errors:
        print("ERROR", e)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.json or REPO / "bench-results" / f"scale-{stamp}.json")
    write_json(out, {"args": vars(args), "machine": machine_info(), "git": git_state(),
                     "load": [load0, os.getloadavg()], "results": results,
                     "errors": errors, "table": text})
    print(f"results: {out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
