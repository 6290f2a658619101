"""The container image of deploy/kubernetes/Containerfile built here, and the DaemonSet's
pod run from it by podman as the kubelet would (tests/support/podman.py says what is taken
from the manifest and what is not).

Not in the README's test command (the build takes minutes): ``make test-container``, which
is ``pytest -k container -n 0`` (tests/conftest.py leaves this module out unless asked).

* The image builds from Debian's archive alone (scripts/build-image.sh) and holds mtcfs's
  own libfuse 3.17 and pyfuse3 (FUSE passthrough), not PyPI's pyfuse3. The first image
  built had PyPI's and every open and create through its mount failed EIO (issue 44).
* One node: the pod mounts the job, the probes pass, a training container on the node
  (HostToContainer) writes a checkpoint and reads it back; the pod's container is killed
  and started again: the dead mount is cleared and the running training container sees the
  sealed files again through the new mount; preStop unmounts cleanly.
* Two nodes: two pods agree through the job's etcd and replicate to each other; node 0 is
  lost with its RAM tier, and its new pod restores the checkpoint from node 1.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from pathlib import Path

import pytest

from support import podman as pm
from support.poll import wait_for
from support.ports import free_port

pytestmark = [pytest.mark.skipif(pm.available() is not None, reason=f"{pm.available()}"),
              pytest.mark.timeout(1800), pytest.mark.watchdog(1700)]

MiB = 1 << 20

WRITE = """
import hashlib, os, sys
path, n = sys.argv[1], int(sys.argv[2])
os.makedirs(os.path.dirname(path), exist_ok=True)
data = os.urandom(n)
with open(path, "wb") as f:
    f.write(data)
open(os.path.join(os.path.dirname(path), "commit_success.txt"), "w").write("ok")
print(hashlib.sha256(data).hexdigest())
"""

READ = """
import hashlib, sys
print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())
"""


@pytest.fixture(scope="module")
def image() -> str:
    """The image, built once per run by the documented command (``MTCFS_TEST_IMAGE=TAG``:
    that image, already built, instead; for working on these tests)."""
    if os.environ.get("MTCFS_TEST_IMAGE"):
        return os.environ["MTCFS_TEST_IMAGE"]
    r = pm.build_image()
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return pm.IMAGE


@pytest.fixture
def host(shm_dir: Path):
    """The test's "nodes": their host paths under one directory, every container and
    mount removed at the end, whatever happened."""
    root = shm_dir / "nodes"
    root.mkdir()
    made: list[object] = []
    yield root, made
    for thing in reversed(made):
        thing.remove()  # type: ignore[attr-defined]
    pm.unmount_all(root)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_container_image_holds_mtcfs_with_its_own_pyfuse3(image: str) -> None:
    r = pm.podman("run", "--rm", "--network", "none", *pm.limits(), "--entrypoint",
                  "python3", image, "-c",
                  "import pyfuse3, mtcfs, os; p = '/run/build-ca.crt'; "
                  "print(hasattr(pyfuse3, 'passthrough'), os.environ.get('PIP_CERT'), "
                  "os.path.getsize(p) if os.path.exists(p) else 0)")
    # passthrough-capable pyfuse3; the build's CA neither in the environment nor the image
    # (the build's --volume leaves an empty file where it was mounted)
    assert r.stdout.split() == ["True", "None", "0"], r
    cfg = json.loads(pm.podman("image", "inspect", image).stdout)[0]["Config"]
    assert cfg["Entrypoint"] == ["/usr/bin/tini", "--", "mtcfs-node", "run"], cfg


def test_container_pod_mounts_serves_a_trainer_restarts_and_stops_cleanly(image, host) -> None:
    root, made = host
    job = f"ct{secrets.token_hex(3)}"
    pod = pm.NodePod("node-0", root / "node-0", {"MTCFS_JOB": job, "MTCFS_SIZE": "256M",
                                                 "MTCFS_RANK": "0"}, image=image)
    made.append(pod)
    pod.start()
    pod.wait_started()
    for kind in ("readiness", "liveness"):
        r = pod.probe(kind)
        assert r.returncode == 0 and "is served" in r.stdout, (kind, r)
    mnt_root = pod.host_path("mnt")
    host_mnt = mnt_root / job
    assert os.path.ismount(host_mnt)  # Bidirectional: the pod's mount is on the host

    trainer = pm.Trainer("trainer-0", mnt_root, image=image)
    made.append(trainer)
    digest = trainer.python(WRITE, f"/ckpt/{job}/step_1/shard.bin", str(4 * MiB)).strip()
    assert trainer.python(READ, f"/ckpt/{job}/step_1/shard.bin").strip() == digest
    assert _sha(host_mnt / "step_1" / "shard.bin") == digest
    wait_for(lambda: os.getxattr(host_mnt / "step_1" / "shard.bin",
                                 "user.mtcfs.state").decode() == "local", 60,
             "the shard to be sealed")

    # The container dies (an OOM kill): the mount it leaves is dead; the kubelet starts
    # the container again, which clears it and serves the sealed files from the store.
    pod.kill()
    with pytest.raises(OSError):
        os.stat(host_mnt / "step_1" / "shard.bin")
    pod.restart()
    pod.wait_started()
    assert "clearing the dead mount" in pod.logs()
    # the trainer, running all along, sees the new mount (HostToContainer) and its bytes
    assert trainer.python(READ, f"/ckpt/{job}/step_1/shard.bin").strip() == digest

    # preStop: the clean unmount ends the daemon; the entrypoint outlives it until the
    # hook has ended, so the hook is not killed with the container (exit 137, what a
    # kubelet records as FailedPreStopHook; docs/kubernetes.md, "preStop").
    r = pod.prestop()
    assert r.returncode == 0 and "cleanly" in r.stdout, (r, pod.logs()[-3000:])
    assert not os.path.ismount(host_mnt)
    assert pod.exit_code() == 0, pod.logs()[-3000:]  # the daemon's clean exit
    assert "clean unmount failed" not in pod.logs()


def test_container_pods_replicate_and_a_lost_node_restores_from_its_peer(image, host) -> None:
    from support.etcd import shared_etcd
    root, made = host
    job = f"ct{secrets.token_hex(3)}"
    coord = ",".join(shared_etcd().endpoints)

    def pod(rank: int) -> pm.NodePod:
        p = pm.NodePod(f"node-{rank}", root / f"node-{rank}", {
            "MTCFS_JOB": job, "MTCFS_SIZE": "256M", "MTCFS_RANK": str(rank),
            "MTCFS_NODES": "2", "MTCFS_REPLICAS": "1", "MTCFS_COORD": coord,
            "MTCFS_INSECURE": "yes", "MTCFS_PEER_PORT": str(free_port()),
            "MTCFS_METRICS_PORT": str(free_port())}, network="host", image=image)
        made.append(p)
        p.start()
        return p

    pods = [pod(0), pod(1)]
    for p in pods:
        p.wait_started()
    mnt0 = pods[0].host_path("mnt") / job
    data = os.urandom(6 * MiB)
    (mnt0 / "step_1").mkdir()
    (mnt0 / "step_1" / "shard-0.bin").write_bytes(data)
    (mnt0 / "step_1" / "commit_success.txt").write_text("ok")
    wait_for(lambda: os.getxattr(mnt0 / "step_1" / "shard-0.bin",
                                 "user.mtcfs.state").decode() == "replicated 1/1", 90,
             "rank 0's shard to reach rank 1")

    # Node 0 is lost: its pod and its RAM tier (the host tmpfs under its store) are gone.
    pods[0].kill()
    pods[0].remove()
    pm.unmount_all(root / "node-0")
    shutil.rmtree(root / "node-0")
    pods[0] = pod(0)  # the replacement node's pod, on an empty store
    pods[0].wait_started()
    mnt0 = pods[0].host_path("mnt") / job
    assert (mnt0 / "step_1" / "shard-0.bin").read_bytes() == data, pods[0].logs()[-3000:]
