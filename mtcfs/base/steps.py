"""Checkpoint (step) naming and commit detection rules.

A checkpoint is a top-level directory of the job whose name carries a step number:
``100``, ``step_100``, ``step-100``, ``checkpoint-100``, ``checkpoint_100``, ``ckpt_100``,
``iter_0000100``, ``global_step100`` (the names DCP scripts, Orbax, NeMo/Megatron and HF
Trainer use). It is **committed** (complete on this node) when the library commits it:

- Orbax: ``rename(<step>.orbax-checkpoint-tmp-<ts> -> <step>)`` at the job root, or a
  sealed ``commit_success.txt`` in the step directory;
- PyTorch DCP: a sealed ``.metadata`` in the step directory (DCP writes it last, after a
  barrier, by renaming ``.metadata.tmp``);
- Orbax multi-tier restore: ``rename(<job>-s<step>-n<rank>-w0.restore -> <step>)`` at the
  job root, the step the replicator restored (mount option ``mtc``);
- explicitly: ``mtcfs seal PATH``.

An **unfinished save**, by its library's own definition (what a crash leaves; see
``crash_leftovers`` in core/eviction.py and docs/usage.md, "Capacity and eviction"):

- PyTorch DCP: a step directory holding ``*.distcp`` shards (and perhaps ``.metadata.tmp``)
  and no ``.metadata``;
- Orbax: a ``<step>.orbax-checkpoint-tmp-<ts>`` directory (not yet renamed).

A directory of plain files (torch.save, HF ``checkpoint-N``) is never one: such a save is
committed by ``mtcfs seal``, and may be finished although not sealed.
"""

from __future__ import annotations

import re

_STEP_RE = re.compile(
    r"^(?:(?:step|checkpoint|ckpt|iter|global_step|epoch)[_-]?)?(\d{1,18})$", re.IGNORECASE)

#: Temporary directory names Orbax writes a step into before its commit rename.
ORBAX_TMP_MARK = ".orbax-checkpoint-tmp"

#: DCP's shard files (``__<rank>_<n>.distcp``) and the temporary name of its ``.metadata``
#: (written, then renamed, last).
DCP_SHARD_SUFFIX = ".distcp"
DCP_METADATA_TMP = b".metadata.tmp"

#: File names whose seal inside a step directory commits the step, with the source label.
COMMIT_FILES = {
    b"commit_success.txt": "commit_success.txt",
    b".metadata": ".metadata",
}


def step_number(name: str | bytes) -> int | None:
    """Return the step number a top-level directory name denotes, or None.

    >>> step_number("step_100"), step_number("100"), step_number("100.orbax-checkpoint-tmp-1")
    (100, 100, None)
    """
    if isinstance(name, bytes):
        try:
            name = name.decode()
        except UnicodeDecodeError:
            return None
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


#: Orbax's multi-tier restore marker (``<job>-s<step>-n<rank>-w<worker>.restore``): the
#: replicator presents the step to restore under this name and Orbax renames it to
#: ``<step>`` (orbax.checkpoint.experimental.emergency.multi_tier_checkpointing).
RESTORE_MARKER_RE = re.compile(r"^.+-s(\d+)-n\d+-w\d+\.restore$")


def restore_marker_step(name: str | bytes) -> int | None:
    """The step number of an Orbax restore marker name, or None.

    >>> restore_marker_step("run-s30-n1-w0.restore"), restore_marker_step("30")
    (30, None)
    """
    if isinstance(name, bytes):
        name = name.decode(errors="replace")
    m = RESTORE_MARKER_RE.match(name)
    return int(m.group(1)) if m else None


def is_orbax_tmp(name: str | bytes) -> bool:
    """True for Orbax's uncommitted step directory names."""
    if isinstance(name, bytes):
        name = name.decode(errors="replace")
    return ORBAX_TMP_MARK in name


def orbax_tmp_step(name: str | bytes) -> int | None:
    """The step number of an Orbax temporary directory name, or None.

    >>> orbax_tmp_step("100.orbax-checkpoint-tmp-17"), orbax_tmp_step("100")
    (100, None)
    """
    if isinstance(name, bytes):
        name = name.decode(errors="replace")
    if ORBAX_TMP_MARK not in name:
        return None
    return step_number(name.split(ORBAX_TMP_MARK, 1)[0])


def is_dcp_file(name: str | bytes) -> bool:
    """True for the files DCP writes before its ``.metadata``: shards, ``.metadata.tmp``."""
    if isinstance(name, str):
        name = name.encode(errors="surrogateescape")
    return name.endswith(DCP_SHARD_SUFFIX.encode()) or name == DCP_METADATA_TMP
