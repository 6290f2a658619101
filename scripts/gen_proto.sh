#!/usr/bin/env bash
# Regenerate the Python code of proto/mtcfs_peer.proto into replication/peer/_pb/ (or into the
# directory given as $1). The only command that writes the generated files; run it after any
# change to the .proto and commit its output (tests/t1_proto_test.py fails on stale code).
#
# Uses grpc_tools.protoc from the project's virtual environment (override with $PYTHON), so the
# output depends only on the .proto and the pinned grpcio-tools version.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
out=${1:-replication/peer/_pb}
mkdir -p "$out"
"$py" -m grpc_tools.protoc -I proto \
  --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
  proto/mtcfs_peer.proto
# protoc writes a top-level import in the service module; the code lives in a package.
sed -i 's/^import mtcfs_peer_pb2 as mtcfs__peer__pb2$/from . import mtcfs_peer_pb2 as mtcfs__peer__pb2/' \
  "$out/mtcfs_peer_pb2_grpc.py"
grep -q '^from \. import mtcfs_peer_pb2 as' "$out/mtcfs_peer_pb2_grpc.py" \
  || { echo "gen_proto: the import fix-up no longer matches protoc's output" >&2; exit 1; }
