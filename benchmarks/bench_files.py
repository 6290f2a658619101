"""7. Many small files: create, list, read back, remount (``make bench-files``).

``python -m benchmarks.bench_files [--files 100000] [--bytes 1024] [--nofile N] [--json OUT]``

The number of files a mount holds is limited by ``size=``, not by the daemon's descriptor
limit (issue 12: the daemon kept one descriptor per closed file and hit EMFILE at ~20,000
files). One run, phases one after the other, each timed as files per second:

``create``   create + write ``--bytes`` + close of ``--files`` files in ``step_1/``
             (every file's bytes differ), then ``mtcfs seal step_1`` (all sealed)
``list``     ``os.scandir`` of the directory + ``stat`` of every entry
``read``     read every file back, compared bit for bit
``remount``  clean unmount + mount of the same store (seconds)
``read2``    read every file back again after the remount, bit for bit

Baseline in the same run: the same create/list/read in a directory on tmpfs (/dev/shm).
For the mount it also records the daemon's peak VmRSS per phase (sampled every 20 ms) and
the descriptors it holds (``/proc/<pid>/fd``) after each phase. ``--nofile`` sets
RLIMIT_NOFILE of the daemon (default: this process's). A phase that fails (EMFILE before
the fix) is recorded with its error and the files done. Results go to
``bench-results/files-<timestamp>.json`` unless ``--json`` names another file.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO,
    SCRATCH_SHM,
    RssSampler,
    git_state,
    machine_info,
    mtcfs_mount,
    scratch_dir,
    write_json,
)


def content(i: int, nbytes: int) -> bytes:
    head = f"file {i:08d} ".encode()
    return (head * (nbytes // len(head) + 1))[:nbytes]


def phases(d: Path, n: int, nbytes: int, out: dict[str, Any], hook=None) -> bool:
    """create / list / read in ``d``; records files/s per phase in ``out``. False on failure."""
    def run(name: str, fn) -> bool:
        if hook:
            hook(name)
        t0 = time.perf_counter()
        done = [0]
        try:
            fn(done)
        except OSError as exc:
            out[name] = {"error": f"{exc.__class__.__name__}: {exc}", "files_done": done[0],
                         "s": round(time.perf_counter() - t0, 3)}
            print(f"  {name}: FAILED after {done[0]} files: {exc}", flush=True)
            return False
        s = time.perf_counter() - t0
        out[name] = {"s": round(s, 3), "files_per_s": round(n / s, 1)}
        print(f"  {name}: {s:.1f} s, {n / s:,.0f} files/s", flush=True)
        return True

    def create(done):
        for i in range(n):
            with open(d / f"f{i:06d}", "wb") as f:
                f.write(content(i, nbytes))
            done[0] += 1

    def listing(done):
        names = []
        with os.scandir(d) as it:
            for e in it:
                e.stat()
                names.append(e.name)
                done[0] += 1
        if len(names) != n:
            raise OSError(f"listed {len(names)} files, expected {n}")

    def read(done):
        for i in range(n):
            with open(d / f"f{i:06d}", "rb") as f:
                if f.read() != content(i, nbytes):
                    raise OSError(f"f{i:06d}: wrong bytes")
            done[0] += 1

    return run("create", create) and run("list", listing) and run("read", read)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--bytes", type=int, default=1024)
    ap.add_argument("--nofile", type=int, default=0, help="RLIMIT_NOFILE of the daemon")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    n, nbytes = a.files, a.bytes
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    res: dict[str, Any] = {"bench": "files", "files": n, "bytes": nbytes,
                           "machine": machine_info(), "tmpfs": {}, "mtcfs": {}}
    res["git"] = git_state()
    print(f"tmpfs: {n} files of {nbytes} B", flush=True)
    with scratch_dir(SCRATCH_SHM, "files-tmpfs") as root:
        (root / "step_1").mkdir()
        phases(root / "step_1", n, nbytes, res["tmpfs"])
    size = max(1 << 30, 4 * n * max(nbytes, 4096))
    print(f"mtcfs: {n} files of {nbytes} B, size={size >> 20}M", flush=True)
    out = res["mtcfs"]
    with scratch_dir(SCRATCH_SHM, "files-mtcfs") as root:
        if a.nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (a.nofile, hard))
        try:
            cm = mtcfs_mount(root, {"size": f"{size >> 20}M"})
            m = cm.__enter__()
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        try:
            pid = m.pid
            out["nofile"] = resource.prlimit(pid, resource.RLIMIT_NOFILE)[0]
            fds: dict[str, int] = {}
            with RssSampler(pid) as rss:
                d = m.path("step_1")
                os.mkdir(d)
                last = ["start"]

                def hook(name: str) -> None:
                    fds[last[0]] = len(os.listdir(f"/proc/{pid}/fd"))
                    last[0] = name
                    rss.set_phase(name)

                ok = phases(d, n, nbytes, out, hook)
                fds[last[0]] = len(os.listdir(f"/proc/{pid}/fd"))
                rss.set_phase("idle")
                out["rss_peak_mib"] = {k: round(v["VmRSS"] / 2**20, 1)
                                       for k, v in rss.peaks.items() if "VmRSS" in v}
            out["daemon_fds_after"] = fds
            if ok:
                t0 = time.perf_counter()
                m.stop(timeout=300)
                if a.nofile:
                    resource.setrlimit(resource.RLIMIT_NOFILE, (a.nofile, hard))
                try:
                    m.start(timeout=300)
                finally:
                    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
                out["remount_s"] = round(time.perf_counter() - t0, 3)
                print(f"  remount: {out['remount_s']:.1f} s", flush=True)
                with RssSampler(m.pid) as rss:
                    rss.set_phase("read2")
                    r2: dict[str, Any] = {}
                    t0 = time.perf_counter()
                    done = 0
                    try:
                        for i in range(n):
                            with open(d / f"f{i:06d}", "rb") as f:
                                if f.read() != content(i, nbytes):
                                    raise OSError(f"f{i:06d}: wrong bytes")
                            done += 1
                        s = time.perf_counter() - t0
                        r2 = {"s": round(s, 3), "files_per_s": round(n / s, 1)}
                        print(f"  read2: {s:.1f} s, {n / s:,.0f} files/s", flush=True)
                    except OSError as exc:
                        r2 = {"error": str(exc), "files_done": done}
                        print(f"  read2: FAILED after {done}: {exc}", flush=True)
                    out["read2"] = r2
                    out["rss_peak_mib"]["read2"] = round(rss.peaks["read2"]["VmRSS"] / 2**20, 1)
                out["daemon_fds_after"]["read2"] = len(os.listdir(f"/proc/{m.pid}/fd"))
            print(f"  daemon peak VmRSS MiB per phase: {out['rss_peak_mib']}", flush=True)
            print(f"  daemon fds after each phase: {out['daemon_fds_after']}", flush=True)
        except BaseException:
            traceback.print_exc()
            raise
        finally:
            cm.__exit__(None, None, None)
    path = a.json or REPO / "bench-results" / (
        "files-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S") + ".json")
    write_json(path, res)
    print(f"results: {path}")
    failed = [k for k, v in out.items() if isinstance(v, dict) and "error" in v]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
