#!/usr/bin/env python3
"""mtcfs end to end: train, checkpoint into RAM, back up, lose the node, restore, resume.

    python examples/demo.py                      # PyTorch + DCP
    python examples/demo.py --framework jax      # JAX + Orbax CheckpointManager
    python examples/demo.py --steps 40 --every 10

What it does (needs root or FUSE permissions, like any mtcfs mount):

1. makes a scratch directory: the RAM-tier store under /dev/shm, a ``file://`` backup
   directory and a mount point; mounts mtcfs there with the CLI
   (``mtcfs JOB MNT -o store=...,backup=file://...,backup_interval=1ckpt,keep=2``);
2. trains a small model on CPU, deterministically (fixed seeds, the batch of step n is
   generated from n), saving a checkpoint (model + optimizer + step) into ``MNT/step_<n>``
   (DCP) or ``MNT/<n>`` (Orbax) every ``--every`` steps, with the library's own API, unchanged;
3. "crashes" a few steps after the latest checkpoint: waits until that checkpoint is
   backed up, unmounts and wipes the store (the node and its RAM are gone);
4. mounts again on an empty store with the same backup: the latest checkpoint is back at
   once (data faulted in behind it), loads it, and resumes training to the end;
5. compares with an uninterrupted run of the same length in this process: the final loss and
   every weight must be identical (bit for bit). Prints a summary and PASS or FAIL; the exit
   status is 0 only on PASS.

The mount is always torn down (clean unmount, else abort + lazy unmount), also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _mount_util import MtcfsMount, is_mounted, remove_store  # noqa: E402

warnings.filterwarnings("ignore")
MiB = 1 << 20


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# ---------------------------------------------------------------------- bookkeeping

@dataclass
class Ckpt:
    step: int
    name: str
    save_s: float
    saved_at: float
    backed_up_at: float | None = None
    size: int | None = None


@dataclass
class Report:
    framework: str
    steps: int
    every: int
    crash_at: int
    params: int = 0
    ckpts: list[Ckpt] = field(default_factory=list)
    restored: str = ""
    namespace_s: float = 0.0
    full_s: float = 0.0
    restore_bytes: int = 0
    final_loss: float = float("nan")
    ref_loss: float = float("nan")
    tensors: int = 0
    tensors_equal: int = 0
    loaded_equal: bool = False

    @property
    def passed(self) -> bool:
        return (self.final_loss == self.ref_loss and self.tensors > 0
                and self.tensors_equal == self.tensors and self.loaded_equal)


class BackupWatcher(threading.Thread):
    """Records when each saved checkpoint's ``user.mtcfs.state`` becomes ``backed-up``
    (the plain-xattr way a training script asks "is this checkpoint durable yet?")."""

    def __init__(self, mnt: Path) -> None:
        super().__init__(daemon=True, name="backup-watcher")
        self.mnt = mnt
        self.pending: list[Ckpt] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def add(self, c: Ckpt) -> None:
        with self.lock:
            self.pending.append(c)

    def run(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                todo = [c for c in self.pending if c.backed_up_at is None]
            for c in todo:
                try:
                    state = os.getxattr(self.mnt / c.name, "user.mtcfs.state").decode()
                except OSError:
                    continue  # deleted (Orbax max_to_keep) or not there yet
                if state == "backed-up":
                    c.backed_up_at = time.monotonic()
            self.stop.wait(0.01)

    def wait(self, c: Ckpt, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while c.backed_up_at is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"checkpoint {c.name} was not backed up in {timeout:.0f}s")
            time.sleep(0.01)


# ---------------------------------------------------------------------- PyTorch + DCP

@contextlib.contextmanager
def interrupts_kept() -> Iterator[None]:
    """A Ctrl-C (or SIGTERM) during a DCP call stays a KeyboardInterrupt: DCP wraps each
    rank's exception, an interrupt's too, in its CheckpointException (a BaseException),
    so the demo would exit with a traceback instead of cleaning up and exiting 130."""
    try:
        yield
    except BaseException as exc:
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict) and any(
                isinstance(pair[0], KeyboardInterrupt) for pair in failures.values()):
            raise KeyboardInterrupt from exc
        raise


class TorchJob:
    """A small MLP regression with Adam; batch n is generated from n alone."""

    def __init__(self, width: int) -> None:
        import torch
        torch.use_deterministic_algorithms(True)
        self.torch = torch
        self.width = width

    def init(self):
        import torch
        import torch.nn as nn
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, self.width), nn.Tanh(),
                              nn.Linear(self.width, self.width), nn.Tanh(),
                              nn.Linear(self.width, 16))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        return model, opt

    def batch(self, n: int):
        g = self.torch.Generator().manual_seed(10_000 + n)
        x = self.torch.randn(128, 64, generator=g)
        y = self.torch.sin(x[:, :16] * 2.0) + 0.1 * self.torch.randn(128, 16, generator=g)
        return x, y

    def train_step(self, job_state, n: int) -> float:
        model, opt = job_state
        x, y = self.batch(n)
        opt.zero_grad(set_to_none=True)
        loss = self.torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    def params(self, job_state) -> int:
        return sum(p.numel() for p in job_state[0].parameters())

    def ckpt_name(self, n: int) -> str:
        return f"step_{n}"

    def _sd(self, job_state, n: int) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(*job_state)
        return {"model": msd, "optim": osd, "step": self.torch.tensor(n)}

    def save(self, mnt: Path, job_state, n: int) -> None:
        import torch.distributed.checkpoint as dcp
        with interrupts_kept():
            dcp.save(self._sd(job_state, n), checkpoint_id=str(mnt / self.ckpt_name(n)))

    def open_manager(self, mnt: Path) -> None:
        pass

    def close_manager(self) -> None:
        pass

    def latest(self, mnt: Path) -> int | None:
        steps = [int(m.group(1)) for name in os.listdir(mnt)
                 if (m := re.fullmatch(r"step_(\d+)", name))
                 and (mnt / name / ".metadata").exists()]
        return max(steps) if steps else None

    def load(self, mnt: Path, n: int):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict
        job_state = self.init()
        sd = self._sd(job_state, -1)
        with interrupts_kept():
            dcp.load(sd, checkpoint_id=str(mnt / self.ckpt_name(n)))
        set_state_dict(*job_state, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        return job_state, int(sd["step"])

    def snapshot(self, job_state) -> dict:
        """Every tensor of model and optimizer, copied (for bit-exact comparison)."""
        import copy
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(*job_state)
        flat = {}

        def walk(prefix, obj):
            if isinstance(obj, self.torch.Tensor):
                flat[prefix] = obj.detach().clone()
            elif isinstance(obj, dict):
                for k, v in obj.items():
                    walk(f"{prefix}/{k}", v)
            elif isinstance(obj, (list, tuple)):
                for i, v in enumerate(obj):
                    walk(f"{prefix}[{i}]", v)
            else:
                flat[prefix] = copy.deepcopy(obj)
        walk("model", msd)
        walk("optim", osd)
        return flat

    def equal(self, a, b) -> bool:
        if isinstance(a, self.torch.Tensor):
            return isinstance(b, self.torch.Tensor) and a.dtype == b.dtype \
                and self.torch.equal(a, b)
        return a == b


# ---------------------------------------------------------------------- JAX + Orbax

class JaxJob:
    """The same kind of job in jax.numpy: an MLP and hand-written SGD with momentum,
    checkpointed with Orbax's CheckpointManager."""

    def __init__(self, width: int) -> None:
        import jax
        import jax.numpy as jnp
        import numpy as np
        import orbax.checkpoint as ocp
        self.jax, self.jnp, self.np, self.ocp = jax, jnp, np, ocp
        self.width = width
        self.mgr = None

        def loss_fn(params, x, y):
            h = jnp.tanh(x @ params["w1"] + params["b1"])
            h = jnp.tanh(h @ params["w2"] + params["b2"])
            out = h @ params["w3"] + params["b3"]
            return jnp.mean((out - y) ** 2)

        def step(state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
            mom = jax.tree.map(lambda m, g: 0.9 * m + g, state["momentum"], grads)
            params = jax.tree.map(lambda p, m: p - 0.05 * m, state["params"], mom)
            return {"params": params, "momentum": mom, "step": state["step"] + 1}, loss

        self._step = jax.jit(step)

    def init(self):
        jax, jnp = self.jax, self.jnp
        k = jax.random.split(jax.random.PRNGKey(0), 3)
        w = self.width

        def dense(key, n_in, n_out):
            return jax.random.normal(key, (n_in, n_out), jnp.float32) / jnp.sqrt(n_in)
        params = {"w1": dense(k[0], 64, w), "b1": jnp.zeros(w), "w2": dense(k[1], w, w),
                  "b2": jnp.zeros(w), "w3": dense(k[2], w, 16), "b3": jnp.zeros(16)}
        return {"params": params, "momentum": jax.tree.map(jnp.zeros_like, params),
                "step": jnp.asarray(0, jnp.int32)}

    def batch(self, n: int):
        kx, ky = self.jax.random.split(self.jax.random.PRNGKey(10_000 + n))
        x = self.jax.random.normal(kx, (128, 64))
        y = self.jnp.sin(x[:, :16] * 2.0) + 0.1 * self.jax.random.normal(ky, (128, 16))
        return x, y

    def train_step(self, job_state, n: int):
        new, loss = self._step(job_state[0], *self.batch(n))
        job_state[0] = new
        return float(loss)

    def params(self, job_state) -> int:
        return sum(int(x.size) for x in self.jax.tree.leaves(job_state[0]["params"]))

    def ckpt_name(self, n: int) -> str:
        return str(n)

    def open_manager(self, mnt: Path) -> None:
        ocp = self.ocp
        opts = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
        self.mgr = ocp.CheckpointManager(str(mnt), options=opts)

    def close_manager(self) -> None:
        if self.mgr is not None:
            self.mgr.close()
            self.mgr = None

    def save(self, mnt: Path, job_state, n: int) -> None:
        self.mgr.save(n, args=self.ocp.args.StandardSave(job_state[0]))
        self.mgr.wait_until_finished()

    def latest(self, mnt: Path) -> int | None:
        return self.mgr.latest_step()

    def load(self, mnt: Path, n: int):
        target = self.jax.tree.map(lambda x: self.np.zeros(x.shape, x.dtype), self.init())
        restored = self.mgr.restore(n, args=self.ocp.args.StandardRestore(target))
        restored = self.jax.tree.map(self.jnp.asarray, restored)
        return [restored], int(restored["step"])

    def snapshot(self, job_state) -> dict:
        flat, _ = self.jax.tree_util.tree_flatten_with_path(job_state[0])
        return {self.jax.tree_util.keystr(p): self.np.array(v) for p, v in flat}

    def equal(self, a, b) -> bool:
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ---------------------------------------------------------------------- the demo

def run(args: argparse.Namespace, work: Path, store: Path) -> Report:
    fw = args.framework
    job = TorchJob(args.width) if fw == "torch" else JaxJob(args.width)
    init = job.init() if fw == "torch" else [job.init()]
    crash_at = args.crash_at if args.crash_at is not None else max(args.every,
                                                                   (args.steps * 7) // 10)
    if crash_at < args.every or crash_at >= args.steps:
        raise SystemExit(f"--crash-at must be in [--every, --steps): got {crash_at}")
    rep = Report(fw, args.steps, args.every, crash_at, params=job.params(init))

    # Reference: the same training, uninterrupted, in memory.
    ref = job.init() if fw == "torch" else [job.init()]
    for n in range(args.steps):
        rep.ref_loss = job.train_step(ref, n)
    ref_weights = job.snapshot(ref)

    backup = work / "backup"
    mnt = work / "mnt"
    mnt.mkdir()
    opts = {"store": str(store), "size": args.size, "backup": f"file://{backup}",
            "backup_interval": "1ckpt", "keep": "2"}
    m = MtcfsMount(f"demo-{fw}-{os.getpid()}", mnt, opts)
    print(f"mtcfs demo ({fw}): store {store}, backup file://{backup}", flush=True)
    print(f"mount point: {mnt}", flush=True)
    watcher = BackupWatcher(mnt)
    try:
        m.mount()
        watcher.start()
        job.open_manager(mnt)
        # --- phase 1: train and checkpoint until the node is lost --------------------
        state = job.init() if fw == "torch" else [job.init()]
        saved_weights = None
        for n in range(crash_at):
            job.train_step(state, n)
            done = n + 1
            if done % args.every == 0:
                t0 = time.monotonic()
                job.save(mnt, state, done)
                c = Ckpt(done, job.ckpt_name(done), time.monotonic() - t0, time.monotonic())
                rep.ckpts.append(c)
                watcher.add(c)
                saved_weights = job.snapshot(state)
                print(f"  step {done:>5}: checkpoint {c.name} saved in {c.save_s:.3f}s",
                      flush=True)
        latest = rep.ckpts[-1]
        watcher.wait(latest)
        sizes = {r["step"]: r["bytes"] for r in m.checkpoints()}
        for c in rep.ckpts:
            c.size = sizes.get(c.name)
        job.close_manager()
        print(f"  step {crash_at:>5}: the node is lost ({crash_at - latest.step} steps since "
              f"{latest.name}, which is backed up)", flush=True)

        # --- phase 2: the node is gone; a new one mounts the same job ----------------
        watcher.stop.set()
        m.unmount()
        remove_store(store)  # its data tmpfs too (it outlives the daemon)
        t0 = time.monotonic()
        m.mount()  # on an empty store: the newest backed-up checkpoint comes back
        names = os.listdir(mnt)
        rep.namespace_s = time.monotonic() - t0
        st = m.status()
        rep.restored = (st.get("restore") or {}).get("step", "")
        while st["restore"]["pending_chunks"]:
            time.sleep(0.01)
            st = m.status()
        rep.full_s = time.monotonic() - t0
        rep.restore_bytes = (st.get("restore") or {}).get("bytes", 0)
        print(f"  new node: {names} back in {rep.namespace_s:.3f}s, all data in "
              f"{rep.full_s:.3f}s", flush=True)

        # --- phase 3: resume from the latest checkpoint to the end -------------------
        job.open_manager(mnt)
        resume = job.latest(mnt)
        if resume != latest.step:
            raise RuntimeError(f"expected to resume from step {latest.step}, found {resume}")
        state, start = job.load(mnt, resume)
        assert start == resume, (start, resume)
        loaded = job.snapshot(state)
        rep.loaded_equal = loaded.keys() == saved_weights.keys() and all(
            job.equal(loaded[k], saved_weights[k]) for k in loaded)
        for n in range(start, args.steps):
            rep.final_loss = job.train_step(state, n)
        job.close_manager()
        final = job.snapshot(state)
        rep.tensors = len(ref_weights)
        rep.tensors_equal = sum(1 for k, v in ref_weights.items()
                                if k in final and job.equal(final[k], v))
    finally:
        watcher.stop.set()
        try:
            job.close_manager()
        finally:
            m.force()
    return rep


def print_report(rep: Report) -> None:
    print()
    print(f"== mtcfs demo: {rep.framework} ({'DCP' if rep.framework == 'torch' else 'Orbax'}),"
          f" {rep.params:,} parameters, {rep.steps} steps, checkpoint every {rep.every} ==")
    print(f"{'checkpoint':<12} {'size':>10} {'save (RAM tier)':>16} {'backed up after':>16}")
    for c in rep.ckpts:
        bu = "-" if c.backed_up_at is None else f"{c.backed_up_at - c.saved_at:.3f} s"
        print(f"{c.name:<12} {human(c.size) if c.size else '-':>10} {c.save_s:>14.3f} s "
              f"{bu:>16}")
    print(f"node lost at step {rep.crash_at}; restored {rep.restored or '?'} "
          f"({human(rep.restore_bytes)}) from the backup: namespace in {rep.namespace_s:.3f} s,"
          f" all data faulted in after {rep.full_s:.3f} s")
    print(f"resumed at step {rep.ckpts[-1].step if rep.ckpts else '?'} -> {rep.steps}: "
          f"loaded state bit-exact: {'yes' if rep.loaded_equal else 'NO'}")
    print(f"final loss {rep.final_loss!r} vs uninterrupted {rep.ref_loss!r}: "
          f"{'identical' if rep.final_loss == rep.ref_loss else 'DIFFERENT'}")
    print(f"weights and optimizer state: {rep.tensors_equal}/{rep.tensors} entries identical")
    print("PASS" if rep.passed else "FAIL")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--framework", choices=("torch", "jax"), default="torch")
    p.add_argument("--steps", type=int, default=40, help="training steps in all")
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--crash-at", type=int, default=None,
                   help="step at which the node is lost (default: 70%% of --steps)")
    p.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    p.add_argument("--size", default="1G", help="RAM tier capacity (size= option)")
    args = p.parse_args(argv)
    if args.steps < 2 or args.every < 1:
        p.error("need --steps >= 2 and --every >= 1")

    # Ctrl-C (even if the shell started us with SIGINT ignored) and SIGTERM end the demo
    # through the finally blocks that unmount.
    def on_term(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, on_term)

    work = Path(tempfile.mkdtemp(prefix="mtcfs-demo-"))
    store = Path(tempfile.mkdtemp(prefix="mtcfs-demo-store-", dir="/dev/shm"))
    rep = None
    try:
        rep = run(args, work, store)
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr, flush=True)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the cleanup finish
        mnt = work / "mnt"
        if is_mounted(mnt):
            from _mount_util import force_unmount
            force_unmount(mnt)
        remove_store(store, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    print_report(rep)
    return 0 if rep.passed else 1


if __name__ == "__main__":
    sys.exit(main())
