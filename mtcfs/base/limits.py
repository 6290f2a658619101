"""Bounds shared by the mount options (mtcfs/options.py) and Orbax's replicator.yaml
(mtcfs/tiers/mtc/config.py): both read the same numbers about a job."""

#: The most nodes a job may have (``nodes=``, ``rank=`` < it, ``assume_data_parallelism=``).
MAX_NODES = 65536
#: The largest training step number (a signed 64-bit integer, as Orbax writes it).
MAX_STEP = 2 ** 63 - 1
