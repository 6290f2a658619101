"""Tier-1 test: the committed generated code of proto/*.proto is not stale.

Regenerates with scripts/gen_proto.sh into a temporary directory and compares with
mtcfs/tiers/peer/_pb/ and mtcfs/tiers/coord/_pb/. When the installed grpcio-tools differs from the one the committed
code was made with, lines that only carry the generator's version are ignored.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED = {"peer": ("mtcfs_peer_pb2.py", "mtcfs_peer_pb2_grpc.py", "mtcfs_peer_pb2.pyi"),
             "coord": ("etcd_v3_subset_pb2.py", "etcd_v3_subset_pb2_grpc.py",
                       "etcd_v3_subset_pb2.pyi")}
_VERSION_LINE = re.compile(
    r"^(# Protobuf Python Version: .*|GRPC_GENERATED_VERSION = .*|\s+\d+,)$")


def _generator_version(text: str) -> str | None:
    m = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'", text, re.MULTILINE)
    return m.group(1) if m else None


def _strip_versions(text: str) -> list[str]:
    return [line for line in text.splitlines() if not _VERSION_LINE.match(line)]


def test_generated_code_is_current(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run([str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True,
                   env=env, cwd=ROOT, timeout=120)
    for part, names in GENERATED.items():
        committed_dir = ROOT / "mtcfs" / "tiers" / part / "_pb"
        same_tools = (_generator_version((committed_dir / names[1]).read_text())
                      == version("grpcio-tools"))
        for name in names:
            fresh = (tmp_path / part / name).read_text()
            committed = (committed_dir / name).read_text()
            if same_tools:
                same = fresh == committed
            else:
                same = _strip_versions(fresh) == _strip_versions(committed)
            assert same, (f"mtcfs/tiers/{part}/_pb/{name} is stale: run scripts/gen_proto.sh "
                          f"and commit the result")


def test_generated_code_imports_as_a_package():
    from mtcfs.tiers.peer._pb import mtcfs_peer_pb2 as pb
    from mtcfs.tiers.peer._pb import mtcfs_peer_pb2_grpc as pb_grpc
    assert pb.DESCRIPTOR.package == "mtcfs.peer.v1"
    names = {m.name for m in pb.DESCRIPTOR.services_by_name["Peer"].methods}
    assert names == {"HasChunks", "PutChunks", "GetChunks", "OpenChunkStream",
                     "PublishManifest", "ListManifests"}
    assert set(pb.DESCRIPTOR.services_by_name) == {"Peer"}  # membership and votes: etcd
    assert hasattr(pb_grpc, "PeerStub") and hasattr(pb_grpc, "add_PeerServicer_to_server")


def test_etcd_stubs_use_etcds_service_names():
    """The method paths on the wire are etcd's own (/etcdserverpb.KV/Range, ...)."""
    from mtcfs.tiers.coord._pb import etcd_v3_subset_pb2 as pb
    assert pb.DESCRIPTOR.package == "etcdserverpb"
    methods = {s: {m.name for m in pb.DESCRIPTOR.services_by_name[s].methods}
               for s in ("KV", "Watch", "Lease", "Maintenance")}
    assert methods == {"KV": {"Range", "Put", "DeleteRange", "Txn", "Compact"},
                       "Watch": {"Watch"},
                       "Lease": {"LeaseGrant", "LeaseRevoke", "LeaseKeepAlive"},
                       "Maintenance": {"Status"}}
