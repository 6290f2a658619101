"""A real trainer on Orbax's multi-tier checkpointing (MTC): one OS process per JAX process.

Each process is one "node" of a job: it has its own local checkpoint directory (the node's
RAM tier; for the real thing an mtcfs mount in ``mtc`` mode) watched by that node's
*replicator*. The trainer talks to the replicator only through files in that directory,
exactly as MaxText does with ``enable_multi_tier_checkpointing=True``:

1. ``initialize_multi_tier_checkpointing`` waits (1 s polls) for ``jax-init-info.txt``
   written by the replicator (``"<process id>\\n<coordinator host:port>\\n"``), runs
   ``jax.distributed.initialize`` with that process id and address, writes
   ``replicator.yaml`` (see :func:`expected_yaml`), waits for the replicator to delete it
   (its acknowledgement), fails on a non-empty ``replicator.failed``, then waits up to 300 s
   for a ``<job>-s<step>-n<rank>-w<worker>.restore`` marker, which it renames to
   ``<step>`` (or, for an empty regular file with ``s0``, just deletes);
2. a ``ReplicatorCheckpointManager`` on the local directory saves a small sharded pytree at
   each step of ``--save-steps`` (each process writes only its own shards, into its own
   directory, committed by Orbax's ``<step>.orbax-checkpoint-tmp*`` -> ``<step>`` rename),
   and with ``--restore`` first restores the latest step it lists and compares every
   addressable shard byte for byte with the values expected at that step.

The coordinator address is the REPLICATOR's choice (it writes it into jax-init-info.txt):
whoever starts the replicators must make them write ``127.0.0.1:<port>`` with a port that
is free on this machine (see :func:`free_port`); process 0 binds it.

Array values depend only on ``--seed``, the step and the array's name, never on the process:
with ``--layout dp`` (the default, what MTC assumes) the mesh is ``slice x proc x local``
and every array is replicated over ``slice``, so the processes at the same position of
every slice (Orbax's peer ranks) hold identical data, as data-parallel replicas do;
``--layout distinct`` shards over every process so each node's data is its own (the yaml
then says ``assume-data-parallelism: 1``).

CPU-only shims (they live here, never in mtcfs): ``JAX_PLATFORMS=cpu``,
``XLA_FLAGS=--xla_force_host_platform_device_count=2``; a tiny ``jax._src.clusters.ClusterEnv``
subclass, active when ``MTC_NUM_PROCESSES`` is set, supplying the process count (Orbax calls
``jax.distributed.initialize`` without ``num_processes``; on GKE a cluster environment
supplies it); ``absl.flags.FLAGS(sys.argv[:1])`` (Orbax's restore reads an absl flag); and
``num_slices`` passed explicitly (CPU devices all report slice 0).

Launcher (from a test; the replicators must already be running or start in parallel)::

    from support.mtc_trainer import free_port, run_trainers
    port = free_port()            # the replicators write 127.0.0.1:<port>
    rows = run_trainers([n0 / "mnt", n1 / "mnt"], tmp / "persistent", num_slices=2,
                        save_steps=[1, 2, 3], coordinator_port=port)
    rows = run_trainers(..., restore=True, save_steps=[4])
    assert all(r["ok"] and r["step"] == 3 for r in rows)

Worker (one per process, from the repository root)::

    python -m tests.support.mtc_trainer --local-dir D --persistent-dir P --process-id 0 \\
        --num-processes 2 --num-slices 2 --save-steps 1,2,3 [--restore] \\
        [--backup-interval-steps K | --backup-interval-minutes M] --result R.json

``--process-id`` is this process's expected id: the id JAX gets is the one the replicator
wrote into jax-init-info.txt (the result JSON has both). The result JSON carries
``process_id``, ``step`` (restored, or null), ``latest_step``/``all_steps`` as Orbax lists
them at the end, per-array digests of the addressable shards (``arrays``), ``ok``, and
``error`` (``"Type: message"``) when an exception was raised; the exit status is 0 only when
``ok``. SIGUSR1 dumps every thread's stack into the log (the launcher does this before it
kills a process that hangs).
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
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .orbax_ranks import (  # shared with the plain multi-host worker
    _flat, _kill, _nest, _tail, die_with_parent,
)

REPO = Path(__file__).resolve().parents[2]
LOCAL_DEVICES = 2
SEED = 1234
DEFAULT_MIB = 0.25
DEFAULT_RUN_NAME = "mtcjob"
#: The environment variable that activates the ClusterEnv shim (the process count).
NUM_PROCESSES_ENV = "MTC_NUM_PROCESSES"

# name -> (shape, dtype name, PartitionSpec with "P" standing for the process axes).
# "params/w"'s first dimension is set by --mib (see array_specs).
_BASE_ARRAYS: dict[str, tuple[tuple[int, ...], str, tuple[Any, ...]]] = {
    "params/w": ((0, 256), "float32", ("P", "local")),
    "params/emb": ((128, 16), "bfloat16", (("P", "local"), None)),
    "params/bias": ((32,), "float32", ("local",)),
    "opt/mu": ((48, 8), "int32", ("P", None)),
    "opt/count": ((), "int32", ()),
}


# -- launcher ---------------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago: the replicators must write
    ``127.0.0.1:<port>`` as the coordinator address into ``jax-init-info.txt``."""
    from .cluster import free_ports
    return free_ports(1)[0]


def worker_env(num_processes: int) -> dict[str, str]:
    """The environment of a trainer: CPU-only JAX with LOCAL_DEVICES devices, the ClusterEnv
    shim on (``MTC_NUM_PROCESSES``), quiet logs, the repository importable."""
    env = dict(os.environ)
    env.update({
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={LOCAL_DEVICES}",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        NUM_PROCESSES_ENV: str(num_processes),
        "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    })
    return env


def _wait_all(procs: list[subprocess.Popen], timeout: float, grace: float) -> str | None:
    """Wait for every trainer. Once one fails, wait ``grace`` seconds more for the others
    (they usually fail too, or hang in a barrier). Returns why it stopped early, or None."""
    deadline = time.monotonic() + timeout
    failed_at = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return None if all(c == 0 for c in codes) else f"exit codes {codes}"
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() > failed_at + grace:
            return f"a trainer failed; the others still ran {grace:.0f}s later: exit codes {codes}"
        if time.monotonic() > deadline:
            return f"timed out after {timeout:.0f}s: exit codes {codes}"
        time.sleep(0.05)


def run_trainers(local_dirs: Sequence[os.PathLike | str],
                 persistent_dir: os.PathLike | str | None = None, *,
                 num_slices: int,
                 save_steps: Sequence[int] = (),
                 restore: bool = False,
                 backup_interval_steps: int | None = None,
                 backup_interval_minutes: int | None = None,
                 coordinator_port: int | None = None,
                 run_name: str = DEFAULT_RUN_NAME,
                 layout: str = "dp",
                 mib: float = DEFAULT_MIB,
                 seed: int = SEED,
                 expect_step: int | None | str = "any",
                 init_timeout: int = 120,
                 timeout: float = 180.0,
                 grace: float = 15.0,
                 check: bool = True,
                 workdir: os.PathLike | str | None = None,
                 extra_args: Sequence[str] = ()) -> list[dict]:
    """Run ``len(local_dirs)`` trainers at once, trainer ``i`` on ``local_dirs[i]``.

    Each runs ``initialize_multi_tier_checkpointing`` (so a replicator must serve every
    local directory: write jax-init-info.txt, consume replicator.yaml, place the
    ``.restore`` marker), then restores the latest step (``restore``) and saves
    ``save_steps``.

    Args:
        local_dirs: the local checkpoint directory of each process, in process order.
        persistent_dir: passed to ``ReplicatorCheckpointManager(persistent_directory=...)``
            (shared; only non-replicated items would go there, this trainer saves none).
        num_slices: passed to ``initialize_multi_tier_checkpointing``; must divide the
            process count. Peers are the processes at the same position in other slices.
        backup_interval_steps / backup_interval_minutes: at most one; what the yaml says
            (Orbax's default: 30 minutes).
        coordinator_port: the port the replicators write into jax-init-info.txt
            (``127.0.0.1:<port>``). Only recorded and checked: every result's
            ``coordinator`` must be ``127.0.0.1:<port>``. None: not checked.
        layout: ``"dp"`` (replicated over slices; yaml assume-data-parallelism=num_slices)
            or ``"distinct"`` (every process its own data; assume-data-parallelism=1).
        expect_step: with ``restore``, the step every process must restore (None: nothing
            to restore); ``"any"``: not checked.
        init_timeout: ``jax_initialization_timeout_seconds`` (the yaml acknowledgement
            wait); the jax-init-info wait (900 s) and the restore-marker wait (300 s) are
            fixed in Orbax, ``timeout`` bounds them.
        timeout: for the whole run; then every trainer is killed.
        grace: once a trainer failed, how long the others may still run.
        check: raise when a trainer fails; False: return every result anyway (a trainer
            that wrote none gets ``{"process_id": i, "ok": False, "error": ..., "log": tail}``).
        workdir: where results and logs go (``<i>.json``, ``<i>.log``), kept; default a
            temporary directory, removed.
        extra_args: more worker arguments (e.g. ``["--num-processes", "3"]`` to override).

    Returns:
        the result dict of every trainer, in process order; each has ``"log_path"`` when
        ``workdir`` is given.

    Raises:
        RuntimeError: ``check`` and a trainer failed, or the run passed ``timeout``, or
            a trainer's coordinator differs from ``coordinator_port``; with log tails.
    """
    n = len(local_dirs)
    if backup_interval_steps is not None and backup_interval_minutes is not None:
        raise ValueError("give at most one of backup_interval_steps, backup_interval_minutes")
    argv_common = ["--num-processes", str(n), "--num-slices", str(num_slices),
                   "--run-name", run_name, "--layout", layout, "--mib", str(mib),
                   "--seed", str(seed), "--init-timeout", str(init_timeout)]
    if persistent_dir is not None:
        argv_common += ["--persistent-dir", str(persistent_dir)]
    if save_steps:
        argv_common += ["--save-steps", ",".join(str(s) for s in save_steps)]
    if restore:
        argv_common.append("--restore")
        if expect_step != "any":
            argv_common += ["--expect-step", "none" if expect_step is None else str(expect_step)]
    if backup_interval_steps is not None:
        argv_common += ["--backup-interval-steps", str(backup_interval_steps)]
    if backup_interval_minutes is not None:
        argv_common += ["--backup-interval-minutes", str(backup_interval_minutes)]
    if coordinator_port is not None:
        argv_common += ["--expect-coordinator", f"127.0.0.1:{coordinator_port}"]
    argv_common += list(extra_args)

    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="mtc-trainer-")
        out = Path(tmp.name)
    else:
        out = Path(workdir)
        out.mkdir(parents=True, exist_ok=True)
    try:
        for i in range(n):
            (out / f"{i}.json").unlink(missing_ok=True)
        procs = []
        try:
            for i, d in enumerate(local_dirs):
                argv = [sys.executable, "-m", "tests.support.mtc_trainer",
                        "--local-dir", str(d), "--process-id", str(i),
                        "--result", str(out / f"{i}.json"), *argv_common]
                with open(out / f"{i}.log", "wb") as log:
                    procs.append(subprocess.Popen(
                        argv, cwd=REPO, env=worker_env(n), stdin=subprocess.DEVNULL,
                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            failed = _wait_all(procs, timeout, grace)
        finally:
            _kill(procs)
        rows = []
        for i in range(n):
            try:
                row = json.loads((out / f"{i}.json").read_text())
            except (OSError, ValueError):
                row = {"process_id": i, "ok": False, "step": None,
                       "error": f"no result (exit code {procs[i].returncode})"}
            if not row.get("ok"):
                row["log"] = _tail(out / f"{i}.log")
            if workdir is not None:
                row["log_path"] = str(out / f"{i}.log")
            rows.append(row)
        if check:
            bad = [r for r in rows if not r.get("ok")]
            if failed or bad:
                logs = "\n".join(f"--- trainer {i} (dir {d}): {rows[i].get('error')} ---\n"
                                 f"{_tail(out / f'{i}.log')}" for i, d in enumerate(local_dirs))
                raise RuntimeError(f"MTC trainers: {failed or 'not ok'}\n{logs}")
        return rows
    finally:
        if tmp is not None:
            tmp.cleanup()


# -- the data ---------------------------------------------------------------------------------

def array_specs(mib: float = DEFAULT_MIB, layout: str = "dp"):
    """name -> (shape, dtype, PartitionSpec axes) over the mesh ("slice", "proc", "local").

    ``params/w`` has ``mib`` MiB (rounded up to 64 rows of 1 KiB); the others are tiny.
    ``layout="dp"``: the process axis is ``proc`` (replicated over ``slice``);
    ``"distinct"``: ``("slice", "proc")``.
    """
    if layout not in ("dp", "distinct"):
        raise ValueError(f"layout must be dp or distinct, got {layout!r}")
    proc = "proc" if layout == "dp" else ("slice", "proc")
    rows = max(64, -(-int(mib * 1024) // 64) * 64)

    def one(a: Any) -> Any:
        return proc if a == "P" else a

    def axes(spec: tuple[Any, ...]) -> tuple[Any, ...]:
        out = []
        for a in spec:
            if isinstance(a, tuple):  # several mesh axes on one dimension: flatten "P" in
                flat: list[str] = []
                for b in map(one, a):
                    flat.extend(b if isinstance(b, tuple) else (b,))
                out.append(tuple(flat))
            else:
                out.append(one(a))
        return tuple(out)

    specs = {}
    for name, (shape, dtype, spec) in _BASE_ARRAYS.items():
        if name == "params/w":
            shape = (rows, shape[1])
        specs[name] = (shape, dtype, axes(spec))
    return specs


def expected(name: str, shape: tuple[int, ...], dtype: str, step: int, seed: int):
    """The global value of array ``name`` at ``step``: numpy, deterministic, the same on
    every process."""
    import ml_dtypes
    import numpy as np

    key = int.from_bytes(hashlib.sha256(f"{seed}/{step}/{name}".encode()).digest()[:8], "little")
    rng = np.random.default_rng(key)
    if dtype == "int32":
        return rng.integers(-2**31, 2**31 - 1, size=shape, dtype=np.int32)
    values = rng.standard_normal(size=shape, dtype=np.float32)
    return values.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else values


def global_mesh(num_slices: int):
    """The mesh ("slice", "proc", "local"): process ``p`` is in slice ``p // nodes_per_slice``
    at position ``p % nodes_per_slice`` (Orbax's peer ranks are the same position in the
    other slices)."""
    import jax
    import numpy as np

    n = jax.process_count()
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    grid = np.array(devices).reshape(num_slices, n // num_slices, len(devices) // n)
    return jax.sharding.Mesh(grid, ("slice", "proc", "local"))


def build_state(mesh, specs, step: int, seed: int) -> dict[str, Any]:
    """The pytree of global jax.Arrays at ``step``; each process fills its own shards."""
    import jax

    def one(name: str):
        shape, dtype, axes = specs[name]
        value = expected(name, shape, dtype, step, seed)
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*axes))
        return jax.make_array_from_callback(shape, sharding, lambda index: value[index])

    return _nest({name: one(name) for name in specs})


def abstract_state(mesh, specs) -> dict[str, Any]:
    """The restore target: shapes, dtypes and the save's shardings, no values."""
    import jax
    import numpy as np

    def one(name: str):
        shape, dtype, axes = specs[name]
        import ml_dtypes  # noqa: F401 (np.dtype("bfloat16") needs it registered)
        return jax.ShapeDtypeStruct(
            shape, np.dtype(dtype),
            sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*axes)))

    return _nest({name: one(name) for name in specs})


def check_array(name: str, array, specs, step: int, seed: int) -> dict[str, Any]:
    """Compare every addressable shard of ``array`` with the expected values byte for byte.

    Returns:
        ``{"ok", "dtype", "shape", "shards", "elements", "expected_sha256", "shards_sha256"}``:
        the digest of the whole expected array and of this process's shards (index order).
    """
    import numpy as np

    shape, dtype, _ = specs[name]
    want = expected(name, shape, dtype, step, seed)
    h = hashlib.sha256()
    ok = array.dtype == want.dtype and tuple(array.shape) == want.shape
    shards = sorted(array.addressable_shards,
                    key=lambda s: (tuple(i.start or 0 for i in s.index), s.device.id))
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


def orbax_peer_ranks(process_index: int, num_processes: int, num_slices: int) -> list[int]:
    """The peer ranks Orbax writes into replicator.yaml (node rank = process index here):
    the processes at the same position in every other slice."""
    per = num_processes // num_slices
    return [i * per + process_index % per for i in range(num_slices)
            if i * per + process_index % per != process_index]


def expected_yaml(process_index: int, num_processes: int, num_slices: int, *,
                  run_name: str = DEFAULT_RUN_NAME, data_parallelism: int | None = None,
                  backup_interval_steps: int | None = None,
                  backup_interval_minutes: int | None = None) -> str:
    """The replicator.yaml Orbax 0.12.8 writes (byte for byte, no trailing newline)."""
    if backup_interval_steps is None and backup_interval_minutes is None:
        backup_interval_minutes = 30
    interval = (f"backup-interval-minutes: {backup_interval_minutes}"
                if backup_interval_minutes is not None
                else f"backup-interval-steps: {backup_interval_steps}")
    return "\n".join([
        f"job-name: {run_name}", "framework: orbax",
        f"assume-data-parallelism: {data_parallelism or num_slices}",
        f"node-rank: {process_index}", f"nodes: {num_processes}",
        f"peer-ranks: {orbax_peer_ranks(process_index, num_processes, num_slices)}",
        interval])


# -- worker -----------------------------------------------------------------------------------

def _install_cluster_env() -> None:
    """The CPU shim for ``jax.distributed.initialize``: a ClusterEnv present when
    ``MTC_NUM_PROCESSES`` is set, supplying the process count only (the coordinator address
    and process id come from jax-init-info.txt through Orbax). Put first in JAX's list so
    no other detected environment (Slurm, k8s, ...) answers instead."""
    from jax._src import clusters

    class MtcLocalCluster(clusters.ClusterEnv):
        name = "mtc_local"

        @classmethod
        def is_env_present(cls) -> bool:
            return NUM_PROCESSES_ENV in os.environ

        @classmethod
        def get_coordinator_address(cls, timeout_secs, override_coordinator_port) -> str:
            raise RuntimeError("mtc_local: the coordinator address comes from "
                               "jax-init-info.txt, written by the replicator")

        @classmethod
        def get_process_count(cls) -> int:
            return int(os.environ[NUM_PROCESSES_ENV])

        @classmethod
        def get_process_id(cls) -> int:
            raise RuntimeError("mtc_local: the process id comes from jax-init-info.txt, "
                               "written by the replicator")

        @classmethod
        def get_local_process_id(cls) -> int | None:
            return None

    types = clusters.ClusterEnv._cluster_types
    types.remove(MtcLocalCluster)
    types.insert(0, MtcLocalCluster)


def _replicator_errors(local_dir: Path, result: dict[str, Any]) -> None:
    """What MaxText does before every save: log-and-delete ``replicator.errors``, fail on
    ``replicator.failed``."""
    errors = local_dir / "replicator.errors"
    if errors.exists():
        result.setdefault("replicator_errors", []).append(errors.read_text(errors="replace"))
        errors.unlink(missing_ok=True)
    failed = local_dir / "replicator.failed"
    if failed.exists():
        text = failed.read_text(errors="replace")
        failed.unlink(missing_ok=True)
        if text:
            raise RuntimeError(f"Replicator fatal errors: {text}")


def _listing(d: Path) -> list[str]:
    try:
        return sorted(os.listdir(d))
    except OSError as exc:
        return [f"<{exc}>"]


def _parse_steps(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local-dir", required=True, help="this node's local checkpoint directory")
    p.add_argument("--persistent-dir", help="ReplicatorCheckpointManager persistent_directory")
    p.add_argument("--process-id", type=int, required=True,
                   help="the id this process expects (JAX uses jax-init-info.txt's)")
    p.add_argument("--num-processes", type=int, required=True,
                   help="the process count (the ClusterEnv shim's answer)")
    p.add_argument("--num-slices", type=int, required=True)
    p.add_argument("--data-parallelism", type=int, default=None,
                   help="yaml assume-data-parallelism (default: num_slices for --layout dp, "
                        "1 for distinct)")
    p.add_argument("--save-steps", type=_parse_steps, default=[], help="e.g. 1,2,3")
    p.add_argument("--restore", action="store_true", help="restore the latest step first")
    p.add_argument("--expect-step", default=None,
                   help="with --restore: the step that must be restored ('none': nothing)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--backup-interval-steps", type=int)
    g.add_argument("--backup-interval-minutes", type=int)
    p.add_argument("--run-name", default=DEFAULT_RUN_NAME, help="yaml job-name")
    p.add_argument("--layout", choices=("dp", "distinct"), default="dp")
    p.add_argument("--mib", type=float, default=DEFAULT_MIB, help="size of params/w")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--init-timeout", type=int, default=120,
                   help="jax_initialization_timeout_seconds (the yaml ack wait)")
    p.add_argument("--expect-coordinator", default=None,
                   help="host:port jax-init-info.txt must name (checked after init)")
    p.add_argument("--result", required=True, help="JSON result file (not in --local-dir)")
    return p.parse_args(argv)


def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Initialize MTC, restore and/or save; fills ``result`` as it goes."""
    t0 = time.monotonic()
    _install_cluster_env()
    import jax
    import orbax.checkpoint as ocp
    from absl import flags
    from absl import logging as absl_logging
    from orbax.checkpoint import checkpoint_utils
    from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import (
        initialization as mtc_init,
    )
    from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import (
        replicator_checkpoint_manager as rcm,
    )

    flags.FLAGS(sys.argv[:1])           # Orbax's restore reads an absl flag
    absl_logging.set_verbosity(absl_logging.INFO)
    local = Path(args.local_dir)
    result["import_s"] = round(time.monotonic() - t0, 3)
    dp = args.data_parallelism or (args.num_slices if args.layout == "dp" else 1)

    t1 = time.monotonic()
    mtc_init.initialize_multi_tier_checkpointing(
        local, backup_interval_minutes=args.backup_interval_minutes,
        backup_interval_steps=args.backup_interval_steps, num_slices=args.num_slices,
        run_name=args.run_name, data_parallelism=dp,
        jax_initialization_timeout_seconds=args.init_timeout,
        jax_shutdown_timeout_seconds=15)
    result["init_s"] = round(time.monotonic() - t1, 3)
    result.update({"process_id": jax.process_index(), "process_count": jax.process_count(),
                   "devices": jax.device_count(), "data_parallelism": dp,
                   "peer_ranks": orbax_peer_ranks(jax.process_index(), jax.process_count(),
                                                  args.num_slices),
                   "listing_after_init": _listing(local)})
    try:
        init_info = (local / "jax-init-info.txt").read_text().split("\n")
        result["coordinator"] = init_info[1] if len(init_info) > 1 else None
    except OSError:
        result["coordinator"] = None
    if args.expect_coordinator and result["coordinator"] != args.expect_coordinator:
        raise RuntimeError(f"jax-init-info.txt names coordinator {result['coordinator']!r}, "
                           f"expected {args.expect_coordinator!r}")
    if jax.process_index() != args.process_id:
        raise RuntimeError(f"jax-init-info.txt made this process {jax.process_index()}, "
                           f"expected {args.process_id}")

    specs = array_specs(args.mib, args.layout)
    mesh = global_mesh(args.num_slices)
    options = rcm.ReplicatorCheckpointManagerOptions(save_interval_steps=1)
    mngr = rcm.ReplicatorCheckpointManager(
        local, options, global_mesh=mesh,
        persistent_directory=Path(args.persistent_dir) if args.persistent_dir else None)
    ok = True
    try:
        result["steps_at_start"] = list(mngr.all_steps())
        if args.restore:
            t2 = time.monotonic()
            step = mngr.latest_step()
            result["step"] = step
            if step is not None:
                target = abstract_state(mesh, specs)
                restored = mngr.restore(step, args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        item=target,
                        restore_args=checkpoint_utils.construct_restore_args(target))))
                arrays = {name: check_array(name, a, specs, step, args.seed)
                          for name, a in _flat(restored["state"]).items()}
                result["arrays"] = arrays
                ok = set(arrays) == set(specs) and all(a["ok"] for a in arrays.values())
            result["restore_s"] = round(time.monotonic() - t2, 3)
            if args.expect_step is not None:
                want = None if args.expect_step == "none" else int(args.expect_step)
                if step != want:
                    ok = False
                    result["error"] = (f"restored step {step}, expected {want} "
                                       f"(local dir: {_listing(local)})")
        t3 = time.monotonic()
        saved = {}
        for step in args.save_steps:
            _replicator_errors(local, result)
            saved[str(step)] = bool(mngr.save(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(build_state(mesh, specs, step, args.seed)))))
        mngr.wait_until_finished()
        result["saved"] = saved
        result["save_s"] = round(time.monotonic() - t3, 3)
        if args.save_steps and not all(saved.values()):
            ok = False
            result.setdefault("error", f"Orbax skipped a save: {saved}")
        result["all_steps"] = list(mngr.all_steps(read=True))
        result["latest_step"] = mngr.latest_step()
    finally:
        mngr.close()
    result["listing"] = _listing(local)
    result["ok"] = bool(ok)


def main(argv: list[str] | None = None) -> int:
    """Run one trainer; write the result JSON whatever happens; exit 0 only when ok."""
    die_with_parent()
    args = _parse(argv)
    for k, v in worker_env(args.num_processes).items():
        os.environ.setdefault(k, v)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    result: dict[str, Any] = {"process_id": args.process_id, "local_dir": args.local_dir,
                              "step": None, "latest_step": None, "all_steps": None,
                              "arrays": {}, "ok": False}
    t0 = time.monotonic()
    clean = False
    try:
        run(args, result)
        clean = True
    except BaseException as exc:  # noqa: BLE001 (recorded; the exit status says it failed)
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        result["traceback"] = traceback.format_exc()
        result["listing"] = _listing(Path(args.local_dir))
    result["total_s"] = round(time.monotonic() - t0, 3)
    text = json.dumps(result, indent=1)
    Path(args.result).write_text(text)
    print(text, flush=True)
    code = 0 if result["ok"] else 1
    if clean and result["ok"]:
        import jax
        try:
            jax.distributed.shutdown()
        except Exception as exc:  # noqa: BLE001 (the result is written; leave)
            print(f"jax.distributed.shutdown: {exc}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    # After a failure the others may never reach the shutdown barrier: leave at once,
    # without JAX's atexit shutdown (it would wait for them).
    os._exit(code)


if __name__ == "__main__":
    main()
