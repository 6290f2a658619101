"""3. Time from close to "backed up", per GiB: mtcfs backup tier vs a plain upload/copy.

A DCP-shaped step directory (four ``__0_<i>.distcp`` files, then ``.metadata.tmp`` renamed
to ``.metadata``, every file fsynced) of incompressible, never-repeating bytes is written
into a mount with ``backup=...,backup_interval=1ckpt``; the clock starts when the rename of
``.metadata`` returns (the commit) and stops when ``user.mtcfs.state`` of the step directory
reads ``backed-up``.

Baselines, same bytes (the same files written to tmpfs beforehand, untimed):

- gs://: google-cloud-storage uploads of the bytes as 4 MiB objects (``upload_from_string``,
  one client per thread, a pool of 4 threads, anonymous credentials) to the same
  gcp-storage-emulator;
- file://: ``shutil.copyfile`` of each file plus ``fsync``, into the same disk directory.

Each repeat gets a fresh emulator (it keeps everything in memory), a fresh mount and store,
and alternates which of the pair goes first.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import (KiB, MiB, SCRATCH_DISK, SCRATCH_SHM, BenchResult,
                               UniqueData, fmt, fmt_noise, human, log, median, mtcfs_mount,
                               mtcfs_state, scratch_dir, wait_until, write_file)

N_FILES = 4
META_BYTES = 64 * KiB
OBJECT_BYTES = 4 * MiB
THREADS = 4


def write_step(d: Path, size: int, seed: int) -> tuple[float, int]:
    """Write a DCP-shaped step of ``size`` data bytes into ``d``. Returns (seconds, bytes)."""
    t0 = time.perf_counter()
    d.mkdir()
    data = UniqueData(seed)
    per = size // N_FILES
    for i in range(N_FILES):
        write_file(d / f"__0_{i}.distcp", per, data)
    write_file(d / ".metadata.tmp", META_BYTES, data)
    os.rename(d / ".metadata.tmp", d / ".metadata")
    return time.perf_counter() - t0, per * N_FILES + META_BYTES


def step_files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.is_file())


def gcs_upload(src: Path, url: str, bucket: str, prefix: str) -> float:
    """Upload every file of ``src`` as 4 MiB objects with a pool of 4 threads."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    local = threading.local()

    def bucket_of_thread():
        b = getattr(local, "bucket", None)
        if b is None:
            client = storage.Client(project="bench", credentials=AnonymousCredentials(),
                                    client_options={"api_endpoint": url})
            b = local.bucket = client.bucket(bucket)
        return b

    def put(job: tuple[Path, int, int]) -> int:
        path, off, n = job
        fd = os.open(path, os.O_RDONLY)
        try:
            data = os.pread(fd, n, off)
        finally:
            os.close(fd)
        blob = bucket_of_thread().blob(f"{prefix}/{path.name}.{off // OBJECT_BYTES:06d}")
        blob.upload_from_string(data, content_type="application/octet-stream")
        return len(data)

    jobs = []
    for f in step_files(src):
        size = f.stat().st_size
        for off in range(0, max(size, 1), OBJECT_BYTES):
            jobs.append((f, off, min(OBJECT_BYTES, size - off)))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(THREADS) as pool:
        sent = sum(pool.map(put, jobs))
    elapsed = time.perf_counter() - t0
    expect = sum(f.stat().st_size for f in step_files(src))
    assert sent == expect, (sent, expect)
    return elapsed


def plain_copy(src: Path, dst: Path) -> float:
    t0 = time.perf_counter()
    dst.mkdir()
    for f in step_files(src):
        out = dst / f.name
        shutil.copyfile(f, out)
        fd = os.open(out, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def mtcfs_backup(root: Path, backup_url: str, size: int, seed: int,
                 env: dict[str, str] | None) -> dict[str, float]:
    """Write a step into a fresh mount and time close -> backed-up."""
    opts = {"size": "12G", "backup": backup_url, "backup_interval": "1ckpt"}
    with mtcfs_mount(root, opts, env=env) as m:
        d = m.mnt / "step_1"
        t_write, nbytes = write_step(d, size, seed)
        t = wait_until(lambda: mtcfs_state(d) == "backed-up", 900,
                       f"{d} to be backed up", interval=0.005)
        st = m.status()
        b = st.get("backup") or {}
        if b.get("failures"):
            raise RuntimeError(f"mtcfs backup reported failures: {b.get('last_error')}")
        return {"close_to_backed_up": t, "write": t_write, "bytes": nbytes,
                "daemon_upload_s": b.get("last_seconds"),
                "bytes_uploaded": b.get("last_bytes_uploaded")}


def run(size: int, reps: int = 3) -> BenchResult:
    from tests.support.gcs import GcsEmulator

    res = BenchResult("backup", f"3. Close -> backed up: a {human(size)} DCP-shaped step "
                      f"({N_FILES} files + .metadata), incompressible, median of {reps}",
                      ["target", "what", "seconds", "s per GiB", "GB/s", "vs baseline"])
    samples: dict[str, dict[str, list]] = {
        k: {"seconds": [], "extra": []} for k in ("gs-mtcfs", "gs-plain", "file-mtcfs",
                                                 "file-plain")}
    nbytes = size // N_FILES * N_FILES + META_BYTES
    with scratch_dir(SCRATCH_SHM, "backup") as shm, scratch_dir(SCRATCH_DISK, "backup") as disk:
        for rep in range(reps):
            seed = 5000 + rep
            src = shm / f"src{rep}"
            write_step(src, size, seed)  # the baseline's bytes, untimed
            mtcfs_first = rep % 2 == 0
            # --- gs://
            with GcsEmulator() as emu:
                env = {"STORAGE_EMULATOR_HOST": emu.url}
                url = f"gs://{emu.bucket}/mtcfs-bench"
                for which in (("mtcfs", "plain") if mtcfs_first else ("plain", "mtcfs")):
                    if which == "mtcfs":
                        r = mtcfs_backup(shm / f"gs-mount{rep}", url, size, seed, env)
                        samples["gs-mtcfs"]["seconds"].append(r["close_to_backed_up"])
                        samples["gs-mtcfs"]["extra"].append(r)
                    else:
                        t = gcs_upload(src, emu.url, emu.bucket, f"plain-{rep}")
                        samples["gs-plain"]["seconds"].append(t)
                    time.sleep(0.5)
            log(f"backup rep {rep + 1}/{reps} gs:   mtcfs "
                f"{samples['gs-mtcfs']['seconds'][-1]:.2f}s plain "
                f"{samples['gs-plain']['seconds'][-1]:.2f}s")
            # --- file://
            for which in (("mtcfs", "plain") if mtcfs_first else ("plain", "mtcfs")):
                if which == "mtcfs":
                    target = disk / f"backup{rep}"
                    r = mtcfs_backup(shm / f"file-mount{rep}", f"file://{target}", size, seed,
                                     None)
                    samples["file-mtcfs"]["seconds"].append(r["close_to_backed_up"])
                    samples["file-mtcfs"]["extra"].append(r)
                    shutil.rmtree(target, ignore_errors=True)
                else:
                    dst = disk / f"copy{rep}"
                    samples["file-plain"]["seconds"].append(plain_copy(src, dst))
                    shutil.rmtree(dst, ignore_errors=True)
                time.sleep(0.5)
            log(f"backup rep {rep + 1}/{reps} file: mtcfs "
                f"{samples['file-mtcfs']['seconds'][-1]:.2f}s plain "
                f"{samples['file-plain']['seconds'][-1]:.2f}s")
            shutil.rmtree(src, ignore_errors=True)
    gib = nbytes / (1 << 30)
    for kind, label in (("gs", "gs:// emulator"), ("file", f"file:// {SCRATCH_DISK}")):
        base = median(samples[f"{kind}-plain"]["seconds"])
        for who, what in (("mtcfs", "mtcfs close->backed-up"),
                          ("plain", "plain upload 4 MiB x4 thr" if kind == "gs"
                           else "plain copy + fsync")):
            xs = samples[f"{kind}-{who}"]["seconds"]
            m = median(xs)
            res.rows.append([label, what, fmt_noise(xs), fmt(m / gib if m else None),
                             fmt(nbytes / m / 1e9 if m else None),
                             fmt(m / base if m and base else None) + "x"])
    res.samples.update({"bytes": nbytes, "reps": reps, "runs": samples})
    res.notes.append("'vs baseline' is the time ratio (1.00x = as fast as the baseline; "
                     "lower is better)")
    return res
