"""A real Slurm cluster drives mtcfs: the Prolog/Epilog of deploy/slurm/ mount and unmount
one ``scope=job`` mtcfs per allocated node, and a ``sbatch -N2`` job saves and loads a
PyTorch DCP checkpoint through those mounts (tests/support/slurm.py: munged, slurmctld and
two slurmd, each slurmd in a network namespace and UTS namespace of its own on one bridge;
one etcd on the bridge's address).

1. ``sbatch -N2``: the Prolog mounts rank 0 on n0 and rank 1 on n1; step 1 (``srun``, one
   task per node, gloo across the bridge) saves ``step_1`` with DCP, step 2 loads it with
   the ranks swapped between the nodes (each reads the shard the other node wrote), step 3
   lists ``step_1`` on both nodes. Every loaded tensor equals the saved one bit for bit;
   the Epilog unmounted both nodes; the stores stay.
2. Node n1 is lost and replaced: its slurmd is killed, its store wiped, a new slurmd of
   the same name starts. The same job name is submitted again (a requeue finds its RAM
   tier under the job's name): n0 finds its store, n1's mount restores from its peer, and
   a DCP load on both nodes is again bit-exact.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from support import netns
from support.mount import unmount_below
from support.slurm import SlurmCluster, missing_binaries, node_name

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy" / "slurm"
JOB = "ckptjob"

pytestmark = [
    pytest.mark.skipif(bool(missing_binaries()),
                       reason=f"Slurm/munge programs missing: {missing_binaries()} "
                              "(apt-get install slurmd slurmctld slurm-client munge)"),
    pytest.mark.skipif(netns.available() is not None,
                       reason=f"network namespaces: {netns.available()}"),
    pytest.mark.timeout(420),
]
pytest.importorskip("torch")

# One srun task per node. The rank's directory is the mount the Prolog made on its node
# (MOUNT_ROOT/<job name>, MOUNT_ROOT with %n = the node's name); MASTER_ADDR is the first
# node's NodeAddr; gloo binds the interface holding this node's NodeAddr.
JOB_SCRIPT = """#!/bin/bash
set -euo pipefail
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
echo "job $SLURM_JOB_ID restart ${{SLURM_RESTART_COUNT:-0}} on $SLURM_JOB_NODELIST"
cat > "$RESULTS/task.sh" <<'EOF'
#!/bin/bash
set -euo pipefail
mode=$1 shift_by=$2
addr_of() {{ scontrol show node "$1" -o | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p'; }}
# task i runs on node i of the job (one per node); torch rank 0 (the TCPStore) is task
# (N - shift_by) % N
mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
export MASTER_ADDR=$(addr_of "${{hosts[$(( (SLURM_NTASKS - shift_by) % SLURM_NTASKS ))]}}")
export MASTER_PORT=$(( 29511 + shift_by ))
me=$(addr_of "$SLURMD_NODENAME")
export GLOO_SOCKET_IFNAME=$(ip -o -4 addr show | awk -v a="$me" 'index($4, a "/") == 1 {{print $2}}')
dir={mount_root}/$SLURM_JOB_NAME
dir=${{dir//%n/$SLURMD_NODENAME}}
rank=$(( (SLURM_PROCID + shift_by) % SLURM_NTASKS ))
echo "$SLURMD_NODENAME: rank $rank $mode in $dir ($(stat -f -c %T "$dir"))"
exec {python} -m tests.support.dcp_ranks --rank "$rank" --world "$SLURM_NTASKS" \\
  --dir "$dir" --mode "$mode" --step 1 --seed 7 --train-steps 2 --pg-timeout 60 \\
  --result "$RESULTS/$mode-$SLURM_JOB_ID-$rank.json"
EOF
chmod +x "$RESULTS/task.sh"
export restart=${{SLURM_RESTART_COUNT:-0}}
if [ "$restart" -gt 0 ] && [ -n "${{MODES_AFTER_REQUEUE:-}}" ]; then MODES=$MODES_AFTER_REQUEUE; fi
for mode in $MODES; do
  shift_by=0
  if [ "$mode" = load ]; then shift_by=1; fi
  srun -N "$SLURM_NNODES" --ntasks-per-node=1 "$RESULTS/task.sh" "$mode" "$shift_by"
done
srun -N "$SLURM_NNODES" --ntasks-per-node=1 bash -c \\
  'd={mount_root}/$SLURM_JOB_NAME; d=${{d//%n/$SLURMD_NODENAME}}
   echo "$SLURMD_NODENAME lists: $(ls -A $d/step_1 | tr "\\n" " ")"
   {python} -m mtcfs status "$d" --json > "$RESULTS/status-$SLURM_JOB_ID-$restart-$SLURMD_NODENAME.json"'
if [ "$restart" -eq 0 ] && [ -n "${{HOLD:-}}" ]; then   # the test loses a node meanwhile
  touch "$RESULTS/held-$SLURM_JOB_ID"
  sleep 600
fi
"""


@pytest.fixture
def make_slurm(shm_dir: Path, tmp_path: Path):
    """``make_slurm(nodes) -> (cluster, nodes_root, results, root)``: the cluster, its etcd
    and the Prolog/Epilog configuration; torn down whatever happens."""
    from support.etcd import EtcdCluster
    from support.fabric import Fabric

    made: list = []

    def factory(nodes: int = 2):
        root = tmp_path / "slurm"
        nodes_root = shm_dir / "nodes"  # per node: %n/ckpt (mount points), %n/store (RAM tier)
        scripts, results = root / "scripts", root / "results"
        for d in (scripts, results, root / "log"):
            d.mkdir(parents=True)
        fabric = Fabric(nodes).create()
        made.append(fabric.destroy)
        etcd = EtcdCluster(root / "etcd", 1, host=fabric.gateway).start()
        made.append(etcd.stop)
        for f in ("mtcfs-prolog", "mtcfs-epilog", "mtcfs-lib.sh"):
            shutil.copy2(DEPLOY / f, scripts / f)
        (scripts / "mtcfs-slurm.conf").write_text("\n".join([
            f"MTCFS={Path(sys.executable).parent / 'mtcfs'}",
            f"COORD={etcd.url}",
            # plaintext peers and etcd: the test's own bridge (docs/slurm.md: use TLS)
            "OPTIONS=scope=job,replicas=1,size=256M,insecure,bg_sched=normal",
            f"MOUNT_ROOT={nodes_root}/%n/ckpt",
            f"STORE_ROOT={nodes_root}/%n/store",
            "PORT=7470",
            "MOUNT_TIMEOUT=90s",
            f"LOG={root}/log/mtcfs-slurm-%n.log",
        ]) + "\n")
        cluster = SlurmCluster(root / "cluster", nodes, prolog=scripts / "mtcfs-prolog",
                               epilog=scripts / "mtcfs-epilog", fabric=fabric,
                               unmount_roots=[nodes_root])
        made.append(cluster.cleanup)
        made.append(lambda: _keep_daemon_logs(nodes_root, root / "log"))  # runs first
        cluster.start()
        return cluster, nodes_root, results, root

    try:
        yield factory
    finally:
        for undo in reversed(made):
            try:
                undo()
            except Exception:  # noqa: BLE001 (every step of the teardown runs)
                pass


def _keep_daemon_logs(nodes_root: Path, to: Path) -> None:
    """Copy every node's mtcfs log out of its store (on tmpfs, removed with the test)."""
    for log in nodes_root.glob("*/store/*/mtcfs.log"):
        shutil.copyfile(log, to / f"mtcfs-{log.parts[-4]}.log")


def _mnt(nodes_root: Path, rank: int) -> Path:
    return nodes_root / node_name(rank) / "ckpt" / JOB


def _store(nodes_root: Path, rank: int) -> Path:
    return nodes_root / node_name(rank) / "store" / JOB


def _submit(cluster: SlurmCluster, root: Path, results: Path, nodes_root: Path,
            modes: str, after_requeue: str = "", hold: bool = False) -> int:
    script = root / "job.sh"
    script.write_text(JOB_SCRIPT.format(mount_root=f"{nodes_root}/%n/ckpt",
                                        python=sys.executable))
    env = f"ALL,RESULTS={results},MODES={modes},MODES_AFTER_REQUEUE={after_requeue}"
    if hold:
        env += ",HOLD=1"
    return cluster.sbatch("-N2", "-J", JOB, "-D", str(REPO), "-o", str(root / "job-%j.out"),
                          "--open-mode=append", "--requeue", f"--export={env}", str(script))


def _results(results: Path, mode: str, jobid: int) -> list[dict]:
    return [json.loads((results / f"{mode}-{jobid}-{r}.json").read_text()) for r in range(2)]


def _assert_bit_exact(loaded: list[dict], saved: list[dict]) -> None:
    ref = saved[0]["digests"]
    assert len(ref) >= 20, ref  # weights, biases, exp_avg, exp_avg_sq, step of 4 layers
    assert all(s["digests"] == ref for s in saved), "the saving ranks disagree"
    for r in loaded:
        bad = sorted(k for k in ref.keys() | r["digests"].keys()
                     if r["digests"].get(k) != ref.get(k))
        assert not bad, f"rank {r['rank']} loaded other values: {bad}"


def _wait_unmounted(cluster: SlurmCluster, nodes_root: Path) -> None:
    cluster.wait(lambda: not any(os.path.ismount(_mnt(nodes_root, r)) for r in range(2)),
                 30, "the Epilog to unmount both nodes")


def _job_out(root: Path, jobid: int) -> str:
    p = root / f"job-{jobid}.out"
    return p.read_text() if p.exists() else ""


def test_sbatch_two_nodes_dcp_through_prolog_mounts_then_a_replaced_node(make_slurm):
    cluster, nodes_root, results, root = make_slurm(2)
    t0 = time.monotonic()

    # 1. save on both nodes, load with the ranks swapped, list on both
    j1 = _submit(cluster, root, results, nodes_root, "save load")
    cluster.wait_job(j1, timeout=120)
    out = _job_out(root, j1)
    saved, loaded = _results(results, "save", j1), _results(results, "load", j1)
    _assert_bit_exact(loaded, saved)
    want = sorted([".metadata", "__0_0.distcp", "__1_0.distcp"])
    for r in range(2):
        line = next(x for x in out.splitlines() if x.startswith(f"{node_name(r)} lists:"))
        assert sorted(line.split(":", 1)[1].split()) == want, out
        assert f"{node_name(r)}: rank" in out and "fuse" in out, out
    _wait_unmounted(cluster, nodes_root)
    for r in range(2):
        assert (_store(nodes_root, r)).is_dir()
    log = (root / "log" / "mtcfs-slurm-n0.log").read_text()
    assert "rank 0 of 2" in log and "unmounted" in log, log
    assert "rank 1 of 2" in (root / "log" / "mtcfs-slurm-n1.log").read_text()
    t1 = time.monotonic()

    # 2. n1 is lost (slurmd killed, RAM tier gone) and replaced by a new host of that name;
    # the job is submitted again under its name: n1 restores from n0, the load is bit-exact
    cluster.kill_slurmd(1)
    unmount_below(_store(nodes_root, 1))  # its data tmpfs (it outlives the daemon)
    shutil.rmtree(_store(nodes_root, 1))
    cluster.start_slurmd(1)
    cluster.wait_nodes_idle(timeout=30)
    j2 = _submit(cluster, root, results, nodes_root, "load")
    cluster.wait_job(j2, timeout=120)
    _assert_bit_exact(_results(results, "load", j2), saved)
    out2 = _job_out(root, j2)
    for r in range(2):
        line = next(x for x in out2.splitlines() if x.startswith(f"{node_name(r)} lists:"))
        assert sorted(line.split(":", 1)[1].split()) == want, out2
    _wait_unmounted(cluster, nodes_root)
    st = {r: json.loads((results / f"status-{j2}-0-{node_name(r)}.json").read_text())
          for r in range(2)}
    # n1 (empty store) took the chunks it read from its peer (n0 kept its store; whether
    # it also asks n1 for a chunk is mtcfs's business, not asserted here)
    assert st[1]["restore"]["chunks_from"].get("peers", 0) >= 1, st[1]["restore"]
    assert st[1]["restore"]["corrupt_chunks"] == 0, st[1]["restore"]
    print(f"\njob 1 (save+load) {t1 - t0:.1f}s, job 2 (replaced node, load) "
          f"{time.monotonic() - t1:.1f}s")


def test_a_node_lost_under_a_running_job_requeues_it_onto_a_spare_that_restores(make_slurm):
    """3 nodes, a 2-node job: it saves on n0 and n1 and keeps running; n1's host is lost
    (slurmd, the mtcfs daemon, everything in its network SIGKILLed, its RAM tier gone).
    slurmctld notices (SlurmdTimeout), the job is requeued and runs again on n0 and the
    spare n2: n0's Prolog mounts rank 0 on its kept store, n2's mounts rank 1 on an empty
    one, and the load after the requeue is bit-exact."""
    cluster, nodes_root, results, root = make_slurm(3)
    t0 = time.monotonic()
    j = _submit(cluster, root, results, nodes_root, "save", after_requeue="load", hold=True)
    cluster.wait(lambda: (results / f"held-{j}").exists() or
                 cluster.job(j).get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING"),
                 90, f"job {j} to save and hold")
    assert cluster.job(j)["NodeList"] == "n[0-1]", cluster.job(j)
    saved = _results(results, "save", j)
    t1 = time.monotonic()
    cluster.lose_node(1)
    unmount_below(nodes_root / "n1")  # its dead FUSE mount and its data tmpfs
    shutil.rmtree(nodes_root / "n1" / "store")
    cluster.wait(lambda: cluster.job(j).get("Restarts") == "1", 60,
                 lambda: f"job {j} to be requeued ({cluster.job(j)}, n1 "
                 f"{cluster.node_state(1)})")
    t2 = time.monotonic()
    final = cluster.wait_job(j, timeout=200)
    assert final["NodeList"] == "n[0,2]", final
    loaded = _results(results, "load", j)
    _assert_bit_exact(loaded, saved)
    st = {n: json.loads((results / f"status-{j}-1-{n}.json").read_text())
          for n in ("n0", "n2")}
    assert st["n2"]["restore"]["corrupt_chunks"] == 0, st["n2"]["restore"]
    assert st["n2"]["restore"]["chunks_from"].get("peers", 0) >= 1, st["n2"]["restore"]
    print(f"\nsave+hold {t1 - t0:.1f}s, loss to requeue {t2 - t1:.1f}s, "
          f"requeued run {time.monotonic() - t2:.1f}s")
    print(_job_out(root, j)[-1500:])
