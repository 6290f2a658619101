#!/usr/bin/env bash
# Build libfuse 3.17.2 and pyfuse3 3.5.0 with mtcfs's patch into the virtual environment
# (.venv/libfuse, then pyfuse3 in .venv's site-packages, linked to that libfuse by rpath).
#
# Why: with libfuse >= 3.17 the FUSE connection can negotiate FUSE passthrough (the kernel
# reads and writes the store's files itself, docs/passthrough.md) and FUSE_HANDLE_KILLPRIV_V2
# (no GETXATTR before every write(2), docs/fuse-build.md).
# Debian 12's libfuse is 3.14, which cannot. Sources: libfuse from Debian's archive (the
# tarball of Debian 13's fuse3 3.17.2 package), pyfuse3 from PyPI, both checked against
# pinned SHA-256 sums. On a system whose libfuse3-dev is already >= 3.17 (Debian 13), only
# pyfuse3 is built, against it.
#
# Called by scripts/setup.sh before mtcfs is installed; idempotent (a stamp in .venv).
# Exit status 0 when the patched pyfuse3 is installed, 1 (with one line on stderr) when it
# could not be: setup then goes on with the stock pyfuse3, which works without the flag.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
# MTCFS_VENV: another virtual environment (the image's /opt/mtcfs, deploy/kubernetes/Containerfile)
venv=${MTCFS_VENV:-$root/.venv}
prefix=$venv/libfuse

libfuse_version=3.17.2
libfuse_config="-Dutils=false -Dexamples=false -Dtests=false -Dc_args=-DIGNORE_MTAB"
libfuse_url=http://deb.debian.org/debian/pool/main/f/fuse3/fuse3_${libfuse_version}.orig.tar.gz
libfuse_sha256=3d932431ad94e86179e5265cddde1d67aa3bb2fb09a5bd35c641f86f2b5ed06f
pyfuse3_version=3.5.0
pyfuse3_sha256=88399a9494b88603230bba300f4ba9ad63fece5ed514ca3633d555a0c6a42b24
# Applied in this order; each says what it asks the kernel for and why.
patches="$root/third_party/pyfuse3/killpriv-v2.patch $root/third_party/pyfuse3/direct-io-allow-mmap.patch $root/third_party/pyfuse3/passthrough.patch $root/third_party/pyfuse3/fallocate.patch"

stamp=$venv/.mtcfs-fuse-built
want=$( { echo "$libfuse_version $libfuse_config $libfuse_sha256 $pyfuse3_version $pyfuse3_sha256"; cat $patches; } | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
    && "$venv/bin/python" -c "import pyfuse3, sys; sys.exit(not hasattr(pyfuse3, 'passthrough') or not hasattr(pyfuse3.Operations, 'fallocate'))" 2>/dev/null; then
  exit 0
fi

work=$(mktemp -d /tmp/mtcfs-fuse-build.XXXXXX)
trap 'rm -rf "$work"' EXIT
log=$work/build.log
: > "$log"
fail() {
  cp "$log" /tmp/mtcfs-fuse-build.log 2>/dev/null || true
  tail -n 12 "$log" | sed 's/^/  | /' >&2  # (a container build keeps no /tmp)
  echo "setup: WARNING: $1; mtcfs goes on with the stock pyfuse3, which cannot stop the GETXATTR before every write (docs/fuse-build.md; log: /tmp/mtcfs-fuse-build.log)" >&2
  exit 1
}

check_sum() {  # FILE SHA256
  echo "$2  $1" | sha256sum -c --status || fail "checksum mismatch for $(basename "$1")"
}

pkg_config_path=
if pkg-config --atleast-version=3.17 fuse3 2>/dev/null; then
  echo "setup: system libfuse $(pkg-config --modversion fuse3) is new enough; building pyfuse3 only"
  ldflags=
else
  echo "setup: building libfuse $libfuse_version into $prefix (Debian 12 has $(pkg-config --modversion fuse3 2>/dev/null || echo none))"
  curl -fsSL --retry 3 --max-time 120 -o "$work/libfuse.tar.gz" "$libfuse_url" >>"$log" 2>&1 \
    || fail "could not download $libfuse_url"
  check_sum "$work/libfuse.tar.gz" "$libfuse_sha256"
  tar -xzf "$work/libfuse.tar.gz" -C "$work"
  src=$work/fuse-$libfuse_version
  # The library and its headers only: mount.fuse3, fusermount3 and the udev rule stay the
  # distribution's (the daemon mounts with mount(2) as root; fusermount3's protocol is stable).
  # No /etc/mtab updates (IGNORE_MTAB; /etc/mtab is a link to /proc/self/mounts): with
  # them, libfuse as root forks /bin/mount after mount(2) and /bin/umount to unmount, from
  # the daemon, whose gRPC threads make the child abort; the mount is then undone
  # ("fuse_session_mount failed"). 3.17.2's meson option disable-mtab does not reach the
  # library, so the define is passed directly.
  (meson setup "$src/build" "$src" --prefix="$prefix" --libdir=lib --buildtype=release \
      $libfuse_config \
    && ninja -C "$src/build" install) >>"$log" 2>&1 || fail "libfuse $libfuse_version did not build"
  pkg_config_path=$prefix/lib/pkgconfig
  # -L first: a Python built with --enable-shared (Debian's own python3) links extensions
  # with -L its LIBDIR (/usr/lib/x86_64-linux-gnu) ahead of pkg-config's -L, where Debian's
  # libfuse3.so (3.14) was found first; the module then did not import
  # (fuse_session_new_versioned). LDFLAGS come before both.
  ldflags="-L$prefix/lib -Wl,-rpath,$prefix/lib"
fi

"$venv/bin/pip" download -q --disable-pip-version-check --no-deps --no-binary :all: \
    "pyfuse3==$pyfuse3_version" -d "$work" >>"$log" 2>&1 || fail "could not download pyfuse3 $pyfuse3_version"
check_sum "$work/pyfuse3-$pyfuse3_version.tar.gz" "$pyfuse3_sha256"
tar -xzf "$work/pyfuse3-$pyfuse3_version.tar.gz" -C "$work"
for p in $patches; do
  (cd "$work/pyfuse3-$pyfuse3_version" && patch -p1 --quiet < "$p") >>"$log" 2>&1 \
    || fail "mtcfs's pyfuse3 patch $(basename "$p") did not apply"
done
PKG_CONFIG_PATH=$pkg_config_path LDFLAGS=$ldflags \
  "$venv/bin/pip" install -q --disable-pip-version-check --no-cache-dir --force-reinstall --no-deps \
    "$work/pyfuse3-$pyfuse3_version" >>"$log" 2>&1 || fail "pyfuse3 $pyfuse3_version did not build"
"$venv/bin/pip" install -q --disable-pip-version-check "trio>=0.15" >>"$log" 2>&1 || true
"$venv/bin/python" -c "import pyfuse3; assert hasattr(pyfuse3, 'passthrough')" >>"$log" 2>&1 \
  || fail "the built pyfuse3 does not import"
echo "$want" > "$stamp"
echo "setup: pyfuse3 $pyfuse3_version built against libfuse $(PKG_CONFIG_PATH=$pkg_config_path pkg-config --modversion fuse3)"
