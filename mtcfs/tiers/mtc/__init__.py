"""Orbax / MaxText multi-tier checkpointing on mtcfs (issue 5, in progress): mtcfs as the
node's replicator, speaking Orbax's file protocol in the local checkpoint directory.

* :mod:`.config` — ``replicator.yaml``: parse and check (done).
"""
