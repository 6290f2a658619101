"""Soft membership state, built from heartbeats: who is in the job, who is alive, which
steps each rank has complete, who coordinates.

This is the table behind the Heartbeat RPC. It is *soft*: it holds only what the reports
said, so any node can rebuild it from the next round of heartbeats after it takes over as
coordinator. Rules:

* A member is **alive** if its last heartbeat arrived within ``liveness_s``. The server's own
  rank, when it has one, is always alive.
* The **coordinator** is the lowest live rank (rank 0 while it lives; when it dies, the next
  lowest takes over without anyone deciding it).
* A step is **complete in the job** when every rank 0..nodes-1 reported it complete; the
  newest such step is what a restore brings back. A reporter may also pass on the newest
  job-complete step an earlier coordinator told it (``job_complete``): a step once complete
  on all ranks stays so, and a new coordinator, whose table lacks the reports of the rank
  that died with the old one, keeps the fact. Reports accumulate (a rank that evicted a
  step from its RAM still completed it), bounded to the newest :data:`STEPS_REMEMBERED` per
  rank.
* ``membership_version`` changes when a member joins, changes address or labels, dies or
  comes back, so a node can ask for the member list only when it changed (a 1,000-node job
  would otherwise move a million member records per heartbeat round).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from replication.peer.records import HeartbeatResult, MemberInfo, StepRef

#: Default seconds without a heartbeat after which a member counts as dead.
DEFAULT_LIVENESS_S = 10.0
#: Steps remembered per rank (the newest by number).
STEPS_REMEMBERED = 16


@dataclass
class _Member:
    address: str
    labels: dict[str, str]
    last_seen: float
    capacity_bytes: int = 0
    used_bytes: int = 0
    steps: dict[int, str] = field(default_factory=dict)  # step_number -> step name
    alive: bool = True
    job_complete: StepRef | None = None  # newest step it was told is complete on all ranks


class Membership:
    """Heartbeat reports of one job's ranks. Thread-safe.

    Args:
        nodes: ranks in the job (N; ranks are 0..N-1).
        self_rank: the rank of the node this table lives on, always alive; None if unknown.
        self_address: its Peer service address.
        self_labels: its topology labels.
        liveness_s: seconds without a heartbeat after which a member counts as dead.
        clock: monotonic seconds (injectable for tests).

    Raises:
        ValueError: if ``nodes < 1``, ``self_rank`` is out of range or ``liveness_s <= 0``.
    """

    def __init__(self, nodes: int, *, self_rank: int | None = None, self_address: str = "",
                 self_labels: Mapping[str, str] | None = None,
                 liveness_s: float = DEFAULT_LIVENESS_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        if self_rank is not None and not 0 <= self_rank < nodes:
            raise ValueError(f"self_rank {self_rank} is outside 0..{nodes - 1}")
        if liveness_s <= 0:
            raise ValueError(f"liveness_s must be > 0, got {liveness_s}")
        self._nodes = nodes
        self._self_rank = self_rank
        self._liveness_s = liveness_s
        self._clock = clock
        self._lock = threading.Lock()
        self._members: dict[int, _Member] = {}
        self._version = 1
        if self_rank is not None:
            self._members[self_rank] = _Member(self_address, dict(self_labels or {}), clock())

    @property
    def nodes(self) -> int:
        return self._nodes

    def report(self, rank: int, *, address: str, labels: Mapping[str, str],
               steps_complete: Iterable[StepRef] = (), capacity_bytes: int = 0,
               used_bytes: int = 0, job_complete: StepRef | None = None) -> None:
        """Record one heartbeat of ``rank``.

        ``job_complete``: the newest step the reporter knows to be complete on all ranks.

        Raises:
            ValueError: if ``rank`` is outside 0..nodes-1.
        """
        if not 0 <= rank < self._nodes:
            raise ValueError(f"rank {rank} is outside 0..{self._nodes - 1}")
        now = self._clock()
        with self._lock:
            m = self._members.get(rank)
            if m is None:
                m = self._members[rank] = _Member(address, dict(labels), now)
                self._version += 1
            elif m.address != address or m.labels != dict(labels):
                m.address, m.labels = address, dict(labels)
                self._version += 1
            m.last_seen = now
            m.capacity_bytes, m.used_bytes = capacity_bytes, used_bytes
            if job_complete is not None and (m.job_complete is None or
                                             job_complete.step_number > m.job_complete.step_number):
                m.job_complete = job_complete
            for s in steps_complete:
                m.steps[s.step_number] = s.step
            if len(m.steps) > STEPS_REMEMBERED:
                for n in sorted(m.steps)[:-STEPS_REMEMBERED]:
                    del m.steps[n]

    def view(self, known_version: int = 0) -> HeartbeatResult:
        """What this table knows now.

        Args:
            known_version: the ``membership_version`` the caller last saw; the member list
                is left out (None) when it is still current.
        """
        now = self._clock()
        with self._lock:
            for rank, m in self._members.items():
                alive = rank == self._self_rank or now - m.last_seen <= self._liveness_s
                if alive != m.alive:
                    m.alive = alive
                    self._version += 1
            live = [r for r, m in self._members.items() if m.alive]
            coordinator = min(live) if live else -1
            members = None
            if known_version != self._version:
                members = tuple(
                    MemberInfo(rank=r, address=m.address, labels=dict(m.labels), alive=m.alive,
                               age_s=0.0 if r == self._self_rank else max(0.0, now - m.last_seen),
                               capacity_bytes=m.capacity_bytes, used_bytes=m.used_bytes)
                    for r, m in sorted(self._members.items()))
            latest = self._latest_complete_locked()
            return HeartbeatResult(membership_version=self._version, members=members,
                                   coordinator_rank=coordinator, latest_complete=latest,
                                   nodes=self._nodes)

    def _latest_complete_locked(self) -> StepRef | None:
        told = [m.job_complete for m in self._members.values() if m.job_complete is not None]
        best_told = max(told, key=lambda s: s.step_number) if told else None
        seen = self._latest_reported_locked()
        if seen is None or (best_told is not None and best_told.step_number > seen.step_number):
            return best_told
        return seen

    def _latest_reported_locked(self) -> StepRef | None:
        if len(self._members) < self._nodes:
            return None
        common: set[int] | None = None
        for rank in range(self._nodes):
            steps = set(self._members[rank].steps)
            common = steps if common is None else common & steps
            if not common:
                return None
        assert common is not None
        best = max(common)
        name = next(self._members[r].steps[best] for r in range(self._nodes))
        return StepRef(step=name, step_number=best)
