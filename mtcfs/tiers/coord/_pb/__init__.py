"""Generated protobuf and grpc code of proto/etcd_v3_subset.proto (package etcdserverpb).

Do not edit the ``etcd_v3_subset_pb2*`` files: change the .proto and run
``scripts/gen_proto.sh``. This ``__init__.py`` is the only hand-written file here.
"""
