"""The named, bounded thread pools and trio thread limiters of a daemon, in one place.

Every thread mtcfs runs work on comes from one of these (or is a long-lived thread of its
own: membership keepalive and watch, lock renewals, stream pumps, the store's reaper;
docs/architecture.md, "Concurrency protocol" lists those). Each entry of :data:`POOLS` names a pool, its size and what it is for:

* **Executor pools** (``kind="executor"``) are :class:`concurrent.futures.ThreadPoolExecutor`\\ s
  for synchronous code that fans out (the backup tier's uploads, marker reads, deletes).
  One per process, created on first use (:func:`pool`), threads named ``mtcfs-<name>_N``,
  ended by :func:`shutdown`. A caller asks for a width (its own concurrency, e.g. a
  ``BackupStore``'s ``workers``) and never has more than that many items in flight; the
  pool's size bounds all callers together. An item that itself asks the same pool runs its
  items inline, so the pool cannot deadlock on itself.
* **Trio limiters** (``kind="limiter"``) bound ``trio.to_thread.run_sync`` calls. A
  :class:`trio.CapacityLimiter` belongs to the objects of one daemon (one trio run), so
  :func:`limiter` makes a new one of the named size for its owner (the filesystem core, a
  chunk source), created once per daemon.
* **Owned executors** (``kind="server"``): a pool handed to a server that owns it
  (:func:`new_executor`): the Peer gRPC server's, the chunk stream's.

A pool marked ``background`` runs only background work: each of its threads takes the
daemon's background CPU policy when it starts (base/background.py: ``bg_sched``,
``bg_nice``, ``bg_cpus``) and keeps it. Foreground work never goes to such a pool.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import trio

from mtcfs.base import background

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class PoolSpec:
    """One named pool.

    Attributes:
        name: the pool's name; threads are named ``mtcfs-<name>...``.
        size: threads (executor, server: the default) or tokens (limiter).
        kind: ``"executor"`` (shared, :func:`pool`), ``"limiter"`` (:func:`limiter`) or
            ``"server"`` (:func:`new_executor`).
        purpose: what runs there, one line.
        background: its threads run background work only, under the background CPU
            policy (executor and server pools).
    """

    name: str
    size: int
    kind: Literal["executor", "limiter", "server"]
    purpose: str
    background: bool = False


#: Every named pool. Sizes are the values the code had before they were gathered here.
POOLS: dict[str, PoolSpec] = {s.name: s for s in (
    PoolSpec("background", 16, "executor",
             "background work called from the trio loop (background.run_sync): the seal of "
             "a closed file in scope=node, a step's push to a peer, a step's upload to the "
             "backup tier, the scrub's hashing, the replica store's gc; each bounded by its "
             "caller's limiter", background=True),
    PoolSpec("backup-upload", 16, "executor",
             "a backup's fan-out: chunk uploads (zstd and the request) and the checks "
             "whether other nodes stored a chunk; each call at most its store's workers "
             "(backup_threads, MAX_WORKERS = 4) at once", background=True),
    PoolSpec("backup-io", 16, "executor",
             "backup tier reads and deletes: marker and manifest reads (a restore's too), "
             "retention's deletes; each call at most its store's workers at once"),
    PoolSpec("peer-list", 16, "executor",
             "a restoring rank's ListManifests calls to the ranks that may hold its "
             "replicas, asked at once (restore/from_peers.py list_holders); each call "
             "within the client's deadline"),
    PoolSpec("hash", 64, "executor",
             "the helper threads of one seal's hashing: hash_threads - 1 per seal, each "
             "hashing whole chunks into a buffer of its own (base/chunking.py run_workers; "
             "the seal's own thread holds a cpu token)", background=True),
    PoolSpec("hash-now", 64, "executor",
             "the same for a seal that a close(2) waits for (scope=job)"),
    PoolSpec("verify", 4, "limiter",
             "first-read verification: chunks hashed at once after a start (hash_threads "
             "tokens; Verifier.hash_limiter, core/verifier.py)"),
    PoolSpec("cpu", 2, "limiter",
             "the core's hashing (seal, first-read verification, scrub, mtcfs verify) and "
             "fault-in's chunk writes (Filesystem.cpu_limiter)"),
    PoolSpec("fetch", 8, "limiter",
             "fault-in fetches in flight in the core (FaultIn, core/fetcher.py); each ends "
             "within the fetch deadline"),
    PoolSpec("peer-calls", 8, "limiter",
             "chunk fetches from peers for fault-in, one chunk from one peer each, each one "
             "attempt of at most ATTEMPT_S (PeerChunkSource.limiter)"),
    PoolSpec("backup-fetch", 4, "limiter",
             "chunk downloads from the backup tier for fault-in and prefetch "
             "(BackupChunkSource.limiter)"),
    PoolSpec("peer-bulk", 4, "limiter",
             "bulk pushes to peers (replication of a step) in flight at once per node "
             "(PeerTier._bulk)"),
    PoolSpec("etcd", 16, "limiter",
             "scope=job namespace calls to etcd (submit, read barrier, install), each with a "
             "deadline (EtcdNamespaceLog.limiter, ETCD_THREADS)"),
    PoolSpec("chunk-stream", 16, "server",
             "the chunk stream server's connection threads (tiers/peer/chunk_stream.py), one "
             "per stream being sent; each send stalls at most IO_TIMEOUT_S; more streams "
             "wait for a thread"),
    PoolSpec("chunk-stream-put", 16, "server",
             "the chunk stream server's threads receiving a peer's pushes (replication to "
             "this node), one per stream; each receive stalls at most IO_TIMEOUT_S",
             background=True),
    PoolSpec("peer-server", 32, "server",
             "the Peer gRPC server's call threads (8 by default, 32 in the daemon); they "
             "reach the core only through trio.from_thread.run"),
)}

_lock = threading.Lock()
_executors: dict[str, ThreadPoolExecutor] = {}
_local = threading.local()


def _spec(name: str, kind: str) -> PoolSpec:
    spec = POOLS.get(name)
    if spec is None or spec.kind != kind:
        raise KeyError(f"no {kind} pool named {name!r}")
    return spec


def pool(name: str) -> ThreadPoolExecutor:
    """Return the process's executor pool ``name``, creating it on first use.

    Raises:
        KeyError: if ``name`` is not an executor pool of :data:`POOLS`.
    """
    spec = _spec(name, "executor")
    with _lock:
        ex = _executors.get(name)
        if ex is None:
            ex = _executors[name] = ThreadPoolExecutor(
                max_workers=spec.size, thread_name_prefix=f"mtcfs-{name}",
                initializer=_mark, initargs=(name,))
        return ex


def _mark(name: str) -> None:
    _local.pool = name
    if POOLS[name].background:
        background.enter()


def limiter(name: str, size: int | None = None) -> trio.CapacityLimiter:
    """Return a new :class:`trio.CapacityLimiter` for the named limiter (for one owner,
    once per daemon).

    Args:
        name: a ``"limiter"`` of :data:`POOLS`.
        size: tokens; default the spec's size (an owner's configured concurrency).

    Raises:
        KeyError: if ``name`` is not a limiter of :data:`POOLS`.
        ValueError: if ``size < 1``.
    """
    size = _spec(name, "limiter").size if size is None else size
    if size < 1:
        raise ValueError(f"limiter {name!r} needs at least one token, got {size}")
    return trio.CapacityLimiter(size)


def new_executor(name: str, size: int | None = None) -> ThreadPoolExecutor:
    """Return a new executor for a server that owns it (threads ``mtcfs-<name>_N``).

    Args:
        name: a ``"server"`` pool of :data:`POOLS`.
        size: threads; default the spec's size.

    Raises:
        KeyError: if ``name`` is not a server pool of :data:`POOLS`.
        ValueError: if ``size < 1``.
    """
    spec = _spec(name, "server")
    size = spec.size if size is None else size
    if size < 1:
        raise ValueError(f"pool {name!r} needs at least one thread, got {size}")
    return ThreadPoolExecutor(max_workers=size, thread_name_prefix=f"mtcfs-{name}",
                              initializer=background.enter if spec.background else None)


def run_unordered(name: str, fn: Callable[[T], R], items: Iterable[T], width: int
                  ) -> Iterator[tuple[T, R]]:
    """Run ``fn`` over ``items`` on the executor pool ``name``, at most ``width`` at once;
    yield ``(item, result)`` as each finishes.

    Inline (in the caller's thread, in order) when ``width <= 1``, when there is at most one
    item, or when the caller is itself a thread of that pool. The first exception is raised
    as soon as it is seen; items not started then are never started (closing the generator
    early does the same), and items already running are waited for first, so nothing of the
    call runs after it returned or raised (as with a ``with ThreadPoolExecutor`` block).

    Raises:
        KeyError: if ``name`` is not an executor pool.
        Exception: the first one ``fn`` raised.
    """
    todo = list(items)
    if width <= 1 or len(todo) <= 1 or getattr(_local, "pool", None) == name:
        for item in todo:
            yield item, fn(item)
        return
    ex = pool(name)
    it = iter(todo)
    running: dict[Future[R], T] = {}
    try:
        for item in it:
            running[ex.submit(fn, item)] = item
            if len(running) >= width:
                break
        while running:
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                item = running.pop(fut)
                yield item, fut.result()  # raises the worker's exception
            for item in it:
                running[ex.submit(fn, item)] = item
                if len(running) >= width:
                    break
    finally:
        left = [fut for fut in running if not fut.cancel()]
        if left:
            wait(left)


def run_map(name: str, fn: Callable[[T], R], items: Iterable[T], width: int) -> list[R]:
    """Like :func:`run_unordered`, returning the results in the order of ``items``."""
    todo = list(items)
    got: dict[int, R] = {}
    for i, r in run_unordered(name, lambda i: fn(todo[i]), range(len(todo)), width):
        got[i] = r
    return [got[i] for i in range(len(todo))]


async def run_background(fn: Callable[..., T], *args: Any,
                   limiter: trio.CapacityLimiter | None = None,
                   abandon_on_cancel: bool = False) -> T:
    """``trio.to_thread.run_sync`` on a background thread (the ``background`` pool of
    :data:`POOLS`) instead of one of trio's shared workers: the call runs under the
    daemon's background CPU policy (base/background.py).

    ``limiter``: a token held from before the call until ``fn`` returns in its thread
    (also when the caller was cancelled and abandoned it). ``abandon_on_cancel``: as in
    trio, a cancelled caller returns at once (raising :class:`trio.Cancelled`) and ``fn``
    runs to its end unobserved; without it the call cannot be cancelled.

    Raises:
        Exception: whatever ``fn`` raised.
    """
    token = trio.lowlevel.current_trio_token()
    borrower = object()
    if limiter is not None:
        await limiter.acquire_on_behalf_of(borrower)
    done = trio.Event()

    def finished(_f: object) -> None:
        def on_loop() -> None:
            if limiter is not None:
                limiter.release_on_behalf_of(borrower)
            done.set()
        try:
            token.run_sync_soon(on_loop)
        except trio.RunFinishedError:
            pass  # the daemon's loop ended first

    try:
        fut = pool("background").submit(fn, *args)
    except BaseException:
        if limiter is not None:
            limiter.release_on_behalf_of(borrower)
        raise
    fut.add_done_callback(finished)
    if abandon_on_cancel:
        await done.wait()
    else:
        with trio.CancelScope(shield=True):
            await done.wait()
    return fut.result()


def stats() -> dict[str, dict[str, int | str]]:
    """Return, per named pool: ``size``, ``kind``, and for a created executor pool
    ``threads`` (started so far)."""
    out: dict[str, dict[str, int | str]] = {}
    with _lock:
        for name, spec in POOLS.items():
            row: dict[str, int | str] = {"size": spec.size, "kind": spec.kind}
            ex = _executors.get(name)
            if ex is not None:
                row["threads"] = len(ex._threads)
            out[name] = row
    return out


def shutdown(block: bool = True) -> None:
    """Shut down the executor pools created so far (daemon exit; tests). A later
    :func:`pool` creates a fresh one."""
    with _lock:
        exs = list(_executors.values())
        _executors.clear()
    for ex in exs:
        ex.shutdown(wait=block, cancel_futures=True)
