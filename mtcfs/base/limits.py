"""Bounds shared by the mount options (mtcfs/options.py) and Orbax's replicator.yaml
(mtcfs/tiers/mtc/config.py): both read the same numbers about a job."""

#: The most nodes a job may have (``nodes=``, ``rank=`` < it, ``assume_data_parallelism=``).
MAX_NODES = 65536
#: The largest training step number (a signed 64-bit integer, as Orbax writes it).
MAX_STEP = 2 ** 63 - 1
#: Most topology labels a node may carry, and the longest name or value of one, in
#: characters (``topology=``; every peer's member view refuses a record past these).
MAX_LABELS = 64
MAX_LABEL_LEN = 256
#: Most bytes the labels may take in a member record (JSON, non-ASCII escaped): well within
#: the 64 KiB a member record may have (mtcfs/tiers/coord/membership.py MAX_MEMBER_BYTES).
MAX_LABELS_BYTES = 16 * 1024
