#!/usr/bin/env bash
# Regenerate the Python code of the .proto files in proto/: mtcfs_peer.proto into
# mtcfs/tiers/peer/_pb/ and etcd_v3_subset.proto into mtcfs/tiers/coord/_pb/ (or into
# $1/peer and $1/coord when a directory is given). The only command that writes the
# generated files; run it after any change to a .proto and commit its output
# (tests/t1_proto_test.py fails on stale code).
#
# Uses grpc_tools.protoc from the project's virtual environment (override with $PYTHON), so the
# output depends only on the .proto and the pinned grpcio-tools version.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
if [ $# -gt 0 ]; then
  peer_out=$1/peer coord_out=$1/coord
else
  peer_out=mtcfs/tiers/peer/_pb coord_out=mtcfs/tiers/coord/_pb
fi

gen() {  # gen PROTO_BASENAME OUT_DIR
  local name=$1 out=$2
  mkdir -p "$out"
  "$py" -m grpc_tools.protoc -I proto \
    --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" "proto/$name.proto"
  # protoc writes a top-level import in the service module; the code lives in a package.
  sed -i "s/^import ${name}_pb2 as \(.*\)$/from . import ${name}_pb2 as \1/" "$out/${name}_pb2_grpc.py"
  grep -q "^from \. import ${name}_pb2 as" "$out/${name}_pb2_grpc.py" \
    || { echo "gen_proto: the import fix-up no longer matches protoc's output" >&2; exit 1; }
}
gen mtcfs_peer "$peer_out"
gen etcd_v3_subset "$coord_out"
