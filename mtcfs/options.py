"""Mount options: ``-o opt=val,...`` as mount(8), fstab and mount.fuse3 pass them.

Every option is validated before anything is mounted; a bad one raises
:class:`OptionError` with a one-line message naming it (the CLI prints it and exits 2).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from mtcfs.chunking import DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE


class OptionError(ValueError):
    """A mount option is unknown or malformed."""


#: Generic mount(8) options that mount.fuse3 and fstab may pass; accepted and ignored
#: (``ro`` is passed on to the kernel).
_GENERIC = {"rw", "dev", "nodev", "suid", "nosuid", "exec", "noexec", "atime", "noatime",
            "relatime", "norelatime", "strictatime", "diratime", "nodiratime", "sync", "async",
            "auto", "noauto", "user", "nouser", "users", "defaults", "_netdev", "nofail",
            "lazytime", "nolazytime", "silent", "loud"}

_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)$", re.IGNORECASE)
_DUR_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|h|d|)$", re.IGNORECASE)
_CKPT_RE = re.compile(r"^(\d+)\s*ckpts?$", re.IGNORECASE)
_JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def parse_size(text: str) -> int:
    """``"60G"`` -> bytes. Suffixes K, M, G, T, P are powers of 1024; "KiB"/"KB" also read.

    Raises:
        ValueError: not a size.
    """
    m = _SIZE_RE.match(text.strip())
    if not m:
        raise ValueError(f"expected a size like 512M or 60G, got {text!r}")
    mult = 1024 ** "_kmgtp".index((m.group(2) or "_").lower())
    return int(float(m.group(1)) * mult)


def parse_duration(text: str) -> float:
    """``"10m"`` -> 600.0 seconds (suffixes s, m, h, d; no suffix: seconds)."""
    m = _DUR_RE.match(text.strip())
    if not m:
        raise ValueError(f"expected a duration like 30s, 10m or 1h, got {text!r}")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2).lower()]


@dataclass
class BackupInterval:
    """Back up every ``seconds`` seconds, or every ``checkpoints`` committed checkpoints."""

    seconds: float | None = 600.0
    checkpoints: int | None = None

    def __str__(self) -> str:
        if self.checkpoints is not None:
            return f"{self.checkpoints}ckpt"
        return f"{self.seconds:g}s"


def parse_backup_interval(text: str) -> BackupInterval:
    m = _CKPT_RE.match(text.strip())
    if m:
        n = int(m.group(1))
        if n < 1:
            raise ValueError("a checkpoint count must be at least 1ckpt")
        return BackupInterval(seconds=None, checkpoints=n)
    return BackupInterval(seconds=parse_duration(text), checkpoints=None)


@dataclass
class MountOptions:
    """Everything ``mtcfs SOURCE MOUNTPOINT -o ...`` was told. Sizes in bytes, times in s."""

    job: str
    mountpoint: str
    store: str
    size: int | None = None
    backup: str | None = None
    backup_interval: BackupInterval = None  # type: ignore[assignment]
    backup_keep: int = 3
    keep: int = 2
    chunk_size: int = DEFAULT_CHUNK_SIZE
    restore: str = "latest"
    allow_other: bool = False
    debug: bool = False
    read_only: bool = False
    foreground: bool = False

    def __post_init__(self) -> None:
        if self.backup_interval is None:
            self.backup_interval = BackupInterval()


def default_store(job: str) -> str:
    return os.path.join("/dev/shm/mtcfs", job)


def _int(name: str, value: str, lo: int) -> int:
    try:
        n = int(value)
    except ValueError:
        raise OptionError(f"bad option {name}={value}: expected an integer") from None
    if n < lo:
        raise OptionError(f"bad option {name}={value}: must be at least {lo}")
    return n


def parse_mount_options(job: str, mountpoint: str, opts: list[str],
                        foreground: bool = False) -> MountOptions:
    """Validate the mount source, mount point and ``-o`` option strings.

    Args:
        opts: the comma-separated strings given with ``-o`` (may repeat).

    Raises:
        OptionError: unknown option, malformed value, bad job name.
    """
    if not _JOB_RE.match(job):
        raise OptionError(f"bad job name {job!r}: use letters, digits, '.', '_' and '-'")
    o = MountOptions(job=job, mountpoint=mountpoint, store=default_store(job),
                     foreground=foreground)
    for group in opts:
        for item in group.split(","):
            item = item.strip()
            if not item:
                continue
            name, has_value, value = item.partition("=")
            name = name.strip()
            flag = not has_value
            try:
                if name in _GENERIC or name.startswith("x-") or name.startswith("comment="):
                    continue
                if name == "ro" and flag:
                    o.read_only = True
                elif name == "store" and value:
                    o.store = os.path.abspath(value)
                elif name == "size" and value:
                    o.size = parse_size(value)
                    if o.size <= 0:
                        raise ValueError("must be positive")
                elif name == "backup" and value:
                    if not (value.startswith("gs://") or value.startswith("file://")):
                        raise ValueError("expected gs://bucket/prefix or file:///path")
                    o.backup = value
                elif name == "backup_interval" and value:
                    o.backup_interval = parse_backup_interval(value)
                elif name == "backup_keep" and value:
                    o.backup_keep = _int(name, value, 1)
                elif name == "keep" and value:
                    o.keep = _int(name, value, 1)
                elif name == "chunk_size" and value:
                    cs = parse_size(value)
                    if not MIN_CHUNK_SIZE <= cs <= MAX_CHUNK_SIZE or cs & (cs - 1):
                        raise ValueError("must be a power of two between 64K and 256M")
                    o.chunk_size = cs
                elif name == "restore" and value:
                    if value not in ("latest", "none") and not value.isdigit():
                        raise ValueError("expected latest, none or a step number")
                    o.restore = value
                elif name == "allow_other" and flag:
                    o.allow_other = True
                elif name == "debug" and flag:
                    o.debug = True
                else:
                    raise OptionError(f"unknown option {item!r}" if name not in _KNOWN
                                      else f"bad option {item!r}: "
                                      + ("takes no value" if not flag else "needs a value"))
            except ValueError as exc:
                if isinstance(exc, OptionError):
                    raise
                raise OptionError(f"bad option {item}: {exc}") from None
    if o.backup and o.backup.startswith("file://"):
        path = o.backup[len("file://"):]
        if not path.startswith("/"):
            raise OptionError(f"bad option backup={o.backup}: file:// needs an absolute path"
                              " (file:///path)")
    return o


_KNOWN = {"store", "size", "backup", "backup_interval", "backup_keep", "keep", "chunk_size",
          "restore", "allow_other", "debug", "ro"}
