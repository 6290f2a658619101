#!/usr/bin/env bash
# All set-up mtcfs needs on a fresh Debian 12 machine, as root: apt packages, a virtual
# environment in .venv with mtcfs and its test dependencies, and the mount helper on PATH
# (so `mount -t fuse.mtcfs` and fstab work); etcd-server is the coordination engine of
# multi-node tests (a real server on loopback), etcd-client (etcdctl) sets up its users and
# roles in tests/t7_etcd_auth_test.py; fio is the random-write load of
# benchmarks/bench_random.py; curl, patch, meson and ninja build libfuse 3.17 and mtcfs's
# pyfuse3 into .venv (scripts/build_fuse.sh, docs/fuse-build.md); slurmd, slurmctld,
# slurm-client and munge are the Slurm cluster tests/t7_slurm_test.py starts on this machine
# (tests/support/slurm.py, docs/slurm.md; it runs its own munged, never the system one);
# podman, runc and mmdebstrap build the node image from Debian's archive and run the
# DaemonSet's pod (scripts/build-image.sh, tests/t9_container_test.py, docs/kubernetes.md).
# Idempotent: a second run does nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

need_apt=()
for pkg in fuse3 libfuse3-dev pkg-config python3-venv python3-dev gcc iproute2 make etcd-server etcd-client fio \
    curl patch meson ninja-build slurmd slurmctld slurm-client munge podman runc mmdebstrap; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$py" -m venv .venv
fi
# libfuse 3.17 and mtcfs's pyfuse3 (FUSE_HANDLE_KILLPRIV_V2: no GETXATTR before every write);
# on failure it says so in one line and the stock pyfuse3 is installed below instead.
bash scripts/build_fuse.sh || true
stamp=.venv/.mtcfs-installed
want=$(cat pyproject.toml | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing Python packages (first time: a few minutes)"
  .venv/bin/pip install -q --disable-pip-version-check -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import mtcfs, pyfuse3, torch, jax, orbax.checkpoint" >/dev/null
  echo "$want" > "$stamp"
fi

# The mount helper: mount.fuse3 runs `mtcfs SOURCE MOUNTPOINT -o ...` from PATH.
if [ -w /usr/local/bin ] && [ "$(readlink /usr/local/bin/mtcfs 2>/dev/null)" != "$root/.venv/bin/mtcfs" ]; then
  ln -sf "$root/.venv/bin/mtcfs" /usr/local/bin/mtcfs
fi
# Kernel FUSE connection control (used to abort a hung mount) is mounted on demand.
mountpoint -q /sys/fs/fuse/connections 2>/dev/null || mount -t fusectl none /sys/fs/fuse/connections 2>/dev/null || true
echo "setup: ok"
