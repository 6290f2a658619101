"""The replicator: peer service, peer selection, coordination through etcd, backup tier and
restore.

Subpackages are imported explicitly (``from mtcfs.tiers.backup import BackupStore``); this
package itself imports nothing so that loading one part does not pull in the others.
"""
