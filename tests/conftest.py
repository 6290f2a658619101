"""Shared fixtures: real mounts of mtcfs in subprocesses, torn down whatever happens."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# The suite keeps both cores busy with its own processes (two workers, their daemons): at
# the product's default bg_sched=idle, every seal, replication and backup a test waits for
# yields to all of them (t7_mtc's peer restores: 10-25 % slower run alone, more beside the
# other worker). Mounts here run background work at the normal class unless a test gives
# bg_sched= itself (tests/t4_background_test.py checks each class, the default included);
# MTCFS_TEST_BG_SCHED=idle runs the suite at the product's default.
os.environ.setdefault("MTCFS_TEST_BG_SCHED", "normal")

from support.gcs import gcs_emulator  # noqa: E402,F401 (a fixture for every test file)
from support.mount import Mount, leaked_data_mounts, remove_tree, track, unmount_below  # noqa: E402
from support.watchdog import WatchdogPlugin  # noqa: E402


def pytest_configure(config):
    # The per-test watchdog: a test that overruns its deadline has its FUSE connections
    # aborted and its daemons killed, so it fails instead of hanging (support/watchdog.py).
    if not config.pluginmanager.has_plugin("mtcfs-watchdog"):
        config.pluginmanager.register(WatchdogPlugin(config), "mtcfs-watchdog")


#: Modules whose tests take a minute or more (the run's ``--durations``): started first, so
#: that with two workers (``-n 2 --dist worksteal``) the run does not end on one worker alone
#: running a long test while the other is idle. The order is the same in every worker.
LONG_FIRST = ("t8_goodput_test.py", "t7_chaos_test.py", "t7_failover_test.py",
              "t7_etcd_partition_test.py", "t7_job_dcp_test.py", "t7_mtc_test.py")


def pytest_sessionfinish(session, exitstatus):
    # No data tmpfs of mtcfs's may outlive its test: every test directory is removed with
    # remove_tree (its mounts first). One left mounted fails the run (and is cleared).
    leaked = leaked_data_mounts()
    if leaked:
        for mp in leaked:
            unmount_below(mp)
        sys.stderr.write(f"\nmtcfs data tmpfs mounts leaked by the tests: {leaked}\n")
        session.exitstatus = 1


#: Modules left out of a run unless asked for by name (``-k container``, or the file on the
#: command line): the container tests build the image (minutes) and are ``make
#: test-container`` (docs/kubernetes.md), not part of the README's test command.
ON_REQUEST = {"t9_container_test.py": "container"}


def _asked_for(config, module: str, word: str) -> bool:
    picked = f"{config.option.keyword} {config.option.markexpr}"
    return word in picked or any(module in str(a) for a in config.args)


def pytest_collection_modifyitems(config, items):
    left_out = {m for m, word in ON_REQUEST.items() if not _asked_for(config, m, word)}
    if left_out:
        config.hook.pytest_deselected(items=[i for i in items if i.path.name in left_out])
        items[:] = [i for i in items if i.path.name not in left_out]
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: else as found
    if not os.path.exists("/dev/fuse"):
        skip = pytest.mark.skip(reason="/dev/fuse is missing")
        for item in items:
            if {"mount", "make_mount", "make_cluster"} & set(item.fixturenames):
                item.add_marker(skip)


@pytest.fixture(scope="module", autouse=True)
def fuse_path(request):
    """How the mounts of a test serve file data: ``"passthrough"`` (the kernel reads and
    writes the store's files itself where it can, the default) or ``"daemon"`` (mount
    option ``passthrough=no``: every byte through the daemon). A module that sets
    ``FUSE_PATHS`` (a tuple of those) runs its tests once per path it names (the data
    path's tests run both ways, docs/passthrough.md); :class:`~support.mount.Mount` reads
    the choice from ``MTCFS_TEST_FUSE_PATH``."""
    path = getattr(request, "param", "passthrough")
    old = os.environ.get("MTCFS_TEST_FUSE_PATH")
    os.environ["MTCFS_TEST_FUSE_PATH"] = path
    yield path
    if old is None:
        os.environ.pop("MTCFS_TEST_FUSE_PATH", None)
    else:
        os.environ["MTCFS_TEST_FUSE_PATH"] = old


def pytest_generate_tests(metafunc):
    paths = getattr(metafunc.module, "FUSE_PATHS", None)
    if paths and "fuse_path" in metafunc.fixturenames:
        metafunc.parametrize("fuse_path", list(paths), indirect=True, scope="module")


@pytest.fixture
def shm_dir():
    """A fresh directory on tmpfs (/dev/shm): the baseline real filesystem."""
    d = tempfile.mkdtemp(prefix="mtcfs-test-", dir="/dev/shm")
    track(d)
    yield Path(d)
    remove_tree(d)  # the stores' data tmpfs mounts first (they outlive the daemons)


@pytest.fixture
def make_mount(shm_dir):
    """Factory: ``make_mount(name="a", **options) -> Mount`` (started). All are cleaned up.
    A multi-node mount given no TLS files (peers and etcd) gets option ``insecure`` (the
    peer TLS is tested through :class:`Cluster`, which gives every rank a certificate, and
    etcd's in t9_etcd_auth)."""
    mounts: list[Mount] = []

    def factory(name: str = "m", start: bool = True, job: str = "testjob", **options) -> Mount:
        if int(options.get("nodes", 1)) > 1 and not ("tls_ca" in options
                                                      and "coord_ca" in options):
            options.setdefault("insecure", True)
        m = Mount(shm_dir / name, job=job, options={k: (None if v is True else str(v))
                                                    for k, v in options.items()})
        mounts.append(m)
        if start:
            m.start()
        return m

    yield factory
    for m in mounts:
        m.cleanup()


@pytest.fixture
def mount(make_mount):
    """One started mount with default options."""
    return make_mount()


@pytest.fixture
def make_cluster(shm_dir):
    """Factory: ``make_cluster(nodes, start=True, **Cluster kwargs) -> Cluster``: one mount
    per rank on loopback (tests/support/cluster.py). All are cleaned up."""
    from support.cluster import Cluster
    made: list[Cluster] = []

    def factory(nodes: int = 2, start: bool = True, **kw) -> Cluster:
        c = Cluster(shm_dir / f"c{len(made)}", nodes, **kw)
        made.append(c)
        if start:
            c.start()
        return c

    yield factory
    for c in made:
        c.cleanup()
