"""The namespace log: where the core's namespace ops go to be ordered and applied.

Every namespace change of the core is a typed op (:mod:`mtcfs.base.ns_ops`) submitted to
the mount's :class:`NamespaceLog`; the log decides the op's place in the order and has the
core apply it (``JobNamespace.apply_op``, the one apply path), then answers the submitter
with the op's result or the errno that refused it.

* scope=node: :class:`LocalLog`, this module. Only this mount changes the namespace, so an
  op is applied at once, in the submitter's trio step; reads are always current.
* scope=job: ``EtcdNamespace`` (:mod:`mtcfs.tiers.namespace.etcd_log`): etcd orders the ops
  of every node, and every node applies them in that order (``Filesystem.ns_apply``, which
  also records the log position); reads wait for the ops etcd acknowledged before them.

The core tells the scopes apart only by :attr:`NamespaceLog.replicated`, for what is not
a namespace op (publishing a closed file's content job-wide, eviction rules, the kernel's
cache timeouts).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from mtcfs.base.ns_ops import NsOp
from mtcfs.core.model import Version


@runtime_checkable
class NamespaceLog(Protocol):
    """What the core needs of a namespace log.

    Attributes:
        replicated: True when other nodes change the same namespace (scope=job): the core
            then publishes sealed versions, renumbers files for the kernel, never caches
            attributes.
        unavailable: True while this node's copy cannot be made current (the log's last
            call failed, or the node waits for room in its store for the next op); the
            core then answers the root's and open files' attributes from its own copy.
    """

    replicated: bool

    @property
    def unavailable(self) -> bool: ...

    async def submit(self, op: NsOp) -> dict[str, Any]:
        """Order ``op``, have this node apply it, and return its result (``{"ino"}`` for
        ops that make an entry, ``{"ino", "existed"}`` for create, ``{}`` otherwise).

        Raises:
            FsError: the errno that refused the op when it was applied; EIO when the log
                could not order or apply it in time.
        """
        ...

    async def fresh(self) -> None:
        """A read barrier: return once this node applied every op the log ordered before
        the call. The core awaits it only where :attr:`replicated` (a log that is not
        replicated is this node's own: nothing is ever ahead of its copy).

        Raises:
            FsError: EIO when the log cannot say in time.
        """
        ...


class Applier(Protocol):
    """What :class:`LocalLog` needs of the core: its one apply path."""

    def apply_op(self, op: NsOp) -> tuple[dict[str, Any], list[Version]]: ...

    def check_room(self, op: NsOp) -> None: ...


class LocalLog:
    """scope=node's log: the op is applied at once (no order to agree on, nothing to wait
    for). The op's envelope stays empty (no apply function reads it in scope=node).

    Args:
        fs: the apply path (``apply_op``: :class:`~mtcfs.core.jobns.JobNamespace`).
    """

    replicated = False
    unavailable = False

    def __init__(self, fs: Applier) -> None:
        self.fs = fs
        #: ops applied (and refused) since the mount, for tests and status
        self.applied = 0

    async def submit(self, op: NsOp) -> dict[str, Any]:
        """Apply ``op`` now; its result.

        Raises:
            FsError: the errno with which applying refused it.
            OSError: ENOSPC when the store's filesystem has no room for the op's rows
                (checked before anything changes: ``check_room``).
        """
        self.fs.check_room(op)
        self.applied += 1
        res, _keep = self.fs.apply_op(op)
        return res

    async def fresh(self) -> None:
        """Nothing to wait for: this node's copy is the namespace."""

    def status(self) -> dict[str, Any]:
        """The namespace's part of ``mtcfs status`` (scope=node)."""
        return {"engine": "local", "ops_applied": self.applied}
