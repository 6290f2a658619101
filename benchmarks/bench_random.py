"""Random writes and library saves (issue 18): tmpfs vs the no-op FUSE ceiling vs mtcfs.

Run ``python -m benchmarks.bench_random [--size 512M] [--files 2] [--reps 3]`` as root
(``make bench-random``). Five targets, the order rotating each repeat:

- ``tmpfs``: a directory under /dev/shm;
- ``noop``: :mod:`benchmarks.noop_fs` (writes discarded, any file, any offset): the FUSE
  ceiling with the same kernel settings as mtcfs (writeback cache, keep_cache);
- ``noop-x``: the same with ``--xattrs``: its GETXATTR answers ENODATA, as mtcfs's must,
  so it gets the GETXATTR ``security.capability`` the kernel sends before every write(2)
  (the plain no-op answers ENOSYS once and is never asked again): the ceiling of a
  filesystem with extended attributes that cannot negotiate ``FUSE_HANDLE_KILLPRIV_V2``
  (the stock pyfuse3, libfuse 3.14; mtcfs asks for it, docs/fuse-build.md);
- ``mtcfs``: one node, ``scope=node``, store on /dev/shm (direct writes on, the default:
  a file created or truncated is written around the page cache; docs/usage.md);
- ``mtcfs-cached`` (with ``--cached``): the same with ``direct_writes=no``;
- ``mtcfs-huge`` (with ``--huge``): the same, its store on a tmpfs the benchmark mounts
  with ``huge=within_size`` (large folios for the data files; docs/benchmarks.md, "Huge
  pages for the store"); skipped with a note where that mount fails.

Three measurements each:

- **random writes**: ``--files`` files of ``--size`` bytes, one thread per file (as
  ``fio --numjobs``). Each file is cut into blocks of random sizes, multiples of 4 KiB from
  4 KiB to 1 MiB, written once each in a random order with ``os.pwrite``; then ``fsync`` and
  ``close``. MiB/s is all the bytes over the time from the first open to the last close.
  Every 4 KiB page carries its file offset and a seed, so a misplaced write is seen. Then
  the files are read back and compared byte for byte (``verified``) on tmpfs and mtcfs
  (the no-op fs keeps no bytes; its reads return zeros once the kernel dropped a page),
  on mtcfs once more after dropping the page cache (from the store).
- **fio** (when installed: ``scripts/setup.sh`` adds it), the issue's command line:
  ``--rw=randwrite --bsrange=4k-1m --size=512m --numjobs=2 --ioengine=psync
  --verify=crc32c --end_fsync=1``; fio lays each file out first (writes it, closes it),
  then reopens it and writes it at random offsets; its verify reads the files back after
  dropping their cached pages. On the no-op fs ``--do_verify=0`` (it keeps nothing).
  Write MiB/s as fio reports it.
- **torch.save** of a state dict of ``--torch-size`` bytes (fp32 tensors of 8 MiB),
- **safetensors save_file** of ``--st-size`` bytes: seconds for the call, which
  closes the file (FLUSH: the kernel writes its dirty pages back before close returns).

The daemon CPU (``utime + stime`` of the FUSE server process over the phase, ms per MiB)
is shown for the no-op fs and mtcfs: on a shared machine it is steadier than wall time.
fio's CPU is per MiB of its writes and verify reads together. Targets: random-write MiB/s >= 0.7 of the no-op's; each save's seconds <= 1.2x the no-op's.
To profile the daemon under this load: ``py-spy record --pid PID`` (the pid is logged).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import json
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (MiB, BenchResult, Check, cpu_seconds, drop_caches, log, median,
                               mtcfs_mount, mtcfs_state, prefault, scratch_dir, served_mount,
                               wait_until)

TARGETS = ("tmpfs", "noop", "noop-x", "mtcfs", "mtcfs-cached", "mtcfs-huge")
NOOPS = ("noop", "noop-x")  # keep no bytes: nothing to verify
PAGE = 4096
#: The workload of the project's fio random-write job (size and numjobs added per run).
FIO_RANDOM_WRITE = ["--rw=randwrite", "--bsrange=4k-1m", "--ioengine=psync"]
BASE = np.frombuffer(random.Random(18).randbytes(16 * MiB + MiB), dtype=np.uint8)


def content(seed: int, off: int, n: int) -> np.ndarray:
    """The bytes ``[off, off + n)`` of file ``seed``; ``off`` and ``n`` multiples of 4 KiB.

    Random bytes (a 16 MiB pattern, shifted by the seed) with the offset and the seed in
    the first 16 bytes of every page.
    """
    start = (off + seed * 7 * PAGE) % (16 * MiB)
    out = np.empty(n, dtype=np.uint8)
    done = 0
    while done < n:
        take = min(n - done, 16 * MiB - start)
        out[done:done + take] = BASE[start:start + take]
        done += take
        start = 0
    words = out.view("<u8")
    words[0::PAGE // 8] = np.arange(off, off + n, PAGE, dtype=np.uint64)
    words[1::PAGE // 8] = seed
    return out


def blocks(size: int, rng: random.Random) -> list[tuple[int, int]]:
    """``size`` cut into (offset, length) blocks of 4 KiB..1 MiB (4 KiB multiples),
    shuffled."""
    out = []
    off = 0
    while off < size:
        n = min(rng.randint(1, 256) * PAGE, size - off)
        out.append((off, n))
        off += n
    rng.shuffle(out)
    return out


def random_write(paths: list[Path], size: int, seed: int) -> float:
    """Write each of ``paths`` (one thread each) as described in the module docstring.
    Returns the seconds from the first open to the last close."""
    plans = [blocks(size, random.Random(seed + i)) for i in range(len(paths))]
    errors: list[BaseException] = []
    start = threading.Barrier(len(paths) + 1)

    def one(i: int) -> None:
        try:
            start.wait()
            fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for off, n in plans[i]:
                    buf = content(seed + i, off, n)
                    if os.pwrite(fd, buf, off) != n:
                        raise OSError(f"short write at {off} of {paths[i]}")
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(paths))]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return dt


def verify(paths: list[Path], size: int, seed: int) -> float:
    """Read ``paths`` back in 16 MiB pieces and compare with what was written; seconds.

    Raises:
        AssertionError: a file's length or bytes differ (the first offset is named).
    """
    t0 = time.perf_counter()
    for i, p in enumerate(paths):
        with open(p, "rb", buffering=0) as f:
            off = 0
            buf = bytearray(16 * MiB)
            while off < size:
                n = f.readinto(buf)
                if not n:
                    break
                want = content(seed + i, off, n)
                got = np.frombuffer(buf, dtype=np.uint8, count=n)
                if not np.array_equal(got, want):
                    bad = int(np.flatnonzero(got != want)[0])
                    raise AssertionError(f"{p}: bytes differ at offset {off + bad}")
                off += n
            if off != size or f.read(1):
                raise AssertionError(f"{p}: length {off}, expected {size}")
    return time.perf_counter() - t0


def fio_job(d: Path, args: list[str], verify: bool = True) -> dict[str, float]:
    """Run one fio job (``args``: its workload options, e.g. ``--rw=randwrite``,
    ``--size=512M``, ``--numjobs=2``, ``--ioengine=psync``) in directory ``d`` with
    ``--verify=crc32c --end_fsync=1`` (``--do_verify=0`` unless ``verify``), its jobs
    reported as one group; removes its files. Returns ``read`` and ``write`` MiB/s as fio
    reports them (verify reads count as reads).

    Raises:
        RuntimeError: fio failed (a verify error included); its output is in the message.
    """
    cmd = ["fio", "--name=rand", f"--directory={d}", *args, "--verify=crc32c",
           "--end_fsync=1", "--group_reporting", "--output-format=json",
           "--verify_state_save=0"]
    if not verify:
        cmd.append("--do_verify=0")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"fio failed in {d}: {r.stdout[-2000:]} {r.stderr[-2000:]}")
    job = json.loads(r.stdout[r.stdout.index("{"):])["jobs"][0]
    if job["error"]:
        raise RuntimeError(f"fio error {job['error']} in {d}")
    for p in d.glob("rand.*"):
        p.unlink()
    return {k: float(job[k]["bw_bytes"]) / MiB for k in ("read", "write")}


def run_fio(d: Path, size: int, nfiles: int, verify: bool) -> float:
    """fio's random-write job in directory ``d`` (see the module docstring); write MiB/s.

    Raises:
        RuntimeError: fio failed (a verify error included); its output is in the message.
    """
    return fio_job(d, FIO_RANDOM_WRITE + [f"--size={size}", f"--numjobs={nfiles}"],
                   verify)["write"]


def state_dict(nbytes: int) -> dict[str, Any]:
    import torch
    g = torch.Generator().manual_seed(18)
    n = max(1, nbytes // (8 * MiB))
    return {f"layer{i}.weight": torch.rand(2 * MiB, generator=g) for i in range(n)}


def torch_save(path: Path, sd: dict[str, Any]) -> float:
    import torch
    t0 = time.perf_counter()
    torch.save(sd, path)
    return time.perf_counter() - t0


def st_save(path: Path, sd: dict[str, Any]) -> float:
    from safetensors.torch import save_file
    t0 = time.perf_counter()
    save_file(sd, str(path))
    return time.perf_counter() - t0


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def run(size: int, nfiles: int, reps: int, torch_size: int, st_size: int,
        only: tuple[str, ...], touch: bool, huge: bool = False,
        cached: bool = False) -> BenchResult:
    res = BenchResult("random", f"Random writes ({nfiles} x {size // MiB} MiB, 4 KiB-1 MiB "
                      f"blocks, verified) and library saves, median of {reps}",
                      ["target", "rand MiB/s", "rand cpu ms/MiB",
                       "fio MiB/s", "fio cpu ms/MiB", "torch.save s", "torch cpu ms/MiB",
                       "save_file s", "st cpu ms/MiB"])
    keys = ("rand", "rand_cpu", "fio", "fio_cpu", "torch", "torch_cpu", "st", "st_cpu", "read",
            "cold", "seal")
    s: dict[str, dict[str, list[float]]] = {t: {k: [] for k in keys} for t in TARGETS}
    can_drop = drop_caches()
    sd_torch = state_dict(torch_size) if "torch" in only else {}
    sd_st = state_dict(st_size) if "st" in only else {}
    torch_mib = sum(t.numel() * 4 for t in sd_torch.values()) / MiB
    st_mib = sum(t.numel() * 4 for t in sd_st.values()) / MiB
    with scratch_dir("/dev/shm", "random") as root, contextlib.ExitStack() as stack:
        (root / "tmpfs").mkdir()
        m = stack.enter_context(mtcfs_mount(root / "mtcfs", {"size": "12G"}))
        dirs = {"tmpfs": root / "tmpfs", "mtcfs": m.mnt}
        st = m.status()
        pids: dict[str, int | None] = {"tmpfs": None, "mtcfs": int(st["pid"])}
        fuse = st.get("fuse") or {}
        res.notes.append(f"mtcfs on libfuse {fuse.get('libfuse')}, FUSE_HANDLE_KILLPRIV_V2 "
                         f"{'yes' if fuse.get('killpriv_v2') else 'no'} (docs/fuse-build.md)")
        for key, extra in (("noop", []), ("noop-x", ["--xattrs"])):
            mnt = root / key
            mnt.mkdir()
            srv = stack.enter_context(served_mount(
                [sys.executable, "-m", "benchmarks.noop_fs", str(mnt)] + extra, mnt, "noop_fs",
                ["fusermount3", "-u", str(mnt)]))
            dirs[key], pids[key] = mnt, srv.pid
        if cached:
            mc = stack.enter_context(mtcfs_mount(root / "mtcfs-cached",
                                                 {"size": "12G", "direct_writes": "no"}))
            dirs["mtcfs-cached"] = mc.mnt
            pids["mtcfs-cached"] = int(mc.status()["pid"])
        huge_store = stack.enter_context(huge_tmpfs(root / "huge-tmpfs", "16G")) if huge \
            else None
        if huge and huge_store is None:
            res.notes.append("mtcfs-huge skipped: could not mount a tmpfs with "
                             "huge=within_size (needs root and a kernel with shmem THP)")
        elif huge_store is not None:
            mh = stack.enter_context(mtcfs_mount(root / "mtcfs-huge",
                                                 {"size": "12G", "store": str(huge_store)}))
            dirs["mtcfs-huge"] = mh.mnt
            pids["mtcfs-huge"] = int(mh.status()["pid"])
        targets = [t for t in TARGETS if t in dirs]
        log(f"daemon pids: {pids}")
        for rep in range(reps):
            order = targets[rep % len(targets):] + targets[:rep % len(targets)]
            for t in order:
                d, pid, st = dirs[t], pids[t], s[t]
                if "rand" in only:
                    paths = [d / f"rand{i}.bin" for i in range(nfiles)]
                    if touch:
                        prefault(2 * nfiles * size + (1 << 30))
                    c0 = cpu_seconds(pid)
                    dt = random_write(paths, size, 1000 * rep + 1)
                    st["rand_cpu"].append((cpu_seconds(pid) - c0) * 1e3
                                          / (nfiles * size / MiB))
                    st["rand"].append(nfiles * size / MiB / dt)
                    if t.startswith("mtcfs"):  # the seal must not overlap what follows
                        st["seal"].append(wait_until(
                            lambda: all(mtcfs_state(p) in ("local", "backed-up")
                                        for p in paths), 300, "the files to be sealed"))
                    if t not in NOOPS:  # it keeps no bytes: nothing to compare
                        st["read"].append(verify(paths, size, 1000 * rep + 1))
                    if t.startswith("mtcfs") and can_drop:
                        drop_caches()
                        st["cold"].append(verify(paths, size, 1000 * rep + 1))
                    log(f"rep {rep + 1} {t:5s} random write {st['rand'][-1]:7.0f} MiB/s, "
                        f"cpu {st['rand_cpu'][-1]:.2f} ms/MiB"
                        + (", verified" if t not in NOOPS else ""))
                    for p in paths:
                        os.unlink(p)
                if "fio" in only and shutil.which("fio"):
                    if touch:
                        prefault(3 * nfiles * size + (1 << 30))
                    c0 = cpu_seconds(pid)
                    st["fio"].append(run_fio(d, size, nfiles, verify=t not in NOOPS))
                    st["fio_cpu"].append((cpu_seconds(pid) - c0) * 1e3
                                         / (2 * nfiles * size / MiB))
                    log(f"rep {rep + 1} {t:5s} fio random write {st['fio'][-1]:7.0f} MiB/s, "
                        f"cpu {st['fio_cpu'][-1]:.2f} ms/MiB (layout + write + verify)")
                for key, sd, mib, fn in (("torch", sd_torch, torch_mib, torch_save),
                                         ("st", sd_st, st_mib, st_save)):
                    if key not in only:
                        continue
                    p = d / f"model.{key}"
                    if touch:
                        prefault(2 * int(mib) * MiB + (1 << 30))
                    c0 = cpu_seconds(pid)
                    st[key].append(fn(p, sd))
                    st[f"{key}_cpu"].append((cpu_seconds(pid) - c0) * 1e3 / mib)
                    log(f"rep {rep + 1} {t:5s} {key} {st[key][-1]:.3f} s, "
                        f"cpu {st[f'{key}_cpu'][-1]:.2f} ms/MiB")
                    if t.startswith("mtcfs"):
                        wait_until(lambda: mtcfs_state(p) in ("local", "backed-up"), 300,
                                   f"{p} to be sealed")
                    os.unlink(p)
                time.sleep(0.3)
        res.samples["mtcfs_counters"] = m.status().get("counters")
    med = {t: {k: median(v) for k, v in s[t].items()} for t in targets}

    def f(x: float | None, d: int = 2) -> str:
        return "-" if x is None else f"{x:.{d}f}"

    for t in targets:
        mt = med[t]
        res.rows.append([t, f(mt["rand"], 0), f(mt["rand_cpu"]) if t != "tmpfs" else "-",
                         f(mt["fio"], 0), f(mt["fio_cpu"]) if t != "tmpfs" else "-",
                         f(mt["torch"], 3), f(mt["torch_cpu"]) if t != "tmpfs" else "-",
                         f(mt["st"], 3), f(mt["st_cpu"]) if t != "tmpfs" else "-"])
    for t in (x for x in targets if x.startswith("mtcfs")):
        res.checks += [
            Check(f"{t} random write MiB/s / no-op", _ratio(med[t]["rand"],
                                                            med["noop"]["rand"]), 0.7),
            Check(f"{t} fio random write MiB/s / no-op", _ratio(med[t]["fio"],
                                                                med["noop"]["fio"]), 0.7),
            Check(f"{t} torch.save s / no-op", _ratio(med[t]["torch"],
                                                      med["noop"]["torch"]), 1.2, op="<="),
            Check(f"{t} save_file s / no-op", _ratio(med[t]["st"], med["noop"]["st"]),
                  1.2, op="<="),
        ]
    if "noop-x" in med and "mtcfs" in med:
        x, mt = med["noop-x"], med["mtcfs"]
        res.notes.append(
            "against noop-x (the ceiling of a filesystem with xattrs; not the issue's target): "
            f"rand {f(_ratio(mt['rand'], x['rand']))}, fio {f(_ratio(mt['fio'], x['fio']))}, "
            f"torch.save {f(_ratio(mt['torch'], x['torch']))}x, "
            f"save_file {f(_ratio(mt['st'], x['st']))}x")
    res.notes.append(f"torch.save {torch_mib:.0f} MiB, save_file {st_mib:.0f} MiB; "
                     f"load average {os.getloadavg()}")
    if med["mtcfs"]["cold"] is not None:
        res.notes.append(f"mtcfs verified read back after drop_caches: "
                         f"{nfiles * size / MiB / med['mtcfs']['cold']:.0f} MiB/s")
    res.samples.update({"size": size, "files": nfiles, "reps": reps, "raw": s, "median": med})
    return res


@contextlib.contextmanager
def huge_tmpfs(path: Path, size: str) -> Any:
    """Mount a tmpfs of ``size`` with ``huge=within_size`` at ``path``; yield ``path``, or
    None where the mount fails (not root, or a kernel without shmem THP). Unmounted on
    exit."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},huge=within_size,mode=0700",
                        "mtcfs-bench", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        log(f"huge tmpfs not mounted: {r.stderr.strip()}")
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": MiB, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units \
        else int(text)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.run import report
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_random", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=_size, default=512 * MiB, help="bytes per file (512M)")
    p.add_argument("--files", type=int, default=2, help="files written at once (2)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--torch-size", type=_size, default=500 * MiB)
    p.add_argument("--st-size", type=_size, default=332 * MiB)
    p.add_argument("--only", default="rand,fio,torch,st",
                   help="comma-separated: rand,fio,torch,st")
    p.add_argument("--no-prefault", action="store_true")
    p.add_argument("--huge", action="store_true",
                   help="add mtcfs-huge: mtcfs with its store on a huge=within_size tmpfs")
    p.add_argument("--cached", action="store_true",
                   help="add mtcfs-cached: mtcfs with direct_writes=no (every write through "
                        "the page cache, as before direct writes)")
    p.add_argument("--json", help="output file (default bench-results/random-<time>.json)")
    a = p.parse_args(argv)
    print(f"load average {os.getloadavg()}", flush=True)
    t0 = time.monotonic()
    res = run(a.size, a.files, a.reps, a.torch_size, a.st_size, tuple(a.only.split(",")),
              not a.no_prefault, a.huge, a.cached)
    res.seconds = time.monotonic() - t0
    report(res, "random", a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
