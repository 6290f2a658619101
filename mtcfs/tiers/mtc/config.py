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

import reprlib
from dataclasses import dataclass, field
from typing import Any

import yaml

from mtcfs.base.limits import MAX_NODES, MAX_STEP

#: Keys Orbax writes and keys Google's replicator also accepts (ignored here but allowed).
KNOWN_KEYS = {"job-name", "framework", "assume-data-parallelism", "node-rank", "nodes",
              "peer-ranks", "backup-interval-minutes", "backup-interval-steps",
              "workers-per-node", "master-port", "peers-per-node", "master"}


#: Orbax's default ``backup-interval-minutes``, used when the yaml gives no interval.
DEFAULT_BACKUP_MINUTES = 30
#: Longest ``backup-interval-minutes`` accepted: 30 days, as the mount option allows.
MAX_BACKUP_MINUTES = 30 * 24 * 60
#: Largest replicator.yaml read, bytes (Orbax writes about ten short lines).
MAX_YAML_BYTES = 64 * 1024
#: Deepest nesting of ``[`` and ``{`` read: PyYAML's scanner slows down with the square of
#: it (8,000 levels: a second), and nothing Orbax writes nests.
MAX_FLOW_DEPTH = 32

#: repr() for messages: a value from the file is shown cut short (an alias bomb would print
#: billions of elements).
_short = reprlib.Repr()
_short.maxlevel, _short.maxlist, _short.maxdict, _short.maxstring, _short.maxother = (
    2, 4, 4, 40, 40)


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


def _int(doc: dict[str, Any], key: str, *, low: int, high: int,
         required: bool = True) -> int | None:
    if key not in doc or doc[key] is None:
        if required:
            raise ReplicatorConfigError(f"replicator.yaml: {key} is missing")
        return None
    v = doc[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ReplicatorConfigError(f"replicator.yaml: {key}: {_short.repr(v)} is not an"
                                    " integer")
    if v < low:
        raise ReplicatorConfigError(f"replicator.yaml: {key}: {_short.repr(v)} is below {low}")
    if v > high:
        raise ReplicatorConfigError(f"replicator.yaml: {key}: {_short.repr(v)} is too large"
                                    f" (at most {high})")
    return v


def _text(doc: dict[str, Any], key: str) -> str:
    """A scalar value as text ("" when absent); a list or mapping is refused."""
    v = doc.get(key)
    if isinstance(v, (list, dict, set)):
        raise ReplicatorConfigError(f"replicator.yaml: {key}: expected a string, not a"
                                    f" {type(v).__name__}")
    return "" if v is None else str(v)


# PyYAML ships no type information (pyproject.toml: ignore_missing_imports), so its
# SafeLoader is Any to mypy: subclassing it is what this class is for.
class _Loader(yaml.SafeLoader):  # type: ignore[misc]
    """yaml.SafeLoader whose numbers and dates that cannot be read (an int of more than 4300
    digits, 2001-02-30) are a YAMLError naming where they are, not a bare ValueError."""

    def _checked(self, construct: Any, node: yaml.Node) -> Any:
        try:
            return construct(self, node)
        except ValueError as exc:
            shown = node.value if len(node.value) <= 20 else node.value[:20] + "..."
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read {shown!r}: {exc}", node.start_mark) from None


for _tag, _construct in (("int", yaml.SafeLoader.construct_yaml_int),
                         ("timestamp", yaml.SafeLoader.construct_yaml_timestamp)):
    _Loader.add_constructor(f"tag:yaml.org,2002:{_tag}",
                            lambda self, node, c=_construct: self._checked(c, node))


def _load(text: str) -> Any:
    """yaml.safe_load within the bounds above, every failure as ReplicatorConfigError."""
    if len(text) > MAX_YAML_BYTES:
        raise ReplicatorConfigError(f"replicator.yaml: {len(text)} characters; at most"
                                    f" {MAX_YAML_BYTES}")
    depth = deepest = 0
    for c in text:  # brackets inside quotes count too: an over-estimate is fine here
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}" and depth:
            depth -= 1
    if deepest > MAX_FLOW_DEPTH:
        raise ReplicatorConfigError(f"replicator.yaml: nested {deepest} levels deep; at"
                                    f" most {MAX_FLOW_DEPTH}")
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        why = " ".join(str(exc).split())
        raise ReplicatorConfigError(f"replicator.yaml is not valid YAML: {why}") from None
    except RecursionError:  # block nesting ("- - - ...") past Python's recursion limit
        raise ReplicatorConfigError("replicator.yaml: nested too deeply") from None


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
        ReplicatorConfigError: not YAML, longer than :data:`MAX_YAML_BYTES` or nested
            deeper than :data:`MAX_FLOW_DEPTH`, not a mapping, a required key missing, a
            value of the wrong type (``job-name`` and ``framework`` are scalars), a number
            outside its bounds (``nodes`` at most 65,536, ``backup-interval-minutes`` at most
            :data:`MAX_BACKUP_MINUTES`), a rank out of range or not this node's, a peer equal
            to this node or given twice, ``nodes`` different from the job's,
            ``assume-data-parallelism`` not dividing ``nodes``, or both backup intervals.
            The message is one line.
    """
    doc = _load(text)
    if not isinstance(doc, dict):
        raise ReplicatorConfigError("replicator.yaml: expected 'key: value' lines")
    warnings = [f"replicator.yaml: unknown key {_short.repr(k)} ignored"
                for k in sorted(doc, key=str) if k not in KNOWN_KEYS]
    n = _int(doc, "nodes", low=1, high=MAX_NODES)
    assert n is not None
    if nodes is not None and n != nodes:
        raise ReplicatorConfigError(
            f"replicator.yaml: nodes: {n}, but this job's mounts have nodes={nodes}")
    r = _int(doc, "node-rank", low=0, high=MAX_NODES - 1)
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
        raise ReplicatorConfigError(f"replicator.yaml: peer-ranks: {_short.repr(peers_raw)} is"
                                    " not a list of integers")
    for p in peers_raw:
        if not 0 <= p < n:
            raise ReplicatorConfigError(f"replicator.yaml: peer-ranks: {p} is out of range for"
                                        f" nodes: {n} (0..{n - 1})")
        if p == r:
            raise ReplicatorConfigError(f"replicator.yaml: peer-ranks: {p} is this node"
                                        f" (node-rank: {r}); a node cannot be its own peer")
    if len(set(peers_raw)) != len(peers_raw):
        raise ReplicatorConfigError(f"replicator.yaml: peer-ranks: {_short.repr(peers_raw)}"
                                    " names a rank twice")
    dp = _int(doc, "assume-data-parallelism", low=1, high=MAX_NODES, required=False)
    if dp is not None and n % dp:
        raise ReplicatorConfigError(f"replicator.yaml: assume-data-parallelism: {dp} does not"
                                    f" divide nodes: {n}")
    minutes = _int(doc, "backup-interval-minutes", low=1, high=MAX_BACKUP_MINUTES,
                   required=False)
    steps = _int(doc, "backup-interval-steps", low=1, high=MAX_STEP, required=False)
    if minutes is not None and steps is not None:
        raise ReplicatorConfigError("replicator.yaml: give exactly one of"
                                    " backup-interval-minutes and backup-interval-steps")
    if minutes is None and steps is None:  # older writers (axlearn, early MaxText)
        minutes = DEFAULT_BACKUP_MINUTES
        warnings.append("replicator.yaml: no backup interval; backing up every"
                        f" {minutes} minutes (Orbax's default)")
    framework = _text(doc, "framework")
    if framework and framework != "orbax":
        warnings.append(f"replicator.yaml: framework: {_short.repr(framework)}; mtcfs speaks"
                        " the orbax protocol")
    return ReplicatorConfig(job_name=_text(doc, "job-name"), framework=framework,
                            node_rank=r, nodes=n, peer_ranks=tuple(peers_raw),
                            assume_data_parallelism=dp, backup_interval_minutes=minutes,
                            backup_interval_steps=steps, warnings=tuple(warnings))
