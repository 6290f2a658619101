"""4. Daemon memory while writing: peak RSS must not grow with the amount of data.

One mount (size=12G, store on tmpfs). A sampler thread reads ``/proc/<daemon pid>/status``
every 20 ms while a file of each size is written (16 MiB os.write, fsync, close) and then
until it is sealed (hashed in the background after close). The file is deleted between
sizes. Target: peak VmRSS while writing the large file < 1.5x that of the small one
+ 20 MiB.

VmRSS = RssAnon (the daemon's private memory) + RssFile + RssShmem (tmpfs pages it has
mapped, which are the store's own data, not extra memory); all are reported per phase.
The seal phase (the daemon mmaps the closed file to hash it) is reported for information;
the target is on the write phase.
"""

from __future__ import annotations

import os
import time

from benchmarks.common import (MiB, SCRATCH_SHM, BenchResult, Check, RssSampler, UniqueData,
                               daemon_pid, gbps, human, log, mtcfs_mount, mtcfs_state,
                               scratch_dir, wait_until, write_file)


def run(sizes: list[int]) -> BenchResult:
    res = BenchResult("rss", "4. mtcfs daemon peak memory while writing (VmRSS / RssAnon / "
                      "RssShmem, MiB)",
                      ["file size", "idle VmRSS", "write: VmRSS", "write: RssAnon",
                       "write: RssShmem", "seal: VmRSS", "seal: RssAnon", "seal: RssShmem",
                       "write GB/s"])
    runs = []
    with scratch_dir(SCRATCH_SHM, "rss") as root:
        with mtcfs_mount(root / "mtcfs", {"size": "12G"}) as m:
            pid = daemon_pid(m)
            with RssSampler(pid) as rss:
                time.sleep(0.5)
                for i, size in enumerate(sizes):
                    f = m.mnt / f"rss-{i}.bin"
                    rss.set_phase(f"idle-{i}")
                    time.sleep(0.3)
                    rss.set_phase(f"write-{i}")
                    t = write_file(f, size, UniqueData(seed=9000 + i))
                    rss.set_phase(f"seal-{i}")
                    wait_until(lambda f=f: mtcfs_state(f) in ("local", "backed-up"), 600,
                               f"{f} to be sealed")
                    rss.set_phase(f"after-{i}")
                    os.unlink(f)
                    time.sleep(1.0)
                    peaks = {ph: dict(rss.peaks.get(f"{ph}-{i}", {}))
                             for ph in ("idle", "write", "seal")}
                    runs.append({"size": size, "write_s": t, "gbps": gbps(size, t),
                                 "peaks": peaks})
                    log(f"rss {human(size)}: write VmRSS "
                        f"{peaks['write'].get('VmRSS', 0) / MiB:.0f} MiB, seal VmRSS "
                        f"{peaks['seal'].get('VmRSS', 0) / MiB:.0f} MiB")
    res.samples["runs"] = runs

    def mib(r: dict, ph: str, k: str) -> str:
        v = r["peaks"].get(ph, {}).get(k)
        return "-" if v is None else f"{v / MiB:.0f}"

    for r in runs:
        res.rows.append([human(r["size"]), mib(r, "idle", "VmRSS"),
                         mib(r, "write", "VmRSS"), mib(r, "write", "RssAnon"),
                         mib(r, "write", "RssShmem"), mib(r, "seal", "VmRSS"),
                         mib(r, "seal", "RssAnon"), mib(r, "seal", "RssShmem"),
                         f"{r['gbps']:.2f}"])
    if len(runs) >= 2:
        small, large = runs[0], runs[-1]
        for ph, k, label, info in (("write", "VmRSS", "peak VmRSS while writing", False),
                                   ("seal", "VmRSS", "peak VmRSS while sealing", True),
                                   ("seal", "RssAnon", "peak RssAnon while sealing", True)):
            a = small["peaks"].get(ph, {}).get(k)
            b = large["peaks"].get(ph, {}).get(k)
            if a is None or b is None:
                continue
            limit = 1.5 * a + 20 * MiB
            res.checks.append(Check(
                f"{label}: {human(large['size'])} < 1.5x {human(small['size'])} + 20 MiB",
                b / MiB, limit / MiB, "<", info=info,
                detail=f"{b / MiB:.0f} MiB vs limit {limit / MiB:.0f} MiB"))
    return res
