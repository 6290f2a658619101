"""2. PyTorch DCP save and load of a state dict: mtcfs vs tmpfs.

A single process with no process group calls ``dcp.save`` (FileSystemWriter defaults: one
file per rank, one writer thread, fsync on) into ``step_<n>/`` and then ``dcp.load`` into
preallocated tensors of the same shapes. Loads are timed twice: right after the save
("load", the page cache as the save left it) and after dropping the page cache ("cold
load"). For mtcfs, the time from the end of the save until the step is committed (its
``.metadata`` sealed: ``user.mtcfs.state`` leaves ``incomplete``) is reported as well, and
loads start after it. The two paths alternate, order rotating each repeat. Before every
save, 2x the state size + 1 GiB of free RAM is touched (``common.prefault``) unless disabled.
"""

from __future__ import annotations

import shutil
import time
import warnings

from benchmarks.common import (GiB, MiB, SCRATCH_SHM, BenchResult, drop_caches, fmt, fmt_noise,
                               gbps, human, log, median, mtcfs_mount, mtcfs_state, prefault,
                               scratch_dir, wait_until)

PATHS = ("mtcfs", "tmpfs")
TENSOR_BYTES = 32 * MiB  # fp32 weights of a mid-sized layer


def make_state(total: int):
    """``total`` bytes of fp32 "weights" (32 MiB each) plus a small bias per weight."""
    import torch
    g = torch.Generator().manual_seed(0)
    n = max(1, total // TENSOR_BYTES)
    sd = {}
    for i in range(n):
        sd[f"layers.{i}.weight"] = torch.randn(TENSOR_BYTES // 4 // 2048, 2048, generator=g)
        sd[f"layers.{i}.bias"] = torch.randn(2048, generator=g)
    return sd


def state_bytes(sd) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def run(size: int, reps: int = 3, touch: bool = True) -> BenchResult:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    sd = make_state(size)
    total = state_bytes(sd)
    target = {k: torch.empty_like(v) for k, v in sd.items()}
    res = BenchResult("dcp", f"2. DCP save/load, one process: {len(sd)} tensors, "
                      f"{human(total)}, median of {reps}",
                      ["path", "save s", "save GB/s", "save->committed ms", "load s",
                       "load GB/s", "cold load s", "cold load GB/s"])
    samples = {p: {"save": [], "commit": [], "load": [], "cold": []} for p in PATHS}
    can_drop = drop_caches()
    with scratch_dir(SCRATCH_SHM, "dcp") as root:
        tmpfs_dir = root / "tmpfs"
        tmpfs_dir.mkdir()
        with mtcfs_mount(root / "mtcfs", {"size": "12G"}) as m:
            bases = {"mtcfs": m.mnt, "tmpfs": tmpfs_dir}
            step = 0
            for rep in range(reps):
                order = PATHS if rep % 2 == 0 else PATHS[::-1]
                for p in order:
                    step += 1
                    d = bases[p] / f"step_{step}"
                    s = samples[p]
                    if touch:
                        prefault(2 * total + GiB)
                    t0 = time.perf_counter()
                    dcp.save(sd, storage_writer=FileSystemWriter(str(d)))
                    s["save"].append(time.perf_counter() - t0)
                    if p == "mtcfs":
                        s["commit"].append(wait_until(
                            lambda d=d: mtcfs_state(d) not in ("incomplete",), 300,
                            f"{d} to be committed"))
                    for t in target.values():
                        t.zero_()
                    t0 = time.perf_counter()
                    dcp.load(target, storage_reader=FileSystemReader(str(d)))
                    s["load"].append(time.perf_counter() - t0)
                    if rep == 0:
                        bad = [k for k in sd if not torch.equal(sd[k], target[k])]
                        if bad:
                            raise AssertionError(f"{p}: DCP load returned other data for {bad[:3]}")
                    cold = None
                    if can_drop:
                        drop_caches()
                        t0 = time.perf_counter()
                        dcp.load(target, storage_reader=FileSystemReader(str(d)))
                        cold = time.perf_counter() - t0
                    s["cold"].append(cold)
                    log(f"dcp rep {rep + 1}/{reps} {p:6s}: save {s['save'][-1]:.2f}s load "
                        f"{s['load'][-1]:.2f}s cold load {fmt(cold)}s")
                    shutil.rmtree(d)
                    time.sleep(0.5)
    for p in PATHS:
        s = samples[p]
        res.rows.append([
            p, fmt_noise(s["save"]), fmt(gbps(total, median(s["save"]))),
            fmt(median(s["commit"]) * 1000, 1) if s["commit"] else "-",
            fmt_noise(s["load"]), fmt(gbps(total, median(s["load"]))),
            fmt_noise(s["cold"]), fmt(gbps(total, median(s["cold"])))])
    med = {p: {k: median(v) for k, v in samples[p].items()} for p in PATHS}
    if touch:
        res.notes.append(f"{human(2 * total + GiB)} of RAM pre-touched before every save")
    res.samples.update({"prefault": touch, "bytes": total, "tensors": len(sd), "reps": reps,
                        "seconds": samples, "median": med})
    for k, label in (("save", "save"), ("load", "load"), ("cold", "cold load")):
        a, b = med["mtcfs"][k], med["tmpfs"][k]
        if a and b:
            res.notes.append(f"mtcfs {label} takes {a / b:.2f}x the tmpfs time")
    return res
