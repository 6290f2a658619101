"""Real multi-process PyTorch Distributed Checkpoint: one OS process per torch rank.

Each rank joins a gloo process group on 127.0.0.1, shards a small MLP and its Adam state
with FSDP2 (``fully_shard`` on a 1-D CPU DeviceMesh, so every tensor of the state dict is a
DTensor ``Shard(0)``) and saves or loads it with ``torch.distributed.checkpoint`` in *its
own* directory: the mount of the node hosting it (in a plain shared-directory run every
rank gets the same one). A save writes ``__<rank>_0.distcp`` from every rank and
``.metadata`` from rank 0; a load may use another world size (DCP reshards: ranks read
each other's files).

Nothing extra goes into the checkpoint directory. Each rank reports, in a JSON result
outside it, the digest of every FULL tensor (DTensors gathered with ``full_tensor()``), so
a load is checked bit for bit against its save by comparing the two ``digests`` maps.

Worker (from the repository root; MASTER_ADDR/MASTER_PORT in the environment)::

    python -m tests.support.dcp_ranks --rank 0 --world 4 --dir /mnt/n0 --mode save --step 1

Launcher, from a test::

    saved = run_ranks([n0, n0, n1, n1], "save", step=1)      # rank -> directory
    loaded = run_ranks([n1, n0, n1, n0], "load", step=1)
    assert loaded[0]["digests"] == saved[0]["digests"]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

MODES = ("save", "async_save", "load")
REPO = Path(__file__).resolve().parents[2]

# Model: 64 -> 512 -> 512 -> 512 -> 10, about 0.56 M float32 parameters (2.3 MB); with
# Adam's exp_avg and exp_avg_sq a checkpoint is about 6.8 MB. 10 output rows shard
# unevenly over 3 or 4 ranks, and 512 over 3: resharding is not only even splits.
WIDTHS = (64, 512, 512, 512, 10)
TRAIN_STEPS = 3
BATCH = 32


# -- the worker: model, training, state --------------------------------------------------------

def build_model(seed: int, mesh: Any) -> Any:
    """The MLP with weights drawn from ``seed``, sharded with FSDP2 over ``mesh``: each
    Linear is its own FSDP unit, then the root."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(itertools.pairwise(WIDTHS)):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(n_in, n_out))
    model = nn.Sequential(*layers)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(model: Any, opt: Any, seed: int, steps: int = TRAIN_STEPS) -> None:
    """``steps`` Adam steps on random regression data drawn from ``seed`` (the same batch
    on every rank: FSDP averages the gradients, so every rank agrees on the update)."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        x = torch.randn(BATCH, WIDTHS[0], generator=g)
        y = torch.randn(BATCH, WIDTHS[-1], generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def train_state(seed: int, mesh: Any, steps: int) -> tuple[Any, Any]:
    """(model, Adam) over ``mesh``, initialised from ``seed``, after ``steps`` steps
    (``steps=0``: a fresh optimizer with no state yet)."""
    import torch

    model = build_model(seed, mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    train(model, opt, seed, steps)
    return model, opt


def dcp_state(model: Any, opt: Any) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` as DCP takes it: FQN keys, DTensor values (an
    optimizer without state gets it initialised, so it can be a load target)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def tensors(state: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every tensor leaf of a nested state dict as ``("model/0.weight", tensor)``, in a
    fixed order (sorted keys)."""
    import torch

    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for k in sorted(state, key=str):
            yield from tensors(state[k], f"{prefix}/{k}" if prefix else str(k))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from tensors(v, f"{prefix}[{i}]")


def full_digests(state: Any) -> dict[str, str]:
    """blake3 of each FULL tensor of ``state`` (dtype and shape included): a collective,
    every rank must call it with the same keys."""
    import blake3
    import torch
    from torch.distributed.tensor import DTensor

    out = {}
    for name, t in tensors(state):
        full = t.full_tensor() if isinstance(t, DTensor) else t
        full = full.detach().contiguous().cpu()
        h = blake3.blake3(f"{full.dtype}{tuple(full.shape)}".encode())
        h.update(full.reshape(-1).view(torch.uint8).numpy().tobytes())
        out[name] = h.hexdigest()
    return out


# -- the worker: save and load -----------------------------------------------------------------

def save(path: Path, mode: str, seed: int, steps: int, mesh: Any) -> dict[str, str]:
    """Train, then ``dcp.save`` (or ``dcp.async_save`` + ``.result()``) into ``path``.
    Returns the digests of what was saved."""
    import torch.distributed.checkpoint as dcp

    model, opt = train_state(seed, mesh, steps)
    state = dcp_state(model, opt)
    digests = full_digests(state)
    if mode == "async_save":
        dcp.async_save(state, checkpoint_id=str(path)).result()
    else:
        dcp.save(state, checkpoint_id=str(path))
    return digests


def load(path: Path, seed: int, mesh: Any) -> dict[str, str]:
    """A fresh model and optimizer (other values: seed ``seed + 1000``, untrained) over
    ``mesh``; ``dcp.load`` from ``path``, set into them, and read back. Returns the digests
    of what the model and optimizer then hold."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt = train_state(seed + 1000, mesh, steps=0)
    state = dcp_state(model, opt)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return full_digests(dcp_state(model, opt))


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One rank: join the group, save or load ``<dir>/step_<N>``, leave. Returns its result."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore")  # DCP/FSDP warn about CPU, overwrite, experimental APIs
    torch.set_num_threads(1)
    t0 = time.monotonic()
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world,
                            timeout=timedelta(seconds=args.pg_timeout))
    try:
        mesh = init_device_mesh("cpu", (args.world,))
        path = Path(args.dir) / f"step_{args.step}"
        if args.mode == "load":
            digests = load(path, args.seed, mesh)
        else:
            digests = save(path, args.mode, args.seed, args.train_steps, mesh)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {"rank": args.rank, "world": args.world, "mode": args.mode, "path": str(path),
            "seconds": round(time.monotonic() - t0, 3), "digests": digests}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.support.dcp_ranks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--dir", required=True, help="this rank's directory (its node's mount)")
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--step", type=int, required=True, help="checkpoint is <dir>/step_<N>")
    p.add_argument("--seed", type=int, default=0, help="model/data seed of the save")
    p.add_argument("--train-steps", type=int, default=TRAIN_STEPS)
    p.add_argument("--pg-timeout", type=float, default=120.0, help="collective timeout (s)")
    p.add_argument("--result", help="write the JSON result here (default: stdout)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    text = json.dumps(worker(args), sort_keys=True)
    if args.result:
        Path(args.result).write_text(text)
    else:
        print(text)
    return 0


# -- the launcher ------------------------------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that no other test process is handed (support/ports.py; the launcher
    runs in the test process, where ``support`` is a package)."""
    from .ports import free_port as port
    return port(host)


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> str | None:
    """Wait until every process exits. Once one fails, or ``timeout`` passes, kill the rest
    (they would hang in a collective). Returns why the run failed; ``None`` if it did not."""
    deadline = time.monotonic() + timeout
    timed_out = False
    while any(p.poll() is None for p in procs):
        if any(p.returncode for p in procs):
            break
        if time.monotonic() > deadline:
            timed_out = True
            break
        time.sleep(0.05)
    failed = [r for r, p in enumerate(procs) if p.returncode]
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    if timed_out:
        return f"timed out after {timeout:.0f}s"
    if failed:
        return f"rank(s) {failed} failed (ranks still running then were killed: exit -9)"
    return None


def run_ranks(dirs: list[Path], mode: str, step: int, *, seed: int = 0,
              train_steps: int = TRAIN_STEPS, timeout: float = 300.0) -> list[dict[str, Any]]:
    """Run ``len(dirs)`` ranks at once, rank ``r`` saving or loading ``dirs[r]/step_<step>``.

    Args:
        dirs: one directory per rank (the mount of the node hosting it); the world size.
        mode: ``"save"``, ``"async_save"`` (``dcp.async_save`` then ``.result()``), or
            ``"load"`` (any world size; digests are those of the loaded state).
        step: the checkpoint directory is ``step_<step>`` in each rank's directory.
        seed: model and data seed of a save (a load starts from other values).
        train_steps: optimizer steps before a save.
        timeout: seconds for the whole run.

    Returns:
        each rank's result, in rank order: ``{"rank", "world", "mode", "path",
        "seconds", "digests": {tensor path: blake3 of the full tensor}}``.

    Raises:
        RuntimeError: a rank failed or the run timed out; with every failing rank's exit
            status and stderr tail.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory(prefix="dcp-ranks-") as tmp:
        out = Path(tmp)
        procs = [_start(r, len(dirs), Path(d), mode, step, seed, train_steps, out, env)
                 for r, d in enumerate(dirs)]
        why = _wait_all(procs, timeout)
        if why:
            raise RuntimeError(f"{mode} of step_{step} with {len(dirs)} ranks: {why}\n" + "\n".join(
                f"--- rank {r} (exit {p.returncode}) ---\n{_tail(out / f'{r}.err')}"
                for r, p in enumerate(procs) if p.returncode))
        return [json.loads((out / f"{r}.json").read_text()) for r in range(len(dirs))]


def _start(rank: int, world: int, d: Path, mode: str, step: int, seed: int, train_steps: int,
           out: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start one worker; its stderr goes to ``out/<rank>.err``, its result to
    ``out/<rank>.json``."""
    argv = [sys.executable, "-m", "tests.support.dcp_ranks", "--rank", str(rank),
            "--world", str(world), "--dir", str(d), "--mode", mode, "--step", str(step),
            "--seed", str(seed), "--train-steps", str(train_steps),
            "--result", str(out / f"{rank}.json")]
    with open(out / f"{rank}.err", "wb") as err:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)


if __name__ == "__main__":
    # The work is done and the result written: leave without the interpreter's teardown,
    # where torch 2.13 now and then (one rank in 2 of about 60 runs here, on a busy 2-core
    # machine) aborts after destroy_process_group with "terminate called without an active
    # exception": a C++ std::thread destroyed while still joinable.
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
