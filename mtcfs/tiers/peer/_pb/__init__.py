"""Generated protobuf and grpc code of proto/mtcfs_peer.proto (package mtcfs.peer.v1).

Do not edit the ``mtcfs_peer_pb2*`` files: change the .proto and run ``scripts/gen_proto.sh``.
This ``__init__.py`` is the only hand-written file here.
"""
