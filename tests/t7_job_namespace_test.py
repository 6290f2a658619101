"""scope=job: several daemons on one machine are one POSIX directory (docs/consistency.md).

Each test asserts what a user of the mounts would check: the names every node lists, the
bytes every node reads, the errno a racing call gets, nothing lost when a node dies.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import threading
import time

import blake3
import pytest
from support.prom import value as metric

JOB = {"scope": "job", "replicas": 1, "chunk_size": "1M"}


def _race(fns):
    """Run the callables at once (released by one barrier); their results or exceptions."""
    barrier = threading.Barrier(len(fns))
    out = [None] * len(fns)

    def run(i, fn):
        barrier.wait()
        try:
            out[i] = fn()
        except OSError as exc:
            out[i] = exc
    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_close_to_open_on_every_node(make_cluster):
    c = make_cluster(3, options=JOB)
    d = c.node(1).path("step_1")
    d.mkdir()
    big = os.urandom(3 * 1024 * 1024 + 17)  # 4 chunks, fetched from rank 1
    (d / "w.bin").write_bytes(big)
    (d / "small").write_bytes(b"metadata")  # travels inline
    for r in (0, 2):
        assert sorted(os.listdir(c.node(r).path("step_1"))) == ["small", "w.bin"]
        assert c.node(r).path("step_1", "small").read_bytes() == b"metadata"
        # the small file came inside the namespace op: nothing fetched from rank 1
        assert c.status(r)["counters"]["chunks_faulted"] == 0
        assert c.state(r, "step_1/w.bin") == "remote"  # rank 1's file, not read here yet
        assert c.node(r).path("step_1", "w.bin").read_bytes() == big
        assert c.status(r)["counters"]["chunks_faulted"] == 4  # verified, from rank 1
    # A rewrite on another node: its close is seen by the next open everywhere, including
    # the kernel's cached size on nodes that read the old content.
    c.node(2).path("step_1", "w.bin").write_bytes(b"v2" * 10)
    for r in range(3):
        assert c.node(r).path("step_1", "w.bin").read_bytes() == b"v2" * 10
        assert os.stat(c.node(r).path("step_1", "w.bin")).st_size == 20


def test_a_rewrite_in_place_hashes_the_chunk_changed_and_every_node_reads_it(make_cluster):
    """Issue 18: one byte changed in place (no O_TRUNC) in an 8-chunk file of rank 1's,
    which rank 0 has read: rank 1's seal hashes that one chunk (it hashed the whole file),
    rank 0's next open reads the new bytes, verified, and both report the true blake3.
    (On the daemon's path: with passthrough the daemon does not see which chunks a rewrite
    changed and hashes the whole file, docs/passthrough.md; t4_posix_test runs the same
    cost both ways.)"""
    c = make_cluster(2, options={**JOB, "passthrough": "no"})
    data = bytearray(os.urandom(8 * 1024 * 1024))
    c.node(1).path("step_1").mkdir()
    (c.node(1).path("step_1", "w.bin")).write_bytes(data)
    assert c.node(0).path("step_1", "w.bin").read_bytes() == data
    hashed0 = c.status(1)["counters"]["seal_bytes_hashed"]
    with open(c.node(1).path("step_1", "w.bin"), "r+b") as f:
        f.seek(5 * 1024 * 1024 + 7)
        f.write(b"!")
    data[5 * 1024 * 1024 + 7] = ord("!")
    assert c.status(1)["counters"]["seal_bytes_hashed"] - hashed0 == 1024 * 1024
    want = blake3.blake3(data).hexdigest()
    for r in (1, 0):
        p = c.node(r).path("step_1", "w.bin")
        assert p.read_bytes() == data
        assert os.getxattr(p, "user.mtcfs.blake3").decode() == want


def test_kill9_in_the_middle_of_a_rewrite_reseals_and_publishes_the_bytes_written(
        make_cluster):
    """SIGKILL of rank 1 while it rewrites its file in place, two chunks written and
    fsync'd: after rank 1 comes back its file holds the old bytes with those written,
    sealed again by hashing only the chunks written (committed before their bytes
    changed), and rank 0 reads the same bytes. Nothing is lost, nothing half-published.
    (On the daemon's path, for the cost; t6_crash_test runs the same crash both ways.)"""
    c = make_cluster(2, options={**JOB, "passthrough": "no"})
    mib = 1024 * 1024
    data = bytearray(os.urandom(8 * mib))
    c.node(1).path("step_1").mkdir()
    (c.node(1).path("step_1", "w.bin")).write_bytes(data)
    assert c.node(0).path("step_1", "w.bin").read_bytes() == data
    fd = os.open(c.node(1).path("step_1", "w.bin"), os.O_RDWR)
    for off, b in [(2 * mib - 2, b"span"), (6 * mib, b"q" * 5000)]:
        os.pwrite(fd, b, off)
        data[off:off + len(b)] = b
    os.fsync(fd)
    c.kill9(1)
    try:
        os.close(fd)
    except OSError:
        pass
    c.restart(1)
    p1 = c.node(1).path("step_1", "w.bin")
    assert p1.read_bytes() == data
    assert c.status(1)["counters"]["seal_bytes_hashed"] == 3 * mib  # chunks 1, 2 and 6
    want = blake3.blake3(data).hexdigest()
    assert os.getxattr(p1, "user.mtcfs.blake3").decode() == want
    c.node(1).wait_for(lambda: c.state(1, "step_1/w.bin") != "writing", 30, "the reseal")
    p0 = c.node(0).path("step_1", "w.bin")
    c.node(0).wait_for(lambda: p0.read_bytes() == data, 30, "the reseal's publish on rank 0")
    assert os.getxattr(p0, "user.mtcfs.blake3").decode() == want


def test_concurrent_mkdir_of_one_path_from_every_node(make_cluster):
    c = make_cluster(3, options=JOB)
    for round_ in range(5):
        name = f"step_{round_}"
        out = _race([lambda r=r, name=name: os.mkdir(c.node(r).path(name)) for r in range(3)])
        made = [o for o in out if o is None]
        lost = [o for o in out if isinstance(o, OSError)]
        assert len(made) == 1 and len(lost) == 2, out
        assert all(o.errno == errno.EEXIST for o in lost)
        for r in range(3):
            assert os.listdir(c.node(r).path()).count(name) == 1
        # os.makedirs(exist_ok=True), as DCP and Orbax call it, succeeds on every node.
        out = _race([lambda r=r, name=name: os.makedirs(c.node(r).path(name, "sub"), exist_ok=True)
                     for r in range(3)])
        assert out == [None, None, None]


def test_directory_rename_is_atomic_for_a_node_listing_it(make_cluster):
    c = make_cluster(2, options=JOB)
    files = {f"f{i}": os.urandom(1000 + i) for i in range(20)}
    root0, root1 = c.node(0).path(), c.node(1).path()
    stop = threading.Event()
    seen: list[tuple[list[str], list[str]]] = []
    bad: list[str] = []

    def lister():
        while not stop.is_set():
            names = sorted(n for n in os.listdir(root1) if n.startswith("7"))
            for n in names:
                try:
                    inside = sorted(os.listdir(root1 / n))
                except FileNotFoundError:
                    continue  # renamed between the two calls: a later listing shows it
                seen.append((names, inside))
                if n == "7" and inside != sorted(files):
                    bad.append(f"{n}: {inside}")

    t = threading.Thread(target=lister)
    t.start()
    try:
        for round_ in range(5):
            tmp = root0 / "7.orbax-checkpoint-tmp"
            tmp.mkdir()
            for name, data in files.items():
                (tmp / name).write_bytes(data)
            if round_:
                os.rename(root0 / "7", root0 / f"old{round_}")  # out of the way, kept whole
            os.rename(tmp, root0 / "7")
            time.sleep(0.05)
    finally:
        stop.set()
        t.join(60)
    assert not bad, bad[:3]
    assert any(inside == sorted(files) for names, inside in seen if "7" in names), \
        "the listing never saw the renamed step"


def test_unlink_on_one_node_while_another_reads_it(make_cluster):
    c = make_cluster(2, options=JOB)
    data = os.urandom(4 * 1024 * 1024 + 5)
    c.node(0).path("a.bin").write_bytes(data)
    with open(c.node(1).path("a.bin"), "rb") as f:
        head = f.read(1000)
        os.unlink(c.node(0).path("a.bin"))
        assert not c.node(1).path("a.bin").exists()
        rest = f.read()
    assert head + rest == data


def test_last_close_wins_and_data_is_never_mixed(make_cluster):
    c = make_cluster(2, options=JOB)
    with open(c.node(0).path("same"), "wb") as a, open(c.node(1).path("same"), "wb") as b:
        a.write(b"A" * 3_000_000)
        b.write(b"B" * 2_000_000)
        a.close()
    # b closed last: it wins on every node
    for r in range(2):
        assert c.node(r).path("same").read_bytes() == b"B" * 2_000_000


def test_a_dead_nodes_files_come_back_from_replicas(make_cluster):
    c = make_cluster(3, options=JOB)
    d = c.node(0).path("step_5")
    d.mkdir()
    data = {r: os.urandom(2 * 1024 * 1024 + r) for r in range(3)}
    for r in range(3):
        c.node(r).path("step_5", f"__{r}_0.distcp").write_bytes(data[r])
    c.node(0).path("step_5", ".metadata").write_bytes(b"meta")  # commits step_5
    c.wait_replicated(2, "step_5")
    c.kill9(2)
    c.wipe(2)
    # The remaining nodes read rank 2's file from its replica (rank 2 is gone).
    for r in (0, 1):
        assert c.node(r).path("step_5", "__2_0.distcp").read_bytes() == data[2]
    # A new node in rank 2's place sees the whole job at once, bytes included.
    c.restart(2)
    assert sorted(os.listdir(c.node(2).path("step_5"))) == \
        [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    for r in range(3):
        assert c.node(2).path("step_5", f"__{r}_0.distcp").read_bytes() == data[r]
    # and writes like any other node
    c.node(2).path("step_5", "after").write_bytes(b"x")
    assert c.node(1).path("step_5", "after").read_bytes() == b"x"


@pytest.mark.parametrize("victim", [0])
def test_a_node_dies_during_a_save(make_cluster, victim):
    """Steps are saved DCP-style from node 1 while rank 0 (the peer tier's coordinator) is
    killed: every save completes (or raises), and a step whose .metadata is visible is
    complete on every surviving node. (With the home-made log rank 0 also led the
    namespace; etcd orders it now, so the saves do not even pause.)"""
    c = make_cluster(3, options=JOB)
    root = c.node(1).path()
    errors: list[BaseException] = []
    saved: list[int] = []

    def save(step: int) -> None:
        d = root / f"step_{step}"
        d.mkdir()
        for r in range(3):
            (d / f"__{r}_0.distcp").write_bytes(bytes([step]) * 300_000)
        (d / ".metadata.tmp").write_bytes(b"meta%d" % step)
        os.rename(d / ".metadata.tmp", d / ".metadata")

    stop = threading.Event()

    def saver():
        step = 0
        while not stop.is_set() and step < 200:
            step += 1
            try:
                save(step)
                saved.append(step)
            except OSError as exc:
                errors.append(exc)

    t = threading.Thread(target=saver)
    t.start()
    deadline = time.monotonic() + 60
    while len(saved) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert t.is_alive() and len(saved) >= 2, f"the save loop does not run: {errors[-3:]}"
    before = len(saved)
    c.kill9(victim)
    deadline = time.monotonic() + 120
    while len(saved) < before + 3 and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    stop.set()
    t.join(120)
    assert not t.is_alive()
    assert len(saved) >= before + 3, f"saves stopped after the leader died: {errors[-3:]}"
    assert all(isinstance(e, OSError) for e in errors)
    for r in (1, 2):
        for name in os.listdir(c.node(r).path()):
            d = c.node(r).path(name)
            if (d / ".metadata").exists():
                step = int(name.split("_")[1])
                assert sorted(os.listdir(d)) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                 "__2_0.distcp"]
                for f in ("__0_0.distcp", "__1_0.distcp", "__2_0.distcp"):
                    assert (d / f).read_bytes() == bytes([step]) * 300_000
    assert set(saved) <= {int(n.split("_")[1]) for n in os.listdir(c.node(2).path())}
    assert c.status(1)["namespace"]["unavailable_s"] is None
    human = c.node(2).cli("status", str(c.node(2).mnt)).stdout
    assert "namespace: scope=job, ordered by etcd at" in human
    metrics = c.node(1).cli("metrics", str(c.node(1).mnt)).stdout
    assert metric(metrics, "mtcfs_namespace_unavailable_seconds", job="testjob",
                  rank=1) == 0, metrics
    # mtcfs checkpoints lists the steps complete job-wide, on every surviving node
    for r in (1, 2):
        listed = {row["step"] for row in c.node(r).checkpoints()}
        assert {f"step_{s}" for s in saved} <= listed


@pytest.mark.parametrize("n,etcd_lost", [(2, True), (3, False)])
def test_whole_job_restart_with_every_ram_tier_lost_restores_from_backup(make_cluster,
                                                                          shm_dir, n,
                                                                          etcd_lost):
    """Every RAM tier lost. etcd kept: the namespace comes from etcd, the bytes from the
    backup tier. etcd lost too (a fresh keyspace): the first node to join restores the
    newest step complete for every rank from the backup tier and seeds etcd with it."""
    bucket = shm_dir / "bucket"
    bucket.mkdir()
    c = make_cluster(n, options={**JOB, "backup": f"file://{bucket}", "backup_interval": "1ckpt"})
    c.node(1).path("step_3").mkdir()
    data = {r: os.urandom(1_500_000 + r) for r in range(n)}
    for r in range(n):
        c.node(r).path("step_3", f"__{r}_0.distcp").write_bytes(data[r])
    c.node(0).path("step_3", ".metadata").write_bytes(b"meta")
    for r in range(n):
        c.node(r).wait_state("step_3", "backed-up")
    for r in range(n):
        c.kill9(r)
        c.wipe(r)
    if etcd_lost:
        c.coord_prefix += "-new"
    c.restart_many(list(range(n)))
    want = [".metadata"] + [f"__{w}_0.distcp" for w in range(n)]
    for r in range(n):
        assert sorted(os.listdir(c.node(r).path("step_3"))) == want, r
        for w in range(n):
            assert c.node(r).path("step_3", f"__{w}_0.distcp").read_bytes() == data[w]
        assert c.node(r).path("step_3", ".metadata").read_bytes() == b"meta"
    if etcd_lost:  # whichever node joined first seeded etcd from the bucket
        assert "backup" in {c.status(r).get("restore", {}).get("manifest_from")
                            for r in range(n)}
    # the restored job goes on: a new step is visible everywhere
    c.node(1).path("step_4").mkdir()
    for r in range(n):
        assert os.listdir(c.node(r).path("step_4")) == [], r


@pytest.mark.parametrize("before,after", [(3, 2), (2, 3)])
def test_a_job_restored_from_backup_on_another_node_count_has_every_ranks_file(
        make_cluster, shm_dir, before, after):
    """A job saved step_3 on ``before`` nodes (each rank its own shard), backed up; every
    node is lost. It restarts on ``after`` nodes with empty stores and a fresh etcd
    keyspace: the first node to join restores the step from the bucket, and every node
    lists and reads every shard of it, bit-exact, including those of ranks that no longer
    exist. Before, on fewer nodes the step came back with the first ``after`` shards only,
    and on more nothing was restorable (the ranks counted were this job's, not the step's)."""
    bucket = shm_dir / "bucket"
    bucket.mkdir()
    opts = {**JOB, "backup": f"file://{bucket}", "backup_interval": "1ckpt"}
    old = make_cluster(before, options=opts)
    old.node(0).path("step_3").mkdir()
    data = {r: os.urandom(1_500_000 + r) for r in range(before)}
    for r in range(before):
        old.node(r).path("step_3", f"__{r}_0.distcp").write_bytes(data[r])
    old.node(0).path("step_3", ".metadata").write_bytes(b"meta")  # DCP's commit
    for r in range(before):
        old.node(r).wait_state("step_3", "backed-up")
    for r in range(before):
        old.kill9(r)
    new = make_cluster(after, options=opts)
    want = [".metadata"] + [f"__{w}_0.distcp" for w in range(before)]
    for r in range(after):
        assert sorted(os.listdir(new.node(r).path("step_3"))) == want, r
        for w in range(before):
            try:
                got = new.node(r).path("step_3", f"__{w}_0.distcp").read_bytes()
            except OSError as exc:
                raise AssertionError(f"node {r}, rank {w}'s file: {exc}\n"
                                     f"{new.node(r).log()[-3000:]}") from None
            assert got == data[w], (r, w)


def test_a_paused_node_comes_back_and_nothing_is_lost(make_cluster):
    """Rank 0 is stopped (SIGSTOP) while rank 1 changes the namespace; resumed, it applies
    what it missed: every node ends with the same names, the change made meanwhile
    included."""
    c = make_cluster(3, options=JOB)
    c.node(1).path("before").mkdir()
    pid0 = c.node(0).pid
    os.kill(pid0, signal.SIGSTOP)
    try:
        time.sleep(6)
        c.node(1).path("during_on_1").mkdir()  # acknowledged by the new leader
    finally:
        os.kill(pid0, signal.SIGCONT)
    for r in range(3):
        c.node(r).path(f"after_on_{r}").mkdir()
    want = ["after_on_0", "after_on_1", "after_on_2", "before", "during_on_1"]
    for r in range(3):
        assert sorted(os.listdir(c.node(r).path())) == want, r


def test_a_child_closing_an_inherited_descriptor_publishes_nothing(make_cluster):
    """fork/exec closes inherited descriptors (close-on-exec), and the kernel sends FLUSH
    for each: only the writer's own last close publishes the file job-wide."""
    c = make_cluster(2, options=JOB)
    path0, path1 = c.node(0).path("w.bin"), c.node(1).path("w.bin")
    with open(path0, "wb") as f:
        f.write(b"a" * 1_000_000)
        f.flush()
        os.fsync(f.fileno())
        subprocess.run(["true"], check=True)  # a child inherits, then closes, the descriptor
        assert path1.read_bytes() == b""  # not closed by the writer yet: the empty new file
        f.write(b"b" * 1_000_000)
    assert path1.read_bytes() == b"a" * 1_000_000 + b"b" * 1_000_000


def _wait(what, fn, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not fn():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def _mkdir_in_background(path):
    """Start ``path.mkdir()`` in a thread (it may block for a while); returns the thread and
    a list that gets ``"ok"`` or the OSError once the call returns."""
    done: list[object] = []

    def run():
        try:
            path.mkdir()
            done.append("ok")
        except OSError as exc:
            done.append(exc)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done


def test_a_peer_partition_does_not_split_the_namespace(make_cluster):
    """Rank 0 is cut off from the other nodes' peer ports (not from etcd): both sides go
    on changing the namespace and every node sees every change at once, since etcd, not a
    node, orders it. (With the home-made log the cut-off side stopped, or — without a
    quorum — went on alone and split.)"""
    c = make_cluster(3, options=JOB)
    c.node(1).path("before").mkdir()
    c.partition([0], [1, 2])
    try:
        c.node(0).path("cut_off").mkdir()
        c.node(2).path("majority_side").mkdir()
        want = ["before", "cut_off", "majority_side"]
        for r in range(3):
            assert sorted(os.listdir(c.node(r).path())) == want, r
    finally:
        c.partition()


def test_a_node_killed_with_changes_in_flight_loses_no_acknowledged_change(make_cluster):
    """Rank 0 is killed while six of its mkdirs are on their way: each one that returned
    is on every node, and every node lists the same names, after rank 0 came back."""
    c = make_cluster(3, options=JOB)
    for i in range(6):
        c.node(0).path(f"p{i}").mkdir()
    res = {f"d{i}": _mkdir_in_background(c.node(0).path(f"p{i}", f"d{i}"))[1]
           for i in range(6)}
    time.sleep(0.05)
    c.kill9(0)
    c.node(1).path("C").mkdir()
    c.restart(0)
    c.node(2).path("after").mkdir()
    acknowledged = {name for name, done in res.items() if done == ["ok"]}
    for r in range(3):
        top = sorted(os.listdir(c.node(r).path()))
        assert top == ["C", "after"] + [f"p{i}" for i in range(6)], (r, top)
        below = {n for i in range(6) for n in os.listdir(c.node(r).path(f"p{i}"))}
        assert acknowledged <= below, (r, acknowledged, below)
        assert below == {n for i in range(6) for n in os.listdir(c.node(0).path(f"p{i}"))}


def test_touching_a_file_open_for_writing_changes_its_mtime_everywhere(make_cluster):
    """GNU touch of an existing file: open for writing, futimens, close, same bytes. The
    time travels with the publish at close; every node must show it."""
    c = make_cluster(2, options=JOB)
    c.node(0).path("marker").write_bytes(b"done")
    when = 1_700_000_000_123_456_789
    with open(c.node(0).path("marker"), "r+b") as f:
        os.utime(f.fileno(), ns=(when, when))
    for r in range(2):
        assert os.stat(c.node(r).path("marker")).st_mtime_ns == when, r
        assert c.node(r).path("marker").read_bytes() == b"done"


def test_special_files_and_hard_links_are_job_wide(make_cluster):
    """FIFOs, device nodes, sockets and hard links made on one node are seen by every
    node (ops of the namespace log), and by a node that rejoins with its store wiped (the
    namespace snapshot carries them)."""
    import socket
    import stat

    c = make_cluster(2, options=JOB)
    d0 = c.node(0).path("step_1")
    d0.mkdir()
    os.mkfifo(d0 / "fifo", 0o640)
    os.mknod(d0 / "chr", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(d0 / "sock"))
    s.close()
    (d0 / "a").write_bytes(b"one")
    os.link(d0 / "a", d0 / "b")
    os.link(d0 / "fifo", d0 / "fifo2")

    def check(r, nlink_a=2):
        d = c.node(r).path("step_1")
        assert stat.S_ISFIFO(os.lstat(d / "fifo").st_mode), r
        assert stat.S_IMODE(os.lstat(d / "fifo").st_mode) == 0o640, r
        assert os.lstat(d / "fifo").st_nlink == 2, r
        assert os.lstat(d / "fifo2").st_ino == os.lstat(d / "fifo").st_ino, r
        assert stat.S_ISCHR(os.lstat(d / "chr").st_mode), r
        assert os.lstat(d / "chr").st_rdev == os.makedev(1, 3), r
        assert stat.S_ISSOCK(os.lstat(d / "sock").st_mode), r
        assert os.stat(d / "b").st_nlink == nlink_a, r
        if nlink_a == 2:
            assert os.stat(d / "a").st_ino == os.stat(d / "b").st_ino, r

    check(0)
    check(1)
    d1 = c.node(1).path("step_1")
    assert (d1 / "b").read_bytes() == b"one"
    # Written through one name on one node: the other name on the other node reads it.
    (d1 / "b").write_bytes(b"two")
    assert (d0 / "a").read_bytes() == b"two"
    assert err_of(os.link, d1 / "a", d0 / "b") == errno.EEXIST
    assert err_of(os.link, d1, c.node(1).path("dirlink")) == errno.EPERM
    # A node that comes back with nothing gets them from the namespace snapshot.
    c.restart(1, wipe=True)
    check(1)
    assert c.node(1).path("step_1", "a").read_bytes() == b"two"
    os.unlink(c.node(1).path("step_1", "a"))
    check(0, nlink_a=1)
    assert (d0 / "b").read_bytes() == b"two"
    os.unlink(d0 / "fifo2")
    assert os.lstat(c.node(1).path("step_1", "fifo")).st_nlink == 1


def err_of(fn, *args) -> int:
    try:
        fn(*args)
    except OSError as exc:
        return exc.errno
    return 0
