"""A real Slurm cluster on one machine: munged, one slurmctld, N slurmd, each slurmd a "host".

:class:`SlurmCluster` starts, all under one temporary directory ``root``:

* ``munged`` with a key, socket, pid, seed and log file of its own (``root/munge``), so the
  system's munge (if any) is neither used nor touched; every daemon and client is pointed at
  its socket by ``AuthInfo=socket=`` in the generated ``slurm.conf``.
* ``slurmctld`` in the root network namespace, on the :class:`~support.fabric.Fabric`'s
  bridge address (reached from every node), in a UTS namespace of its own whose hostname is
  the ``SlurmctldHost`` name (slurmctld refuses to run where its hostname is not one).
* for node ``r``, ``slurmd -N n<r>`` in network namespace ``r`` of the fabric (its own
  address, so every slurmd listens on the same ``SlurmdPort``) and in a UTS namespace of its
  own with hostname ``n<r>``: ``nsenter --net=... unshare --uts sh -c 'hostname n<r>; exec
  slurmd -D ...'``. Only the network and UTS namespaces change, not the mount namespace, so
  a FUSE mount a Prolog makes is seen by the whole machine (the test reads it). Debian's
  Slurm 22.05 is not built with ``--enable-multiple-slurmd``; with one network namespace
  per slurmd it does not have to be.

``slurm.conf`` keeps everything below ``root`` (StateSaveLocation, SlurmdSpoolDir=.../%n,
pid and log files); no cgroups (proctrack/linuxproc, task/none); ``ReturnToService=2``;
``Prolog``/``Epilog`` as given, with ``PrologFlags=Alloc`` (every node's Prolog runs when
the job is allocated, so each node's mount is up before any step). Commands run with
``SLURM_CONF`` pointing at it (:meth:`env`, :meth:`cmd`).

Every wait has a deadline and fails naming what it waited for, with the logs' tails.
:meth:`cleanup` (never raises) kills every daemon, unmounts what is mounted below ``root``
and below the given extra roots, and removes the namespaces.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self

from .fabric import Fabric
from .mount import unmount_below
from .poll import wait_for

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "srun", "sinfo", "squeue")
CTL_HOST = "mtcfs-ctl"
SLURMD_PORT = 6818


def _free_port() -> int:
    """A TCP port no socket of the root network namespace holds now, picked by the kernel
    (another process may take it before slurmctld binds it: slurmctld then exits and
    :meth:`SlurmCluster.start` says so)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def missing_binaries() -> list[str]:
    """The Slurm/munge programs not on PATH (the test skips when any is)."""
    return [b for b in BINARIES if shutil.which(b) is None]


def node_name(rank: int) -> str:
    return f"n{rank}"


class SlurmCluster:
    """munged + slurmctld + ``nodes`` slurmd, each slurmd in a network namespace of its own.

    Args:
        root: an empty directory of this cluster (mode 0755 is set: munged checks it).
        nodes: the number of slurmd (compute nodes n0..n<nodes-1>).
        prolog, epilog: the Prolog/Epilog scripts (absolute paths), or None.
        fabric: the network; None: one of ``nodes`` namespaces is made (and destroyed).
        extra_conf: lines appended to slurm.conf.
        unmount_roots: directories whose mounts :meth:`cleanup` detaches too (the mount
            and store roots of the Prolog's configuration).
    """

    def __init__(self, root: Path, nodes: int = 2, prolog: Path | None = None,
                 epilog: Path | None = None, fabric: Fabric | None = None,
                 extra_conf: list[str] | None = None,
                 unmount_roots: list[Path] | None = None) -> None:
        self.root = Path(root)
        self.nodes = nodes
        self.prolog, self.epilog = prolog, epilog
        self._own_fabric = fabric is None
        self.fabric = fabric
        self.extra_conf = list(extra_conf or [])
        self.unmount_roots = [Path(p) for p in (unmount_roots or [])]
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self._procs: dict[str, subprocess.Popen] = {}
        # slurmctld listens on every address of the root network namespace: clusters of
        # tests running at once (pytest-xdist workers) each take a free port
        self.ctl_port = _free_port()
        # slurmd's spool holds Unix sockets, whose paths the kernel caps at 108 bytes: a
        # short directory of its own, not one below a pytest-xdist worker's tmp_path
        self.spool = Path(tempfile.mkdtemp(prefix="mtslurm-", dir="/tmp"))

    # -- files ------------------------------------------------------------------------------

    def log_path(self, daemon: str) -> Path:
        return self.root / "log" / f"{daemon}.log"

    def _write_conf(self) -> None:
        assert self.fabric is not None
        r = self.root
        for d in ("state", "log", "run"):
            (r / d).mkdir(parents=True, exist_ok=True)
        lines = [
            "ClusterName=mtcfs",
            f"SlurmctldHost={CTL_HOST}({self.fabric.gateway})",
            f"SlurmctldPort={self.ctl_port}",
            f"SlurmdPort={SLURMD_PORT}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire: also how long a requeued job waits before it may start again
            # (default 120 s); it must outlast a Prolog (the batch launch carries the
            # credential), 30 s on a loaded 2-core machine
            f"AuthInfo=socket={self.munge_socket},cred_expire=45",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={self.spool}/%n",
            f"SlurmctldPidFile={r}/run/slurmctld.pid",
            f"SlurmdPidFile={r}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={self.log_path('slurmctld')}",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            "SelectType=select/linear",
            "ReturnToService=2",
            "MailProg=/bin/true",
            # a lost node is noticed within seconds, not the default 5 minutes
            "SlurmdTimeout=10",
            "SlurmctldTimeout=10",
            "MessageTimeout=10",
            "InactiveLimit=0",
            "KillWait=5",
            "MinJobAge=300",
            "JobRequeue=1",
            "PrologEpilogTimeout=150",
            # a batch job whose Prolog (a mount) takes longer than the default 10 s is not
            # taken for lost and requeued again
            "BatchStartTimeout=150",
            "SlurmdParameters=config_overrides",
        ]
        if self.prolog:
            lines += [f"Prolog={self.prolog}", "PrologFlags=Alloc"]
        if self.epilog:
            lines.append(f"Epilog={self.epilog}")
        for n in range(self.nodes):
            lines.append(f"NodeName={node_name(n)} NodeAddr={self.fabric.addr(n)} "
                         f"NodeHostname={node_name(n)} CPUs=1 State=UNKNOWN")
        lines.append(f"PartitionName=main Nodes={node_name(0)}-{node_name(self.nodes - 1)}"
                     " Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO")
        lines[-1] = lines[-1].replace(f"{node_name(0)}-{node_name(self.nodes - 1)}",
                                      ",".join(node_name(n) for n in range(self.nodes)))
        self.conf.write_text("\n".join(lines + self.extra_conf) + "\n")

    # -- commands ---------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def cmd(self, *args: str, check: bool = True, timeout: float = 30.0,
            **kw) -> subprocess.CompletedProcess:
        """Run a Slurm client command (sbatch, scontrol, ...) against this cluster."""
        r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                           env=self.env(), **kw)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({r.returncode}): "
                               f"{r.stderr.strip()}\n{self.logs()}")
        return r

    def logs(self, n: int = 2000) -> str:
        out = []
        for p in sorted((self.root / "log").glob("*.log")):
            out.append(f"--- {p.name} ---\n{p.read_text(errors='replace')[-n:]}")
        return "\n".join(out)

    def wait(self, pred, timeout: float, what, interval: float = 0.2):
        """:func:`support.poll.wait_for`, its error naming ``what`` (a string, or a callable
        asked at the end: the last state seen) and ending with the daemons' logs."""
        try:
            return wait_for(pred, timeout, "the condition", interval)
        except TimeoutError:
            what = what() if callable(what) else what
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}\n"
                               f"{self.logs()}") from None

    # -- daemons ----------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        out = open(self.root / "log" / f"{name}.out", "wb")
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env(),
                             start_new_session=True)
        out.close()
        self._procs[name] = p
        return p

    def _start_munge(self) -> None:
        d = self.root / "munge"
        d.mkdir(mode=0o711)
        os.chmod(d, 0o711)  # munged: the socket's directory must be executable by all
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self._spawn("munged", ["munged", "-F", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--log-file={d / 'munged.log'}",
                               f"--pid-file={d / 'munged.pid'}",
                               f"--seed-file={d / 'munged.seed'}"])
        self.wait(lambda: self.munge_socket.exists() or self._dead("munged"), 10,
                  "munged's socket")
        if self._dead("munged"):
            raise RuntimeError(f"munged exited: {(self.root / 'log/munged.out').read_text()}")

    def _dead(self, name: str) -> bool:
        p = self._procs.get(name)
        return p is not None and p.poll() is not None

    def _start_slurmctld(self) -> None:
        self._spawn("slurmctld", ["unshare", "--uts", "sh", "-c",
                                  f'hostname {CTL_HOST} && exec slurmctld -D -i -f "$1"',
                                  "sh", str(self.conf)])

    def start_slurmd(self, rank: int) -> None:
        """Start node ``rank``'s slurmd (again, after :meth:`kill_slurmd`)."""
        assert self.fabric is not None
        name = node_name(rank)
        (self.spool / name).mkdir(parents=True, exist_ok=True)
        self._spawn(f"slurmd-{name}", [*self.fabric.prefix(rank), "unshare", "--uts", "sh",
                                       "-c", f'hostname {name} && exec slurmd -D -N {name} '
                                       f'-f "$1"', "sh", str(self.conf)])

    def kill_slurmd(self, rank: int) -> None:
        """SIGKILL node ``rank``'s slurmd (its host is lost)."""
        p = self._procs.get(f"slurmd-{node_name(rank)}")
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)

    def lose_node(self, rank: int) -> None:
        """Node ``rank``'s host is lost: SIGKILL its slurmd and every process in its network
        (slurmstepd, the job's tasks, the mtcfs daemon its Prolog started)."""
        self.kill_slurmd(rank)
        self._kill_in_node_networks(ranks=[rank])

    def node_state(self, rank: int) -> str:
        r = self.cmd("sinfo", "-h", "-n", node_name(rank), "-o", "%T", check=False)
        return r.stdout.strip()

    def wait_nodes_idle(self, ranks: list[int] | None = None, timeout: float = 30.0) -> None:
        ranks = list(range(self.nodes)) if ranks is None else ranks
        self.wait(lambda: all(self.node_state(r) == "idle" for r in ranks), timeout,
                  f"nodes {[node_name(r) for r in ranks]} to be idle "
                  f"(now {[self.node_state(r) for r in ranks]})")

    def start(self, timeout: float = 30.0) -> Self:
        """Bring the whole cluster up; return when every node is idle."""
        self.root.mkdir(parents=True, exist_ok=True)
        # munged wants every directory above its socket searchable by all (mkdtemp: 0700)
        for d in [self.root, *self.root.parents]:
            mode = d.stat().st_mode
            if not mode & 0o001:
                os.chmod(d, (mode & 0o7777) | 0o711)
        try:
            if self.fabric is None:
                self.fabric = Fabric(self.nodes).create()
            self._write_conf()
            self._start_munge()
            self._start_slurmctld()
            self.wait(lambda: self._dead("slurmctld") or
                      self.cmd("scontrol", "ping", check=False).stdout.find("UP") >= 0,
                      timeout, "slurmctld to answer scontrol ping")
            if self._dead("slurmctld"):
                raise RuntimeError(f"slurmctld exited\n{self.logs()}")
            for r in range(self.nodes):
                self.start_slurmd(r)
            self.wait_nodes_idle(timeout=timeout)
        except BaseException:
            self.cleanup()
            raise
        return self

    # -- jobs -------------------------------------------------------------------------------

    def sbatch(self, *args: str) -> int:
        r = self.cmd("sbatch", "--parsable", *args)
        return int(r.stdout.strip().split(";")[0])

    def job(self, jobid: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, NodeList, Restarts, ...)."""
        r = self.cmd("scontrol", "show", "job", str(jobid), "-o", check=False)
        out: dict[str, str] = {}
        for word in r.stdout.split():
            k, sep, v = word.partition("=")
            if sep:
                out.setdefault(k, v)
        return out

    def wait_job(self, jobid: int, states: tuple[str, ...] = ("COMPLETED",),
                 timeout: float = 60.0) -> dict[str, str]:
        """Wait until job ``jobid`` is in one of ``states``; raise if it ends otherwise."""
        final = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL",
                 "OUT_OF_MEMORY", "PREEMPTED", "DEADLINE"}
        seen: dict[str, dict[str, str]] = {}

        def done():
            j = self.job(jobid)
            seen["j"] = j
            st = j.get("JobState", "")
            if st in states:
                return j
            drained = [node_name(r) for r in range(self.nodes)
                       if self.node_state(r).startswith("drain")]
            if drained:
                raise RuntimeError(f"job {jobid} ({st}): nodes {drained} were drained "
                                   f"(a Prolog failed?): {j}\n{self.logs()}")
            if st in final:
                raise RuntimeError(f"job {jobid} ended {st}, not {states}: {j}\n{self.logs()}")
            return None

        return self.wait(done, timeout,
                         lambda: f"job {jobid} to be {states} (last: {seen.get('j')})")

    # -- teardown ---------------------------------------------------------------------------

    def _node_network_pids(self, ranks: list[int] | None = None) -> list[int]:
        """Every process in one of the nodes' (or ``ranks``') network namespaces."""
        if self.fabric is None:
            return []
        inodes = set()
        for r in (range(self.nodes) if ranks is None else ranks):
            try:
                inodes.add(os.stat(f"/run/netns/{self.fabric.name(r)}").st_ino)
            except OSError:
                pass
        pids = []
        for d in os.listdir("/proc"):
            if d.isdigit() and int(d) != os.getpid():
                try:
                    if os.stat(f"/proc/{d}/ns/net").st_ino in inodes:
                        pids.append(int(d))
                except OSError:
                    pass
        return pids

    def _kill_in_node_networks(self, timeout: float = 10.0,
                               ranks: list[int] | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = self._node_network_pids(ranks)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    def cleanup(self) -> None:
        """Kill every daemon, detach every mount below ``root`` and the unmount roots, remove
        the namespaces. Never raises."""
        for name, p in reversed(list(self._procs.items())):
            try:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        for name, p in self._procs.items():
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=5)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
        # what the daemons left running in the nodes' networks: slurmstepd (it detaches from
        # slurmd), the job's tasks, the mtcfs daemons the Prologs started (setsid)
        self._kill_in_node_networks()
        for d in [*self.unmount_roots, self.root]:
            try:
                unmount_below(d)
            except Exception:  # noqa: BLE001 (cleanup never raises)
                pass
        if self._own_fabric and self.fabric is not None:
            self.fabric.destroy()
        shutil.rmtree(self.spool, ignore_errors=True)
