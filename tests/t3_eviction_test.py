"""The eviction policy (core/eviction.py) alone: an Eviction over a fake host whose steps
each hold one file, no Filesystem. Eviction through the real core is in t3_budget_test.py
and t4_capacity_test.py.

Each test ends with the consistency check: the host's ``used`` is what the steps not
evicted hold, and every step the policy evicted was acted on exactly once.
"""

from __future__ import annotations

from mtcfs.core.eviction import Eviction
from mtcfs.core.model import ROOT_INO, Inode, Version
from mtcfs.core.records import Counters, StepRecord

MB = 1 << 20


def inode(num: int, kind: str, vid: int | None = None) -> Inode:
    return Inode(num, kind, 0o40755 if kind == "dir" else 0o100644, 0, 0, 1, 0, 0, 0,
                 vid=vid, children={} if kind == "dir" else None)


class Host:
    """Steps ``step_N`` (directory inode 10+N, one file inode 100+N of version N)."""

    def __init__(self, steps: dict[int, bool], size: int = MB) -> None:
        self.steps: dict[str, StepRecord] = {}
        self.inodes: dict[int, Inode] = {ROOT_INO: inode(ROOT_INO, "dir")}
        self.versions: dict[int, Version] = {}
        self.job_scope = False  # scope=node
        self.step_registry = self  # versions_of: one version per step
        self.tree = self  # walk
        self.acted: list[tuple[str, str]] = []
        for n, backed_up in steps.items():
            name = f"step_{n}"
            self.steps[name] = StepRecord(name=name, number=n, ino=10 + n, committed_ns=n,
                                          backed_up_ns=1 if backed_up else None, source="")
            self.inodes[10 + n] = inode(10 + n, "dir")
            self.inodes[100 + n] = inode(100 + n, "file", vid=n)
            self.versions[n] = Version(vid=n, ino=100 + n, size=size, chunk_size=MB,
                                       sealed=True, alloc=size)

    @property
    def used(self) -> int:
        return sum(v.alloc for v in self.versions.values())

    def walk(self, top: Inode):
        yield "", top
        yield "f", self.inodes[90 + top.ino]

    def versions_of(self, s: StepRecord) -> list[Version]:
        return [self.versions[s.number]]

    def drop_step_data(self, s: StepRecord, others_only: bool = False) -> None:
        self.acted.append(("drop", s.name))
        self.versions[s.number].alloc = 0

    def delete_step(self, s: StepRecord) -> None:
        self.acted.append(("delete", s.name))
        del self.steps[s.name]
        self.versions[s.number].alloc = 0

    def delete_dir_tree(self, top: Inode) -> None:
        self.acted.append(("delete_dir", str(top.ino)))


def consistent(host: Host, evicted: list[str]) -> None:
    assert host.used == MB * (len(host.versions) - len(evicted))
    assert sorted(n for _a, n in host.acted) == sorted(evicted)
    for _a, name in host.acted:
        assert host.versions[int(name.split("_")[1])].alloc == 0


def test_without_pressure_keep_and_the_newest_stay_and_only_saved_steps_go():
    host = Host({1: True, 2: False, 3: True, 4: True, 5: True})
    ev = Eviction(host, host, Counters(), keep=2)
    assert [s.name for s in ev.evictable_steps(pressure=False)] == ["step_1", "step_3"]
    evicted = ev.evict()
    assert evicted == ["step_1", "step_3"] and host.acted == [("drop", "step_1"),
                                                              ("drop", "step_3")]
    consistent(host, evicted)


def test_under_pressure_saved_go_first_then_unsaved_oldest_first_and_it_stops_in_time():
    host = Host({1: False, 2: True, 3: False, 4: False, 5: True})
    counters = Counters()
    ev = Eviction(host, host, counters, keep=2)
    assert [s.name for s in ev.evictable_steps(pressure=True)] == \
        ["step_2", "step_1", "step_3", "step_4"]
    host.versions[3].handles = 1  # open: it stops there, never a newer one in its place
    assert [s.name for s in ev.evictable_steps(pressure=True)] == ["step_2", "step_1"]
    host.versions[3].handles = 0
    evicted = ev.evict(need=2 * MB)
    assert evicted == ["step_2", "step_1"]
    assert host.acted == [("drop", "step_2"), ("delete", "step_1")]
    assert ev.unsaved_deleted == ["step_1"] and counters.deleted_unsaved_steps == 1
    consistent(host, evicted)


def test_a_reads_room_never_deletes_an_unsaved_step():
    host = Host({1: False, 2: False, 3: True, 4: False})
    ev = Eviction(host, host, Counters(), keep=1)
    ev.make_room(10 * MB, True)  # keep_unsaved: only steps held elsewhere
    assert host.acted == [("drop", "step_3")] and ev.evict_unsaved
    ev.evict_unsaved = False  # evict_unsaved=no: a write's room never deletes one either
    ev.make_room(10 * MB, False)
    assert host.acted == [("drop", "step_3")]
    consistent(host, ["step_3"])


def test_no_leftovers_without_a_crash_before():
    host = Host({1: True})
    ev = Eviction(host, host, Counters(), keep=1)
    ev.loaded(0, previous_crash=False)
    assert ev.crash_leftovers() == []
    consistent(host, [])
