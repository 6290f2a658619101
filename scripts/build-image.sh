#!/usr/bin/env bash
# Build the mtcfs node image (deploy/kubernetes/Containerfile) on this machine, with no
# registry: the base, debian:12-slim, is made from Debian's archive by mmdebstrap (variant
# minbase) and imported into podman's store under that name; the build then never pulls.
#
#   bash scripts/build-image.sh [TAG]        # default localhost/mtcfs:0.1.0
#
# Needs root, podman and mmdebstrap (scripts/setup.sh installs them), Debian's archive and
# PyPI. The RUN steps run in a chroot (--isolation=chroot): no OCI runtime is needed to
# build, so a host whose cgroup layout crun refuses (this one: cgroup v1 beside a v2
# mount) builds too. Behind an egress proxy that re-signs TLS, MTCFS_BUILD_CA names the CA
# bundle pip must trust (default: the system's); it is given to the build stage only and
# is not in the image. docs/kubernetes.md, "The image and the pod, run here".
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:-localhost/mtcfs:0.1.0}
base=docker.io/library/debian:12-slim
for tool in podman mmdebstrap; do
  command -v "$tool" >/dev/null || { echo "build-image: $tool is not installed (scripts/setup.sh installs it)" >&2; exit 2; }
done
if ! podman image exists "$base"; then
  work=$(mktemp -d /var/tmp/mtcfs-base.XXXXXX)
  trap 'rm -rf "$work"' EXIT
  echo "build-image: making $base from Debian's archive (mmdebstrap, minbase)"
  mmdebstrap --quiet --variant=minbase --mode=root --format=tar bookworm "$work/base.tar"
  podman import --quiet "$work/base.tar" "$base" >/dev/null
fi
ca=${MTCFS_BUILD_CA:-/etc/ssl/certs/ca-certificates.crt}
ca_args=()
if [ -f "$ca" ]; then
  ca_args=(--volume "$ca:/run/build-ca.crt:ro" --build-arg PIP_CERT=/run/build-ca.crt)
fi
echo "build-image: podman build -t $tag"
podman build --quiet --isolation=chroot --pull=never "${ca_args[@]}" \
  -f deploy/kubernetes/Containerfile -t "$tag" .
