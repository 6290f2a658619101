"""What first-read verification costs (issue 12, item 5): cold read of a large file right
after a daemon restart, one tree without the verification against one with it, alternated
in the same run.

    python -m benchmarks.bench_first_read --before /work/main --after . --gib 2 --reps 3

Each repetition, for each tree: mount a fresh store under /dev/shm with that tree's mtcfs,
copy the file in, wait until it is sealed, unmount, mount again (the restart: every chunk
in RAM is now unverified), read it with ``dd bs=1M`` and take dd's own throughput. Medians
and the spread are printed as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import cpu_seconds

PY = sys.executable


def _mtcfs(tree: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    return subprocess.run([PY, "-m", "mtcfs", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=True)


def _dd(src: str, dst: str) -> float:
    """dd's bytes/s."""
    r = subprocess.run(["dd", f"if={src}", f"of={dst}", "bs=1M"], capture_output=True,
                       text=True, timeout=600, check=True)
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", r.stderr)
    assert m, r.stderr
    return int(m.group(1)) / float(m.group(2))


def one(tree: str, src: str, root: Path) -> tuple[float, float]:
    """(cold read bytes/s, daemon CPU seconds spent serving it)."""
    store, mnt = root / "store", root / "mnt"
    shutil.rmtree(root, ignore_errors=True)
    mnt.mkdir(parents=True)
    opts = f"store={store},size=8G"
    _mtcfs(tree, "bench", str(mnt), "-o", opts)
    try:
        subprocess.run(["cp", src, str(mnt / "f")], check=True, timeout=600)
        deadline = time.monotonic() + 300
        while os.getxattr(mnt / "f", "user.mtcfs.state") == b"writing":
            if time.monotonic() > deadline:
                raise TimeoutError("not sealed")
            time.sleep(0.1)
        _mtcfs(tree, "umount", str(mnt))
        _mtcfs(tree, "bench", str(mnt), "-o", opts)  # the restart
        pid = json.loads(_mtcfs(tree, "status", str(mnt), "--json").stdout)["pid"]
        cpu0 = cpu_seconds(pid)
        rate = _dd(str(mnt / "f"), "/dev/null")
        return rate, cpu_seconds(pid) - cpu0
    finally:
        subprocess.run([PY, "-m", "mtcfs", "umount", str(mnt)], capture_output=True,
                       env=dict(os.environ, PYTHONPATH=os.path.abspath(tree)), timeout=120)
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="tree without first-read verification")
    ap.add_argument("--after", required=True, help="tree with it")
    ap.add_argument("--gib", type=float, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm/bench-first-read")
    a = ap.parse_args()
    base = Path(a.dir)
    base.mkdir(parents=True, exist_ok=True)
    src = str(base / "src")
    with open(src, "wb") as f:  # incompressible, written once
        for _ in range(int(a.gib * 1024)):
            f.write(os.urandom(1 << 20))
    res: dict[str, list[float]] = {"before": [], "after": []}
    cpu: dict[str, list[float]] = {"before": [], "after": []}
    try:
        for _ in range(a.reps):
            for name, tree in (("before", a.before), ("after", a.after)):
                rate, secs = one(tree, src, base / name)
                res[name].append(rate / 1e9)
                cpu[name].append(secs / a.gib)
    finally:
        os.unlink(src)
    out = {k: {"median_GBps": round(statistics.median(v), 2),
               "spread_pct": round(50 * (max(v) - min(v)) / statistics.median(v)),
               "runs": [round(x, 2) for x in v],
               "daemon_cpu_s_per_gib": round(statistics.median(cpu[k]), 2)}
           for k, v in res.items()}
    out["ratio"] = round(out["after"]["median_GBps"] / out["before"]["median_GBps"], 2)
    out["gib"], out["load_avg"] = a.gib, os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
