"""Real multi-process JAX + Orbax: a regular multi-host CheckpointManager save and restore.

One OS process per JAX process, all on this machine's CPU (``JAX_PLATFORMS=cpu``, two CPU
devices each), joined by ``jax.distributed.initialize`` on a loopback coordinator. Together
they hold a small pytree of arrays sharded (``NamedSharding``) over the global mesh of every
process's devices, with values that depend only on ``seed`` and the step.

Each process gets ITS OWN checkpoint directory. Orbax assumes they are one shared
directory: process 0 creates ``<step>.orbax-checkpoint-tmp*``, every process writes its
``ocdbt.process_<i>`` part into it, and process 0 alone renames the step directory to
``<step>`` (the commit). Two nodes' mounts of one ``scope=job`` namespace must behave so.

Launcher (from a test)::

    from support.orbax_ranks import run_processes
    run_processes([node0 / "ckpt", node1 / "ckpt"], "save")           # steps 1..3
    rows = run_processes([node1 / "ckpt", node0 / "ckpt"], "restore")
    assert all(r["ok"] and r["step"] == 3 for r in rows)

Worker (one per process, from the repository root)::

    python -m tests.support.orbax_ranks --mode save --dir D --process-id 0 \\
        --num-processes 2 --coordinator 127.0.0.1:PORT --result R.json

``restore`` restores the latest step onto the same shardings and compares every addressable
shard with the expected values byte for byte; the result JSON (``--result``) carries the
step, per-array digests, the number of shards and elements compared, and ``ok``.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
LOCAL_DEVICES = 2
SEED = 1234

# name -> (shape, dtype name, PartitionSpec axes over the mesh ("proc", "local"))
ARRAYS: dict[str, tuple[tuple[int, ...], str, tuple[Any, ...]]] = {
    "params/w": ((64, 32), "float32", ("proc", "local")),
    "params/emb": ((128, 16), "bfloat16", (("proc", "local"), None)),
    "params/bias": ((32,), "float32", ("local",)),
    "opt/mu": ((48, 8), "int32", ("proc", None)),
    "opt/count": ((), "int32", ()),
}


# -- launcher ---------------------------------------------------------------------------------

def worker_env() -> dict[str, str]:
    """The environment of a worker: CPU-only JAX with LOCAL_DEVICES devices, quiet logs."""
    env = dict(os.environ)
    env.update({
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={LOCAL_DEVICES}",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    })
    return env


def _free_port() -> int:
    from .cluster import free_ports
    return free_ports(1)[0]


def _tail(path: Path, n: int = 6000) -> str:
    """The last ``n`` characters of a log file ("" when it is missing)."""
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def die_with_parent() -> None:
    """Be SIGKILLed when the thread that launched this worker ends (Linux
    ``prctl(PR_SET_PDEATHSIG)``): a launcher interrupted while it started a worker (Ctrl-C
    in a demo) never got its Popen to kill, and the worker, in a session of its own, lived
    on waiting for its JAX peers."""
    import ctypes
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the launcher ended before the call above
        os._exit(1)


def _kill(procs: list[subprocess.Popen]) -> None:
    """Make every worker still running dump its threads' stacks (SIGUSR1, see :func:`main`),
    then SIGKILL its process group and reap it."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        try:
            p.send_signal(signal.SIGUSR1)
        except ProcessLookupError:
            pass
    if alive:
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> str | None:
    """Wait for every worker; stop early when one fails. Returns why it failed, or None."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):
            return "a process failed: exit codes " + str(codes)
        if all(c == 0 for c in codes):
            return None
        if time.monotonic() > deadline:
            return f"timed out after {timeout:.0f}s: exit codes {codes}"
        time.sleep(0.05)


def run_processes(dirs: list[Path], mode: str, *, steps: int = 3, seed: int = SEED,
                  flip: bool = False, timeout: float = 300.0) -> list[dict]:
    """Run ``len(dirs)`` JAX processes at once, process ``i`` on ``dirs[i]``; ``mode`` is
    ``"save"`` (steps 1..steps) or ``"restore"`` (the latest step, checked bit-exact;
    ``flip``: onto the process-reversed mesh, so each reads what another process saved).

    Returns:
        the result dict of every process, in process order.

    Raises:
        RuntimeError: when a process fails or the run passes ``timeout``; with every
            process's stderr tail. The others are killed at once.
    """
    if mode not in ("save", "restore"):
        raise ValueError(f"mode must be save or restore, got {mode!r}")
    coordinator = f"127.0.0.1:{_free_port()}"
    with tempfile.TemporaryDirectory(prefix="orbax-ranks-") as tmp:
        out = Path(tmp)
        extra = ["--steps", str(steps), "--seed", str(seed)] + (["--flip"] if flip else [])
        procs = [_start(i, d, mode, len(dirs), coordinator, extra, out)
                 for i, d in enumerate(dirs)]
        try:
            failed = _wait_all(procs, timeout)
        finally:
            _kill(procs)
        if failed:
            logs = "\n".join(f"--- process {i} (dir {d}) stderr ---\n{_tail(out / f'{i}.err')}"
                             for i, d in enumerate(dirs))
            raise RuntimeError(f"orbax {mode}: {failed}\n{logs}")
        return [json.loads((out / f"{i}.json").read_text()) for i in range(len(dirs))]


def _start(i: int, d: Path, mode: str, n: int, coordinator: str, extra: list[str],
           out: Path) -> subprocess.Popen:
    """Start worker ``i`` (its own process group), stdout+stderr to ``out/<i>.err``."""
    argv = [sys.executable, "-m", "tests.support.orbax_ranks", "--mode", mode, "--dir", str(d),
            "--process-id", str(i), "--num-processes", str(n), "--coordinator", coordinator,
            "--result", str(out / f"{i}.json"), *extra]
    with open(out / f"{i}.err", "wb") as err:
        return subprocess.Popen(argv, cwd=REPO, env=worker_env(), stdin=subprocess.DEVNULL,
                                stdout=err, stderr=subprocess.STDOUT, start_new_session=True)


# -- worker -----------------------------------------------------------------------------------

def expected(name: str, step: int, seed: int):
    """The global value of array ``name`` at ``step``: numpy, deterministic."""
    import ml_dtypes
    import numpy as np

    shape, dtype, _ = ARRAYS[name]
    key = int.from_bytes(hashlib.sha256(f"{seed}/{step}/{name}".encode()).digest()[:8], "little")
    rng = np.random.default_rng(key)
    if dtype == "int32":
        return rng.integers(-2**31, 2**31 - 1, size=shape, dtype=np.int32)
    values = rng.standard_normal(size=shape, dtype=np.float32)
    return values.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else values


def _mesh(flip: bool = False):
    """The global mesh: one row per process, its LOCAL_DEVICES devices along ``local``.

    ``flip`` reverses the rows: process ``i`` then holds the part of every process-sharded
    array that process ``N-1-i`` saved, so a restore reads the other processes' files.
    """
    import jax
    import numpy as np

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    grid = np.array(devices).reshape(jax.process_count(), LOCAL_DEVICES)
    return jax.sharding.Mesh(grid[::-1] if flip else grid, ("proc", "local"))


def _sharding(mesh, name: str):
    import jax

    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*ARRAYS[name][2]))


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a/b": x}`` -> ``{"a": {"b": x}}``."""
    tree: dict[str, Any] = {}
    for path, leaf in flat.items():
        *parents, last = path.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = leaf
    return tree


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Inverse of :func:`_nest`."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def build_state(mesh, step: int, seed: int) -> dict[str, Any]:
    """The pytree of global jax.Arrays at ``step``; each process fills its own shards."""
    import jax

    def one(name: str):
        value = expected(name, step, seed)
        return jax.make_array_from_callback(value.shape, _sharding(mesh, name),
                                            lambda index: value[index])

    return _nest({name: one(name) for name in ARRAYS})


def abstract_state(mesh) -> dict[str, Any]:
    """The restore target: shapes, dtypes and the save's shardings, no values."""
    import jax
    import numpy as np

    def one(name: str):
        shape, dtype, _ = ARRAYS[name]
        return jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=_sharding(mesh, name))

    return _nest({name: one(name) for name in ARRAYS})


def check_array(name: str, array, step: int, seed: int) -> dict[str, Any]:
    """Compare every addressable shard of ``array`` with the expected values byte for byte.

    Returns:
        ``{"ok", "dtype", "shape", "shards", "elements", "expected_sha256", "shards_sha256"}``:
        the digest of the whole expected array and of this process's shards (index order).
    """
    import numpy as np

    want = expected(name, step, seed)
    h = hashlib.sha256()
    ok = array.dtype == want.dtype and array.shape == want.shape
    shards = sorted(array.addressable_shards, key=lambda s: tuple(i.start or 0 for i in s.index))
    elements = 0
    for s in shards:
        got = np.asarray(s.data)
        h.update(got.tobytes())
        elements += got.size
        ok = ok and got.dtype == want.dtype and got.tobytes() == want[s.index].tobytes()
    return {"ok": bool(ok), "dtype": str(array.dtype), "shape": list(array.shape),
            "shards": len(shards), "elements": elements,
            "expected_sha256": hashlib.sha256(want.tobytes()).hexdigest(),
            "shards_sha256": h.hexdigest()}


def _manager(directory: str):
    import orbax.checkpoint as ocp

    opts = ocp.CheckpointManagerOptions(max_to_keep=2)
    return ocp.CheckpointManager(directory, options=opts)


def do_save(directory: str, steps: int, seed: int) -> dict[str, Any]:
    """Save steps 1..``steps`` (async, the default) and wait for the last commit."""
    import orbax.checkpoint as ocp

    mesh = _mesh()
    with _manager(directory) as mgr:
        for step in range(1, steps + 1):
            mgr.save(step, args=ocp.args.StandardSave(build_state(mesh, step, seed)))
        mgr.wait_until_finished()
        return {"all_steps": list(mgr.all_steps()), "latest_step": mgr.latest_step()}


def do_restore(directory: str, seed: int, flip: bool = False) -> dict[str, Any]:
    """Restore the latest step onto the save's shardings (``flip``: onto the process-reversed
    mesh, see :func:`_mesh`) and check every array."""
    import orbax.checkpoint as ocp

    mesh = _mesh(flip)
    with _manager(directory) as mgr:
        step = mgr.latest_step()
        if step is None:
            raise RuntimeError(f"no checkpoint in {directory}: {os.listdir(directory)}")
        tree = mgr.restore(step, args=ocp.args.StandardRestore(abstract_state(mesh)))
        arrays = {name: check_array(name, a, step, seed) for name, a in _flat(tree).items()}
        return {"step": step, "all_steps": list(mgr.all_steps()), "arrays": arrays, "flip": flip,
                "ok": set(arrays) == set(ARRAYS) and all(a["ok"] for a in arrays.values())}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("save", "restore"), required=True)
    p.add_argument("--dir", required=True, help="this process's checkpoint directory")
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--coordinator", required=True, help="host:port of process 0's service")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--flip", action="store_true", help="restore: process-reversed mesh")
    p.add_argument("--result", required=True, help="JSON result file (not in --dir)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Join the JAX cluster, save or restore, write the result JSON, leave the cluster."""
    die_with_parent()
    args = _parse(argv)
    for k, v in worker_env().items():
        os.environ.setdefault(k, v)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    t0 = time.monotonic()
    import jax
    import orbax.checkpoint  # noqa: F401  (import time is part of "import_s")

    t1 = time.monotonic()
    jax.distributed.initialize(coordinator_address=args.coordinator,
                               num_processes=args.num_processes, process_id=args.process_id)
    t2 = time.monotonic()
    if args.mode == "save":
        result = do_save(args.dir, args.steps, args.seed)
    else:
        result = do_restore(args.dir, args.seed, args.flip)
    t3 = time.monotonic()
    result.update({"mode": args.mode, "process_id": jax.process_index(), "dir": args.dir,
                   "process_count": jax.process_count(), "devices": jax.device_count(),
                   "import_s": round(t1 - t0, 3), "init_s": round(t2 - t1, 3),
                   "work_s": round(t3 - t2, 3)})
    text = json.dumps(result, indent=1)
    Path(args.result).write_text(text)
    print(text, flush=True)
    jax.distributed.shutdown()
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
