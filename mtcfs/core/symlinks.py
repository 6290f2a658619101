"""The symlink rule: a symlink in the mount never points outside it (docs/security-local.md).

A target is refused when it is absolute, or when it is relative and, read from the link's
own directory, climbs above the mount's root. Only leading ``..`` components may climb: the
kernel resolves ``name/..`` as the parent of whatever ``name`` is, which may itself be a
symlink (``dot -> .`` makes ``dot/..`` the parent of the link's directory, not the link's
directory), so a ``..`` after a name is refused too. Empty and ``.`` components count for
nothing. With every link checked where it is made, moved or hard-linked, resolving any
path of the mount stays in the mount: leading ``..`` components climb through real
directories only, and every name they reach is a directory of the mount or a link that was
checked itself.

The errno is EPERM (a policy refusal, as for a write to an immutable file), the same in
every scope and for every way a link is made: symlink(2), scope=job's namespace ops from
other nodes, a rename or hard link that would move a link too close to the root, and a
restore from a manifest or a namespace snapshot (which skips the link and logs it).
"""

from __future__ import annotations

import errno

from mtcfs.base.errors import FsError

#: The longest target a symlink may have, in bytes: the kernel's own limit (PATH_MAX less
#: the terminating NUL); a longer one from another node is refused with ENAMETOOLONG.
MAX_TARGET = 4095


def escapes(target: bytes, depth: int) -> bool:
    """True when a symlink whose directory is ``depth`` levels below the mount's root (0:
    in the root itself) with target ``target`` could resolve outside the mount.

    Args:
        target: the link's target, as stored (bytes).
        depth: components between the mount's root and the link's directory.
    """
    if target.startswith(b"/"):
        return True
    climbed = 0
    named = False
    for part in target.split(b"/"):
        if part in (b"", b"."):
            continue
        if part == b"..":
            if named:
                return True
            climbed += 1
            if climbed > depth:
                return True
        else:
            named = True
    return False


def check_target(target: bytes, depth: int, where: str = "") -> None:
    """Refuse a symlink ``target`` in a directory ``depth`` levels below the root.

    Args:
        target: the link's target (bytes).
        depth: components between the mount's root and the link's directory.
        where: the link's path, for the message.

    Raises:
        FsError: EPERM if the target is absolute or leaves the mount (:func:`escapes`);
            ENAMETOOLONG if it is longer than :data:`MAX_TARGET`; EINVAL if it holds a
            NUL byte.
    """
    if len(target) > MAX_TARGET:
        raise FsError(errno.ENAMETOOLONG)
    if b"\0" in target:
        raise FsError(errno.EINVAL, "a symlink target may not hold a NUL byte")
    if escapes(target, depth):
        name = f" {where}" if where else ""
        raise FsError(errno.EPERM, f"symlink{name} -> {target.decode(errors='replace')!r}"
                      " would point outside the mount: absolute targets and '..' that "
                      "climb above the mount's root are refused")
