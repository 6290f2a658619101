"""etcd's v3 API messages (our generated subset, coord/_pb) for the modules outside
``mtcfs.tiers.coord`` that build requests for :class:`mtcfs.tiers.coord.etcd.Etcd`
(transactions, ranges, watches)."""

from mtcfs.tiers.coord._pb import etcd_v3_subset_pb2 as pb

__all__ = ["pb"]
