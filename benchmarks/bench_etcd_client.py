"""The etcd client's transport: puts per second through mtcfs's gRPC stubs and through
etcd's HTTP/JSON gateway (the transport of HTTP clients such as etcd3gw), same etcd.

``python -m benchmarks.bench_etcd_client [--puts 2000] [--reps 2]`` starts a 1-member etcd
on loopback (tests/support/etcd.py), does ``--puts`` sequential puts of 200 bytes each way,
``--reps`` times, and prints the best rate of each. docs/coordination.md uses it for the
choice of the client.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from mtcfs.tiers.coord.etcd import Etcd  # noqa: E402
from support.etcd import EtcdCluster  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_etcd_client")
    p.add_argument("--puts", type=int, default=2000)
    p.add_argument("--reps", type=int, default=2)
    a = p.parse_args(argv)
    cluster = EtcdCluster(Path(tempfile.mkdtemp(prefix="mtcfs-bench-etcd-", dir="/dev/shm")), 1)
    cluster.start()
    client = Etcd(cluster.endpoints)
    host, port = cluster.endpoints[0].split(":")
    conn = http.client.HTTPConnection(host, int(port))
    value = b"x" * 200

    def grpc_put(i: int) -> None:
        client.put(b"/bench/g/%d" % i, value)

    def http_put(i: int) -> None:
        body = json.dumps({"key": base64.b64encode(b"/bench/h/%d" % i).decode(),
                           "value": base64.b64encode(value).decode()})
        conn.request("POST", "/v3/kv/put", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        if r.status != 200:
            raise RuntimeError(f"gateway answered {r.status}")

    best: dict[str, float] = {}
    try:
        for _ in range(a.reps):
            for name, fn in (("grpc stubs (mtcfs)", grpc_put), ("HTTP/JSON gateway", http_put)):
                t0 = time.perf_counter()
                for i in range(a.puts):
                    fn(i)
                best[name] = max(best.get(name, 0.0), a.puts / (time.perf_counter() - t0))
    finally:
        client.close()
        conn.close()
        cluster.stop()
    for name, rate in best.items():
        print(f"{name:>20}: {rate:,.0f} puts/s (best of {a.reps}, {a.puts} sequential puts "
              "of 200 B)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
