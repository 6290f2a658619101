"""Mount options: ``-o opt=val,...`` as mount(8), fstab and mount.fuse3 pass them.

Every option is validated before anything is mounted; a bad one raises
:class:`OptionError` with a one-line message naming it (the CLI prints it and exits 2).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from mtcfs.base.background import DEFAULT_DAEMON_NICE, CpuPolicy, format_cpus, parse_cpus
from mtcfs.base.chunking import (DEFAULT_CHUNK_SIZE, DEFAULT_HASH_THREADS, MAX_CHUNK_SIZE,
                                 MAX_HASH_THREADS, MIN_CHUNK_SIZE)
from mtcfs.base.limits import MAX_LABEL_LEN, MAX_LABELS, MAX_LABELS_BYTES, MAX_NODES, MAX_STEP
from mtcfs.base.token_bucket import MAX_CHUNK_WAIT_S


class OptionError(ValueError):
    """A mount option is unknown or malformed."""


#: Generic mount(8) options that mount.fuse3 and fstab may pass; accepted and ignored
#: (``ro`` is passed on to the kernel).
_GENERIC = {"rw", "dev", "nodev", "suid", "nosuid", "exec", "noexec", "atime", "noatime",
            "relatime", "norelatime", "strictatime", "diratime", "nodiratime", "sync", "async",
            "auto", "noauto", "user", "nouser", "users", "defaults", "_netdev", "nofail",
            "lazytime", "nolazytime", "silent", "loud"}

# All matched with fullmatch ("$" would let a final newline in) and re.ASCII (\d would take
# any Unicode digit, and IGNORECASE alone matches U+017F, the long s, as "s").
_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)", re.IGNORECASE | re.ASCII)
_DUR_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(s|m|h|d|)", re.IGNORECASE | re.ASCII)
_CKPT_RE = re.compile(r"(\d+)\s*ckpts?", re.IGNORECASE | re.ASCII)
_JOB_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HOST_RE = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,252})")
_IPV6_RE = re.compile(r"[0-9A-Fa-f:.]+(?:%[A-Za-z0-9._-]+)?")
_LABEL_KEY_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/-]*")
_PORT_RE = re.compile(r"[0-9]{1,5}")
#: Separators accepted inside ``peers=`` and ``topology=`` besides the comma (which mount(8)
#: also uses between options): ``peers=a:1;b:2`` and ``peers=a:1+b:2`` need no guessing.
_LIST_SEP_RE = re.compile(r"[;+]")
#: The Peer service's port when ``nodes`` > 1 and neither listen= nor peers= says; the host
#: is the address this host's name resolves to (never a wildcard unless listen= says so).
DEFAULT_PEER_PORT = 7470
PLACEMENTS = ("ring", "group")


#: The largest ``size=`` read at all (1024P = 1 EiB); the CLI also refuses a size larger
#: than the store's filesystem.
MAX_SIZE = 1024 ** 6
#: Bounds of the counted options (docs/usage.md, the options table); MAX_NODES and MAX_STEP
#: are shared with replicator.yaml (mtcfs/base/limits.py).
MAX_KEEP = 1000
MAX_BACKUP_KEEP = 100_000
MAX_REPLICAS = 16
MAX_INTERVAL_S = 30 * 86400
MAX_INTERVAL_CKPTS = 1_000_000
#: How long ``mtcfs`` waits for its daemon's mount to come up (``mount_timeout=``), seconds.
#: Above the sum of what the daemon itself bounds before it mounts: the store's lock (5 s),
#: scope=job's join (60 s) and a restore at mount (120 s, daemon.RESTORE_AT_MOUNT_S), with
#: room for loading a large store; a mount that used to come up never times out by default.
DEFAULT_MOUNT_TIMEOUT = 300.0


def parse_size(text: str) -> int:
    """``"60G"`` -> bytes. Suffixes K, M, G, T, P are powers of 1024; "KiB"/"KB" also read.

    Exact for any length of digits (no float overflow; ``1.5G`` is 1610612736).

    Raises:
        ValueError: not a size.
    """
    m = _SIZE_RE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"expected a size like 512M or 60G, got {text!r}")
    mult = 1024 ** "_kmgtp".index((m.group(2) or "_").lower())
    whole, _, frac = m.group(1).partition(".")
    frac = frac[:30]  # beyond a byte's precision
    return (int(whole + frac) * mult) // 10 ** len(frac)


def parse_duration(text: str) -> float:
    """``"10m"`` -> 600.0 seconds (suffixes s, m, h, d; no suffix: seconds)."""
    m = _DUR_RE.fullmatch(text.strip())
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


def parse_address(text: str) -> str:
    """Check ``host:port`` (``[ipv6]:port`` for IPv6) and return it stripped.

    Raises:
        ValueError: no port, a port that is not an integer in 0..65535, an empty or
            malformed host, or an IPv6 address without brackets.
    """
    text = text.strip()
    if text.startswith("["):
        host, close, rest = text[1:].partition("]")
        if not close or not rest.startswith(":") or not _IPV6_RE.fullmatch(host) \
                or ":" not in host:
            raise ValueError(f"expected [ipv6]:port, got {text!r}")
        port = rest[1:]
    else:
        host, colon, port = text.rpartition(":")
        if not colon:
            raise ValueError(f"expected host:port, got {text!r}")
        if ":" in host:
            raise ValueError(f"put an IPv6 address in brackets ([::1]:7470), got {text!r}")
        if not _HOST_RE.fullmatch(host):
            raise ValueError(f"expected host:port with a host name or address, got {text!r}")
    if not _PORT_RE.fullmatch(port) or not 0 <= int(port) <= 65535:
        raise ValueError(f"port must be an integer in 0..65535, got {text!r}")
    return text


def check_pem_file(path: str, kind: str) -> str:
    """Check that ``path`` is a readable PEM file holding a ``kind`` (``CERTIFICATE``,
    ``PRIVATE KEY``) and return its absolute path.

    Raises:
        ValueError: it cannot be read (the reason), is empty, or holds no such PEM block.
    """
    path = os.path.abspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not data.strip():
        raise ValueError(f"{path} is empty")
    if b"-----BEGIN " not in data or kind.encode() + b"-----" not in data:
        raise ValueError(f"{path} holds no PEM {kind}")
    return path


def parse_labels(text: str, into: dict[str, str] | None = None) -> dict[str, str]:
    """Parse ``"zone=a;block=3"`` (the ``topology=`` option; ``,`` ``;`` ``+`` separate)
    into a dict, adding to ``into`` if given.

    The same rules as :func:`mtcfs.tiers.peer.placement.parse_labels` (not imported: the
    ``mtcfs.tiers.peer`` package pulls in grpc), plus a non-empty value.

    Raises:
        ValueError: an item without ``=``, an empty or malformed key, an empty value, a
            key given twice, a key or value over MAX_LABEL_LEN characters, a value with a
            character that is not printable, more than MAX_LABELS labels, or more than
            MAX_LABELS_BYTES of them as JSON (so that every peer's member view takes this
            node's record: mtcfs/tiers/coord/membership.py).
    """
    out = {} if into is None else into
    for item in filter(None, (s.strip() for s in _LIST_SEP_RE.split(text.replace(",", ";")))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not _LABEL_KEY_RE.fullmatch(key):
            raise ValueError(f"bad topology label {item!r}: want key=value")
        if not value:
            raise ValueError(f"topology label {key!r} has no value")
        if key in out:
            raise ValueError(f"topology label {key!r} given twice")
        if len(key) > MAX_LABEL_LEN or len(value) > MAX_LABEL_LEN:
            raise ValueError(f"topology label {key[:40]!r} is longer than {MAX_LABEL_LEN} "
                             "characters")
        if not value.isprintable():
            raise ValueError(f"topology label {key[:40]!r} holds a character that is not "
                             "printable")
        if len(out) >= MAX_LABELS:
            raise ValueError(f"more than {MAX_LABELS} topology labels")
        out[key] = value
        if len(json.dumps(out)) > MAX_LABELS_BYTES:
            raise ValueError(f"the topology labels take more than {MAX_LABELS_BYTES} bytes")
    return out


def parse_backup_interval(text: str) -> BackupInterval:
    """``"10m"`` -> every 600 s, ``"5ckpt"`` -> every 5th complete checkpoint.

    Raises:
        ValueError: not a duration or count, a duration outside 1s..30d, or a count outside
            1..1000000ckpt.
    """
    m = _CKPT_RE.fullmatch(text.strip())
    if m:
        n = int(m.group(1))
        if n < 1:
            raise ValueError("a checkpoint count must be at least 1ckpt")
        if n > MAX_INTERVAL_CKPTS:
            raise ValueError(f"a checkpoint count must be at most {MAX_INTERVAL_CKPTS}ckpt")
        return BackupInterval(seconds=None, checkpoints=n)
    seconds = parse_duration(text)
    if seconds < 1:
        raise ValueError("must be at least 1s")
    if seconds > MAX_INTERVAL_S:
        raise ValueError("must be at most 30d")
    return BackupInterval(seconds=seconds, checkpoints=None)


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
    #: Under memory pressure, delete committed checkpoints no other tier holds (True) or
    #: refuse the write with ENOSPC (False); None: False when backup= is set, else True.
    evict_unsaved: bool | None = None
    chunk_size: int = DEFAULT_CHUNK_SIZE
    #: Threads that hash at once: a seal's chunks, the first-read verification of a file
    #: (docs/usage.md; min(4, CPUs) by default).
    hash_threads: int = DEFAULT_HASH_THREADS
    #: Write a file's content around the kernel's page cache when the open creates or
    #: truncates it (``direct_writes=yes|no``; docs/usage.md, "Direct writes").
    direct_writes: bool = True
    #: Let the kernel read and write the store's data files itself (FUSE passthrough,
    #: ``passthrough=yes|no``; docs/passthrough.md): yes where the kernel, the daemon's
    #: privileges and the store allow it.
    passthrough: bool = True
    restore: str = "latest"
    allow_other: bool = False
    debug: bool = False
    read_only: bool = False
    foreground: bool = False
    # The peer tier (several nodes of one job replicating each other's RAM tier).
    rank: int = 0
    nodes: int = 1
    #: This daemon's Peer gRPC service; after parsing: peers[rank] when peers= is given,
    #: else DEFAULT_PEER_LISTEN when nodes > 1, else None.
    listen: str | None = None
    #: The chunk stream's TCP port on the ``listen`` host (0: one the kernel picks).
    stream_port: int = 0
    #: ``metrics=HOST:PORT``: serve Prometheus metrics over HTTP there (metrics.py); None: no
    #: port (``mtcfs metrics`` still prints them).
    metrics: str | None = None
    #: Every rank's Peer service address, in rank order (len == nodes), or None.
    peers: list[str] | None = None
    #: The removed ``coordinator=`` option as given (refused with a pointer to coord=).
    coordinator: str | None = None
    replicas: int = 1
    topology: dict[str, str] = field(default_factory=dict)
    placement: str = "ring"
    assume_data_parallelism: int | None = None
    huge_model: bool = False
    #: "node": the mount shows this rank's files; "job": every rank's (docs/consistency.md).
    scope: str = "node"
    #: The removed ``ns_quorum=`` option as given (refused with a pointer to coord=).
    ns_quorum: str | None = None
    #: The job's etcd cluster (``coord=etcd://HOST:PORT,...``): client endpoints, or None.
    #: Required with nodes > 1: membership, step records, restore decisions and scope=job's
    #: namespace live there (docs/coordination.md).
    coord: list[str] | None = None
    #: The key prefix of this job in etcd (``coord_prefix=``); None: ``/mtcfs/<job>/``.
    coord_prefix: str | None = None
    #: Seconds a namespace change or read waits for etcd before it fails with EIO.
    coord_timeout: float = 60.0
    #: Mutual TLS of the peer tier (docs/security.md): the job CA's certificate, this
    #: rank's certificate and its key (PEM paths; all three or none).
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    #: Bytes one other rank's replicas may take in this node's replica store; None: a fair
    #: share, size / (1 + replicas) (docs/security.md).
    replica_quota: int | None = None
    #: Plaintext, unauthenticated traffic where no TLS material is given (option
    #: ``insecure``): a multi-node mount refuses to start without TLS unless this is set.
    insecure: bool = False
    #: TLS to etcd (docs/security-etcd.md): the CA bundle that signed etcd's server
    #: certificate (``coord_ca=``, turns TLS on), and this node's client certificate and key
    #: (``coord_cert=``, ``coord_key=``: both or neither; their CN is the etcd user).
    #: Absolute paths of PEM files, read when the daemon connects and again when they change.
    coord_ca: str | None = None
    coord_cert: str | None = None
    coord_key: str | None = None
    #: Seconds a read waits for data that is not on this node (fault-in from peers or the
    #: backup tier, every source included) before it fails with EIO (docs/reliability.md).
    read_timeout: float = 60.0
    #: Seconds between background scrub passes over the RAM tier (0: no scrub) and the
    #: bytes per second a pass may read (docs/reliability.md, mtcfs/core/verifier.py).
    scrub_interval: float = 24 * 3600.0
    scrub_rate: int = 100 * 1024 * 1024
    #: The CPU budget of background work (base/background.py, docs/usage.md "Background
    #: work"): the scheduling class, nice value and CPUs of its threads.
    bg_sched: str = "idle"
    bg_nice: int = 0
    bg_cpus: frozenset[int] = field(default_factory=frozenset)
    #: The nice value of the daemon as a whole against other processes (its autogroup's).
    daemon_nice: int = DEFAULT_DAEMON_NICE
    #: Threads that compress and upload one backup's chunks at once (1..4).
    backup_threads: int = 4
    #: Bytes per second of replication to peers and of uploads to the backup tier
    #: (0: unbounded; base/token_bucket.py).
    replicate_rate: int = 0
    backup_rate: int = 0
    #: Orbax multi-tier checkpointing: this mount is the node's replicator (docs/orbax-mtc.md).
    mtc: bool = False
    #: ``host:port`` written to jax-init-info.txt (mtc); None: rank 0's peer host (peers=, or
    #: its record in etcd), port 8476.
    jax_coordinator: str | None = None
    #: Seconds ``mtcfs`` waits for the mount to come up before it stops its daemon (exit 1).
    mount_timeout: float = DEFAULT_MOUNT_TIMEOUT
    #: Seconds a SIGTERM waits for the newest step to reach the peers and the backup tier
    #: before the unmount (mtcfs/flush.py); 0: no wait.
    stop_flush: float = 25.0
    #: Test only: the control socket accepts the ``fault`` command (cut this node off its
    #: peers). Production units never set it (docs/security-local.md).
    test_faults: bool = False
    #: Each option's text as given (name -> value), for messages that name it.
    given: dict[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.backup_interval is None:
            self.backup_interval = BackupInterval()

    @property
    def cpu_policy(self) -> CpuPolicy:
        """The background CPU policy these options give (base/background.py)."""
        return CpuPolicy(sched=self.bg_sched, nice=self.bg_nice,  # type: ignore[arg-type]
                         cpus=self.bg_cpus)

    @property
    def multi_node(self) -> bool:
        """True when this mount is one of several nodes (nodes > 1): the peer tier runs."""
        return self.nodes > 1

    def peer_address(self, rank: int) -> str | None:
        """The Peer service address of ``rank`` from ``peers=``, or None when peers= was not
        given (the addresses are then learned from the members' records in etcd).

        Raises:
            ValueError: ``rank`` is outside 0..nodes-1.
        """
        if not 0 <= rank < self.nodes:
            raise ValueError(f"rank {rank} is outside 0..{self.nodes - 1}")
        return self.peers[rank] if self.peers else None


def default_store(job: str) -> str:
    return os.path.join("/dev/shm/mtcfs", job)


def _yes_no(value: str) -> bool:
    """A ``yes|no`` option's value. Raises ValueError (named by the caller): anything else."""
    if value not in ("yes", "no"):
        raise ValueError("expected yes or no")
    return value == "yes"


def _int(name: str, value: str, lo: int, hi: int) -> int:
    """The integer option ``name=value`` (plain decimal digits) in ``lo..hi``.

    Raises:
        OptionError: not an integer, or outside ``lo..hi``.
    """
    if not re.fullmatch(r"[0-9]{1,30}", value.strip()):
        raise OptionError(f"bad option {name}={value}: expected an integer")
    n = int(value)
    if n < lo:
        raise OptionError(f"bad option {name}={value}: must be at least {lo}")
    if n > hi:
        raise OptionError(f"bad option {name}={value}: must be at most {hi}")
    return n


def parse_mount_options(job: str, mountpoint: str, opts: list[str],
                        foreground: bool = False) -> MountOptions:
    """Validate the mount source, mount point and ``-o`` option strings.

    Args:
        opts: the comma-separated strings given with ``-o`` (may repeat).

    ``peers=`` and ``topology=`` hold lists, and mount(8) splits options at commas too: a
    token that is no option continues the list option just before it, an address without
    ``=`` for peers (``peers=a:1,b:2``), an unknown ``key=value`` for topology
    (``topology=zone=a,block=3``). Inside those two values ``;`` and ``+`` also separate
    items (``peers=a:1;b:2``), which leaves nothing to guess.

    Raises:
        OptionError: unknown option, malformed value, bad job name, or peer tier options
            that do not fit together (see :func:`_check_peer_tier`).
    """
    if not _JOB_RE.fullmatch(job):
        raise OptionError(f"bad job name {job!r}: use letters, digits, '.', '_' and '-'")
    o = MountOptions(job=job, mountpoint=mountpoint, store=default_store(job),
                     foreground=foreground)
    given: dict[str, str] = {}  # option name -> its text as given, for later error messages
    extending: str | None = None  # "peers" or "topology": the list option a token may continue
    for group in opts:
        for item in group.split(","):
            item = item.strip()
            if not item:
                continue
            name, has_value, value = item.partition("=")
            name = name.strip()
            flag = not has_value
            if extending and _continues(extending, name, has_value):
                _extend(o, given, extending, item)
                continue
            extending = None
            try:
                if name in _GENERIC or name.startswith("x-") or name == "comment":
                    continue
                if name in _KNOWN and has_value:
                    if name in given and name not in _LISTS:  # last wins would drop one
                        raise OptionError(f"bad option {item}: {name} given twice "
                                          f"({name}={given[name]}, {item})")
                    given[name] = value
                if name == "ro" and flag:
                    o.read_only = True
                elif name == "store" and value:
                    if "\0" in value:
                        raise ValueError("a path cannot hold a NUL byte")
                    o.store = os.path.abspath(value)
                elif name == "size" and value:
                    o.size = parse_size(value)
                    if o.size <= 0:
                        raise ValueError("must be positive")
                    if o.size > MAX_SIZE:
                        raise ValueError("must be at most 1024P")
                elif name == "backup" and value:
                    if not (value.startswith("gs://") or value.startswith("file://")):
                        raise ValueError("expected gs://bucket/prefix or file:///path")
                    o.backup = value
                elif name == "backup_interval" and value:
                    o.backup_interval = parse_backup_interval(value)
                elif name == "backup_keep" and value:
                    o.backup_keep = _int(name, value, 1, MAX_BACKUP_KEEP)
                elif name == "keep" and value:
                    o.keep = _int(name, value, 1, MAX_KEEP)
                elif name == "evict_unsaved" and value:
                    o.evict_unsaved = _yes_no(value)
                elif name == "direct_writes" and value:
                    o.direct_writes = _yes_no(value)
                elif name == "passthrough" and value:
                    o.passthrough = _yes_no(value)
                elif name == "chunk_size" and value:
                    cs = parse_size(value)
                    if not MIN_CHUNK_SIZE <= cs <= MAX_CHUNK_SIZE or cs & (cs - 1):
                        raise ValueError("must be a power of two between 64K and 256M")
                    o.chunk_size = cs
                elif name == "hash_threads" and value:
                    o.hash_threads = _int(name, value, 1, MAX_HASH_THREADS)
                elif name == "restore" and value:
                    if value not in ("latest", "none") and not (
                            re.fullmatch(r"[0-9]{1,19}", value) and int(value) <= MAX_STEP):
                        raise ValueError("expected latest, none or a step number "
                                         f"(0..{MAX_STEP})")
                    o.restore = value
                elif name == "allow_other" and flag:
                    o.allow_other = True
                elif name == "replica_quota" and value:
                    o.replica_quota = parse_size(value)
                    if not 1 <= o.replica_quota <= MAX_SIZE:
                        raise ValueError("expected a size such as 512M")
                elif name == "insecure" and flag:
                    o.insecure = True
                elif name in ("tls_ca", "tls_cert", "tls_key") and value:
                    setattr(o, name, _tls_path(value))
                elif name == "debug" and flag:
                    o.debug = True
                elif name == "rank" and value:
                    o.rank = _int(name, value, 0, MAX_NODES - 1)
                elif name == "nodes" and value:
                    o.nodes = _int(name, value, 1, MAX_NODES)
                elif name == "listen" and value:
                    o.listen = parse_address(value)
                elif name == "stream_port" and value:
                    o.stream_port = _int(name, value, 0, 65535)
                elif name == "metrics" and value:
                    o.metrics = parse_address(value)
                elif name == "coordinator" and value:
                    o.coordinator = parse_address(value)
                elif name == "peers" and value:
                    o.peers = []
                    _extend(o, given, "peers", value, first=True)
                    extending = "peers"
                elif name == "coord" and value:
                    if not value.startswith("etcd://"):
                        raise ValueError("expected etcd://HOST:PORT[,HOST:PORT...]")
                    o.coord = []
                    _extend(o, given, "coord", value[len("etcd://"):], first=True)
                    given["coord"] = value
                    extending = "coord"
                elif name == "coord_prefix" and value:
                    if not re.fullmatch(r"/[A-Za-z0-9._/-]{0,200}", value) or "//" in value:
                        raise ValueError("expected an absolute key path such as /mtcfs/myjob")
                    o.coord_prefix = value.rstrip("/") + "/"
                elif name in _PEM_OPTIONS and value:
                    setattr(o, name, check_pem_file(value, _PEM_OPTIONS[name]))
                elif name == "coord_timeout" and value:
                    o.coord_timeout = parse_duration(value)
                    if not 1 <= o.coord_timeout <= 3600:
                        raise ValueError("must be between 1s and 1h")
                elif name == "topology" and value:
                    o.topology = {}
                    _extend(o, given, "topology", value, first=True)
                    extending = "topology"
                elif name == "replicas" and value:
                    o.replicas = _int(name, value, 0, MAX_REPLICAS)
                elif name == "placement" and value:
                    if value not in PLACEMENTS:
                        raise ValueError(f"expected {' or '.join(PLACEMENTS)}")
                    o.placement = value
                elif name == "assume_data_parallelism" and value:
                    o.assume_data_parallelism = _int(name, value, 1, MAX_NODES)
                elif name == "huge_model" and flag:
                    o.huge_model = True
                elif name == "mtc" and flag:
                    o.mtc = True
                elif name == "test_faults" and flag:
                    o.test_faults = True
                elif name == "jax_coordinator" and value:
                    o.jax_coordinator = parse_address(value)
                elif name == "scope" and value:
                    if value not in ("node", "job"):
                        raise ValueError("expected node or job")
                    o.scope = value
                elif name == "read_timeout" and value:
                    o.read_timeout = parse_duration(value)
                    if not 1 <= o.read_timeout <= 3600:
                        raise ValueError("must be between 1s and 1h")
                elif name == "stop_flush" and value:
                    o.stop_flush = 0.0 if value in ("0", "off") else parse_duration(value)
                    if not 0 <= o.stop_flush <= 3600:
                        raise ValueError("must be off (0) or between 1s and 1h")
                elif name == "mount_timeout" and value:
                    o.mount_timeout = parse_duration(value)
                    if not 1 <= o.mount_timeout <= 3600:
                        raise ValueError("must be between 1s and 1h")
                elif name == "scrub_interval" and value:
                    o.scrub_interval = 0.0 if value in ("0", "off") else parse_duration(value)
                    if o.scrub_interval and not 1 <= o.scrub_interval <= 30 * 86400:
                        raise ValueError("must be off (0) or between 1s and 30d")
                elif name == "scrub_rate" and value:
                    o.scrub_rate = parse_size(value.removesuffix("/s"))
                    if not 1 << 20 <= o.scrub_rate <= 100 << 30:
                        raise ValueError("must be between 1M and 100G (bytes per second)")
                elif name == "bg_sched" and value:
                    if value not in ("idle", "batch", "normal"):
                        raise ValueError("must be idle, batch or normal")
                    o.bg_sched = value
                elif name == "bg_nice" and value:
                    o.bg_nice = _int(name, value, 0, 19)
                elif name == "daemon_nice" and value:
                    o.daemon_nice = _int(name, value, 0, 19)
                elif name == "bg_cpus" and value:
                    o.bg_cpus = parse_cpus(value)
                    allowed = os.sched_getaffinity(0)
                    if not o.bg_cpus <= allowed:
                        raise ValueError(
                            "names CPUs this process may not run on (it may use "
                            f"{format_cpus(frozenset(allowed))})")
                elif name == "backup_threads" and value:
                    o.backup_threads = _int(name, value, 1, 4)
                elif name in ("replicate_rate", "backup_rate") and value:
                    rate = 0 if value in ("0", "off") else parse_size(value.removesuffix("/s"))
                    if rate and not 1 << 20 <= rate <= 1 << 40:
                        raise ValueError("must be off (0) or between 1M and 1T (bytes per "
                                         "second)")
                    setattr(o, name, rate)
                elif name == "ns_quorum" and value:
                    o.ns_quorum = value
                else:
                    raise OptionError(f"unknown option {item!r}" if name not in _KNOWN
                                      else f"bad option {item!r}: "
                                      + ("takes no value" if name in _FLAGS
                                         else "needs a value"))
            except ValueError as exc:
                if isinstance(exc, OptionError):
                    raise
                raise OptionError(f"bad option {item}: {exc}") from None
    if o.size is not None and o.size < o.chunk_size:
        raise OptionError(f"bad option size={given['size']}: smaller than one chunk "
                          f"(chunk_size={given.get('chunk_size', o.chunk_size)})")
    if o.backup and o.backup.startswith("file://"):
        path = o.backup[len("file://"):]
        if not path.startswith("/"):
            raise OptionError(f"bad option backup={o.backup}: file:// needs an absolute path"
                              " (file:///path)")
    _check_peer_tier(o, given)
    _check_security(o)
    _check_budget(o, given)
    if o.multi_node and o.listen is None:  # last: every other mistake is named first
        o.listen = default_listen()
    o.given = given
    return o


def _check_budget(o: MountOptions, given: dict[str, str]) -> None:
    """Cross-option checks of the background budget, once every option is read; fills the
    default of ``hash_threads`` from ``bg_cpus``.

    Raises:
        OptionError: ``bg_nice`` with ``bg_sched=idle`` (an idle-class thread has no nice
            value); a rate under which one chunk would wait longer than
            :data:`~mtcfs.base.token_bucket.MAX_CHUNK_WAIT_S` (a peer ends a stream idle
            for 30 s).
    """
    if "bg_nice" in given and o.bg_nice and o.bg_sched == "idle":
        raise OptionError(f"bad option bg_nice={given['bg_nice']}: bg_sched=idle runs below "
                          "every nice value; give bg_sched=batch or bg_sched=normal with it")
    if o.bg_cpus and "hash_threads" not in given:
        o.hash_threads = max(1, min(o.hash_threads, len(o.bg_cpus)))
    for name in ("replicate_rate", "backup_rate"):
        rate = getattr(o, name)
        least = -(-o.chunk_size // int(MAX_CHUNK_WAIT_S))
        if rate and rate < least:
            raise OptionError(f"bad option {name}={given[name]}: one {o.chunk_size >> 20} MiB "
                              f"chunk would wait more than {MAX_CHUNK_WAIT_S:g} s; at least "
                              f"{-(-least // (1 << 20))}M with chunk_size="
                              f"{given.get('chunk_size', o.chunk_size)}")


def _continues(list_name: str, name: str, has_value: bool) -> bool:
    """Whether a comma-separated token continues the list option before it: it is not an
    option itself, and looks like a peers address (no ``=``) or a topology label (``k=v``)."""
    if name in _KNOWN or name in _GENERIC or name.startswith("x-") or name == "comment":
        return False
    return has_value if list_name == "topology" else not has_value


def _extend(o: MountOptions, given: dict[str, str], list_name: str, text: str,
            first: bool = False) -> None:
    """Add ``text`` (one or more ``;``/``+``-separated items) to ``peers`` or ``topology``.

    Raises:
        OptionError: a malformed address or label, naming the option as given so far.
    """
    given[list_name] = text if first else f"{given[list_name]},{text}"
    try:
        if list_name == "topology":
            parse_labels(text, into=o.topology)
        elif list_name == "coord":
            assert o.coord is not None
            o.coord.extend(parse_address(a) for a in _LIST_SEP_RE.split(text) if a.strip())
        else:
            assert o.peers is not None
            o.peers.extend(parse_address(a) for a in _LIST_SEP_RE.split(text) if a.strip())
    except ValueError as exc:
        raise OptionError(f"bad option {list_name}={given[list_name]}: {exc}") from None


def _tls_path(value: str) -> str:
    """An absolute path of a PEM file (checked for use when the mount starts)."""
    if "\0" in value or not value.strip():
        raise ValueError("expected the path of a PEM file")
    return os.path.abspath(value)


def default_listen() -> str:
    """``<address of this host's name>:7470``: where the Peer service listens when neither
    listen= nor peers= says. Not a wildcard: the port is reachable on one interface only.

    Raises:
        OptionError: the host name does not resolve, or only to a loopback address (as
            Debian's /etc/hosts does by default), which peers on other hosts cannot reach.
    """
    import ipaddress
    import socket
    host = socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
    except OSError as exc:
        addr, why = "", f"does not resolve ({exc})"
    else:
        why = f"resolves to the loopback address {addr}"
    if not addr or ipaddress.ip_address(addr).is_loopback:
        raise OptionError(f"nodes > 1 needs listen=HOST:PORT, the address other nodes reach "
                          f"this one at: the host name {host!r} {why} "
                          f"(listen=0.0.0.0:{DEFAULT_PEER_PORT} listens on every interface)")
    return f"{addr}:{DEFAULT_PEER_PORT}"


def _check_security(o: MountOptions) -> None:
    """The TLS options together; plaintext only when asked for (docs/security.md).

    Raises:
        OptionError: tls_* given in part, or on one node; nodes > 1 with neither TLS
            material nor ``insecure`` for the peers, or for etcd (coord= without
            coord_ca=); ``insecure`` where every connection has TLS.
    """
    tls = {n: getattr(o, n) for n in ("tls_ca", "tls_cert", "tls_key")}
    given = [n for n, v in tls.items() if v]
    if given and len(given) < 3:
        missing = ", ".join(f"{n}=" for n, v in tls.items() if not v)
        raise OptionError(f"option {given[0]}= needs {missing} too: the job CA, this rank's "
                          "certificate and its key (docs/security.md)")
    if given and not o.multi_node:
        raise OptionError("options tls_ca=, tls_cert=, tls_key= secure the traffic between "
                          "nodes: they need nodes >= 2")
    if o.insecure:
        if o.multi_node and given and o.coord_ca:
            raise OptionError("option insecure has nothing to allow: the peers use tls_ca=, "
                              "tls_cert=, tls_key= and etcd uses coord_ca=; leave it out")
        return
    if o.multi_node and not given:
        raise OptionError(f"nodes={o.nodes} needs tls_ca=, tls_cert= and tls_key= (the job's "
                          "CA, this rank's certificate and key; docs/security.md), or the "
                          "option insecure for plaintext peer traffic")
    if o.coord and not o.coord_ca:
        raise OptionError(f"coord=etcd://{','.join(o.coord)} is plaintext: give "
                          "coord_ca= (and coord_cert=, coord_key=; docs/security-etcd.md), "
                          "or the option insecure for plaintext traffic to etcd")


def plaintext_parts(o: MountOptions) -> list[str]:
    """What of a mount's traffic goes without TLS (with option ``insecure``), for the
    warning the daemon logs at every start."""
    parts = []
    if o.multi_node and not o.tls_ca:
        parts.append(f"the peer traffic on {o.listen}")
    if o.coord and not o.coord_ca:
        parts.append("the traffic to etcd")
    return parts


def _check_peer_tier(o: MountOptions, given: dict[str, str]) -> None:
    """Cross-option checks of the peer tier, once every option is read; fills the defaults
    of ``listen``.

    Raises:
        OptionError: rank outside 0..nodes-1; peers= not one address per rank, or an
            address twice; nodes > 1 without coord=; coordinator= (gone); replicas >
            nodes-1; assume_data_parallelism not dividing nodes; huge_model without
            assume_data_parallelism >= 2 or with more replicas than data-parallel twins;
            coord_ca, coord_cert and coord_key that do not fit (:func:`_check_coord_tls`).
    """
    def bad(name: str, why: str) -> OptionError:
        return OptionError(f"bad option {name}={given.get(name, getattr(o, name))}: {why}")

    if not 0 <= o.rank < o.nodes:
        raise bad("rank", f"must be in 0..{o.nodes - 1} (nodes={o.nodes})")
    if o.peers is not None:
        if len(o.peers) != o.nodes:
            raise bad("peers", f"{len(o.peers)} addresses for nodes={o.nodes}: give every "
                               "rank's address, in rank order")
        first_rank: dict[str, int] = {}
        for r, addr in enumerate(o.peers):
            if addr in first_rank:
                raise bad("peers", f"{addr} is given for rank {first_rank[addr]} and rank {r}")
            first_rank[addr] = r
        if o.listen is None:
            o.listen = o.peers[o.rank]
    if o.coordinator is not None:
        raise bad("coordinator", "is gone: the nodes find each other through etcd "
                                 "(coord=etcd://HOST:PORT,...); leave coordinator out")
    if o.multi_node and o.coord is None:
        raise OptionError(f"nodes={o.nodes} needs coord=etcd://HOST:PORT[,HOST:PORT...]: "
                          "the nodes of a job agree through etcd (docs/coordination.md)")
    if o.multi_node and o.replicas > o.nodes - 1:
        raise bad("replicas", f"at most nodes-1 = {o.nodes - 1} with nodes={o.nodes}")
    dp = o.assume_data_parallelism
    if dp is not None and o.nodes % dp:
        raise bad("assume_data_parallelism", f"must divide nodes={o.nodes}")
    if o.scope == "job" and not o.multi_node:
        raise bad("scope", "a job-wide namespace needs nodes >= 2 (one node is scope=node)")
    if o.scope == "job" and dp is not None and dp > 1:
        raise bad("scope", "assume_data_parallelism is for scope=node: in one job-wide "
                           "namespace identical files are one file")
    if o.coord is not None:
        if not o.coord:
            raise bad("coord", "needs at least one etcd endpoint (etcd://HOST:PORT,...)")
        if len(set(o.coord)) != len(o.coord):
            raise bad("coord", "an etcd endpoint is given twice")
        if not o.multi_node:
            raise bad("coord", "is the agreement between several nodes: it needs nodes >= 2")
    if o.ns_quorum is not None:
        raise bad("ns_quorum", "is gone: etcd's own quorum orders the job's namespace "
                               "(coord=etcd://...); leave ns_quorum out")
    if o.coord_prefix is not None and o.coord is None:
        raise bad("coord_prefix", "names keys in etcd: it needs coord=etcd://...")
    if "coord_timeout" in given and o.coord is None:
        raise bad("coord_timeout", "bounds the waits on etcd: it needs coord=etcd://...")
    _check_coord_tls(o, bad)
    if o.mtc and o.scope != "node":
        raise OptionError("option mtc needs scope=node: Orbax's multi-tier checkpointing "
                          "keeps each node's data in its own directory")
    if o.jax_coordinator and not o.mtc:
        raise bad("jax_coordinator", "is written to jax-init-info.txt only with option mtc")
    if o.huge_model:
        if dp is None or dp < 2:
            raise OptionError("option huge_model needs assume_data_parallelism=D with D >= 2"
                              " (it replicates only to data-parallel twins)")
        if o.replicas > dp - 1:
            raise bad("replicas", f"huge_model replicates only to the {dp - 1} data-parallel "
                                  f"twin(s) of assume_data_parallelism={dp}: at most {dp - 1}")


def _check_coord_tls(o: MountOptions, bad: Callable[[str, str], OptionError]) -> None:
    """coord_ca, coord_cert and coord_key fit together: each needs coord=, the certificate
    and the key go together, and both need coord_ca (TLS).

    Raises:
        OptionError: from ``bad(name, why)``.
    """
    for name in _PEM_OPTIONS:
        if getattr(o, name) is not None and o.coord is None:
            raise bad(name, "is for TLS to etcd: it needs coord=etcd://...")
    if (o.coord_cert is None) != (o.coord_key is None):
        have, lacks = ("coord_cert", "coord_key") if o.coord_cert else ("coord_key",
                                                                          "coord_cert")
        raise bad(have, f"needs {lacks}= too (a client certificate and its key go together)")
    if o.coord_cert is not None and o.coord_ca is None:
        raise bad("coord_cert", "needs coord_ca= (the CA that signed etcd's server "
                                "certificate: a client certificate is sent only over TLS)")


_KNOWN = {"store", "size", "backup", "backup_interval", "backup_keep", "keep", "chunk_size",
          "hash_threads",
          "evict_unsaved", "direct_writes", "passthrough",
          "restore", "allow_other", "debug", "ro",
          "rank", "nodes", "listen", "stream_port", "peers", "coordinator", "replicas", "topology", "placement",
          "coord", "coord_prefix", "coord_timeout", "coord_ca", "coord_cert", "coord_key",
          "assume_data_parallelism", "huge_model",
          "scope", "ns_quorum", "mtc", "jax_coordinator",
          "read_timeout", "mount_timeout", "scrub_interval", "scrub_rate", "stop_flush",
          "bg_sched", "bg_nice", "bg_cpus", "daemon_nice", "backup_threads", "replicate_rate",
          "backup_rate",
          "tls_ca", "tls_cert", "tls_key", "insecure", "test_faults", "replica_quota",
          "metrics"}
#: The list options: a token that is no option continues them, and a later ``peers=`` or
#: ``topology=`` starts the list afresh (tested; docs/usage.md), so they may repeat.
_LISTS = {"peers", "topology", "coord"}
#: The options naming a PEM file, and what the file must hold.
_PEM_OPTIONS = {"coord_ca": "CERTIFICATE", "coord_cert": "CERTIFICATE",
                "coord_key": "PRIVATE KEY"}
#: The options that take no value; they may be repeated (``debug,debug`` means debug).
_FLAGS = {"allow_other", "debug", "ro", "huge_model", "mtc", "insecure", "test_faults"}
