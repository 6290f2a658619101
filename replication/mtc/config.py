"""``replicator.yaml``: what Orbax's multi-tier checkpointing tells the node's replicator.

Orbax's ``ReplicatorCheckpointManager`` (and MaxText with ``enable_multi_tier_checkpointing``)
writes this file once per host into the local checkpoint directory, as plain ``key: value``
lines (../shared/reference/orbax-mtc-protocol.md)::

    job-name: my-run
    framework: orbax
    assume-data-parallelism: 2
    node-rank: 1
    nodes: 4
    peer-ranks: [3]
    backup-interval-minutes: 30

This module turns the text into a :class:`ReplicatorConfig` and checks it. A problem the job
cannot run with is a :class:`ReplicatorConfigError` (the replicator writes its message to
``replicator.failed``, and Orbax raises RuntimeError with it); a problem it can run with is
returned as a warning (written to ``replicator.errors``, which Orbax logs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

#: Keys Orbax writes and keys Google's replicator also accepts (ignored here but allowed).
KNOWN_KEYS = {"job-name", "framework", "assume-data-parallelism", "node-rank", "nodes",
              "peer-ranks", "backup-interval-minutes", "backup-interval-steps",
              "workers-per-node", "master-port", "peers-per-node", "master"}


#: Orbax's default ``backup-interval-minutes``, used when the yaml gives no interval.
DEFAULT_BACKUP_MINUTES = 30


class ReplicatorConfigError(ValueError):
    """``replicator.yaml`` cannot be used; the message names the key and the problem."""


@dataclass(frozen=True)
class ReplicatorConfig:
    """A validated ``replicator.yaml``.

    Attributes:
        job_name: the run's name (``job-name``), "" when absent.
        framework: ``framework`` (Orbax writes "orbax").
        node_rank: this node's rank, 0 <= node_rank < nodes.
        nodes: ranks in the job.
        peer_ranks: the ranks that hold this node's replicas: unique, not this node.
        assume_data_parallelism: data-parallel replicas (dividing ``nodes``), or None.
        backup_interval_minutes, backup_interval_steps: exactly one is set (Google's public
            replicator reads only the minutes; mtcfs honours both).
        warnings: problems the job can run with (for ``replicator.errors``).
    """

    job_name: str
    framework: str
    node_rank: int
    nodes: int
    peer_ranks: tuple[int, ...]
    assume_data_parallelism: int | None
    backup_interval_minutes: int | None
    backup_interval_steps: int | None
    warnings: tuple[str, ...] = field(default=())


def _int(doc: dict[str, Any], key: str, *, low: int, required: bool = True) -> int | None:
    if key not in doc or doc[key] is None:
        if required:
            raise ReplicatorConfigError(f"replicator.yaml: {key} is missing")
        return None
    v = doc[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ReplicatorConfigError(f"replicator.yaml: {key}: {v!r} is not an integer")
    if v < low:
        raise ReplicatorConfigError(f"replicator.yaml: {key}: {v} is below {low}")
    return v


def parse_replicator_yaml(text: str, *, nodes: int | None = None,
                          rank: int | None = None) -> ReplicatorConfig:
    """Parse and check ``replicator.yaml``.

    Args:
        text: the file's content.
        nodes: the job's node count as this mount knows it (``nodes=``), to check against.
        rank: this node's rank as this mount knows it (``rank=``), to check against.

    Returns:
        The configuration, with warnings for what the job can run with.

    Raises:
        ReplicatorConfigError: not YAML, not a mapping, a required key missing, a value of
            the wrong type, a rank out of range or not this node's, a peer equal to this node or given twice,
            ``nodes`` different from the job's, ``assume-data-parallelism`` not dividing
            ``nodes``, or both backup intervals.
    """
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ReplicatorConfigError(f"replicator.yaml is not valid YAML: {exc}") from None
    if not isinstance(doc, dict):
        raise ReplicatorConfigError("replicator.yaml: expected 'key: value' lines")
    warnings = [f"replicator.yaml: unknown key {k!r} ignored" for k in sorted(doc, key=str)
                if k not in KNOWN_KEYS]
    n = _int(doc, "nodes", low=1)
    assert n is not None
    if nodes is not None and n != nodes:
        raise ReplicatorConfigError(
            f"replicator.yaml: nodes: {n}, but this job's mounts have nodes={nodes}")
    r = _int(doc, "node-rank", low=0)
    assert r is not None
    if r >= n:
        raise ReplicatorConfigError(f"replicator.yaml: node-rank: {r} is out of range for"
                                    f" nodes: {n} (0..{n - 1})")
    if rank is not None and r != rank:
        # The ranks in peer-ranks are JAX process indices; they name this job's nodes only
        # if each process runs on the node of its rank (what jax-init-info.txt told it).
        raise ReplicatorConfigError(f"replicator.yaml: node-rank: {r}, but this node is"
                                    f" rank={rank} (the process id in jax-init-info.txt)")
    peers_raw = doc.get("peer-ranks", [])
    if peers_raw is None:
        peers_raw = []
    if not isinstance(peers_raw, list) or any(isinstance(p, bool) or not isinstance(p, int)
                                              for p in peers_raw):
        raise ReplicatorConfigError(f"replicator.yaml: peer-ranks: {peers_raw!r} is not a list"
                                    " of integers")
    for p in peers_raw:
        if not 0 <= p < n:
            raise ReplicatorConfigError(f"replicator.yaml: peer-ranks: {p} is out of range for"
                                        f" nodes: {n} (0..{n - 1})")
        if p == r:
            raise ReplicatorConfigError(f"replicator.yaml: peer-ranks: {p} is this node"
                                        f" (node-rank: {r}); a node cannot be its own peer")
    if len(set(peers_raw)) != len(peers_raw):
        raise ReplicatorConfigError(f"replicator.yaml: peer-ranks: {peers_raw} names a rank"
                                    " twice")
    dp = _int(doc, "assume-data-parallelism", low=1, required=False)
    if dp is not None and n % dp:
        raise ReplicatorConfigError(f"replicator.yaml: assume-data-parallelism: {dp} does not"
                                    f" divide nodes: {n}")
    minutes = _int(doc, "backup-interval-minutes", low=1, required=False)
    steps = _int(doc, "backup-interval-steps", low=1, required=False)
    if minutes is not None and steps is not None:
        raise ReplicatorConfigError("replicator.yaml: give exactly one of"
                                    " backup-interval-minutes and backup-interval-steps")
    if minutes is None and steps is None:  # older writers (axlearn, early MaxText)
        minutes = DEFAULT_BACKUP_MINUTES
        warnings.append("replicator.yaml: no backup interval; backing up every"
                        f" {minutes} minutes (Orbax's default)")
    framework = str(doc.get("framework") or "")
    if framework and framework != "orbax":
        warnings.append(f"replicator.yaml: framework: {framework!r}; mtcfs speaks the orbax"
                        " protocol")
    return ReplicatorConfig(job_name=str(doc.get("job-name") or ""), framework=framework,
                            node_rank=r, nodes=n, peer_ranks=tuple(peers_raw),
                            assume_data_parallelism=dp, backup_interval_minutes=minutes,
                            backup_interval_steps=steps, warnings=tuple(warnings))
