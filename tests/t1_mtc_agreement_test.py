"""The restore vote of Orbax multi-tier checkpointing (replication/mtc/agreement.py): the
coordinator decides only once every rank voted, decides the newest step all of them hold,
and gives every rank the same answer, even ranks that ask again or come late."""

import pytest

from replication.mtc.agreement import LATCH_S, VOTE_TTL_S, Ballot
from replication.peer.records import StepRef


def steps(*nums):
    return [StepRef(str(n), n) for n in nums]


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_waits_for_every_rank_then_picks_the_newest_common_step():
    b = Ballot(3, clock=Clock())
    r0 = b.vote(0, "a", steps(1, 2, 3))
    assert not r0.decided and r0.waiting_for == (1, 2)
    assert not b.vote(2, "c", steps(1, 2, 3)).decided
    r1 = b.vote(1, "b", steps(1, 2))  # one node is behind: it never committed step 3
    assert r1.decided and r1.step == StepRef("2", 2)
    # The others get the same answer on their next call, whatever they vote now.
    assert b.vote(0, "a", steps(1, 2, 3)).step == StepRef("2", 2)
    assert b.vote(2, "c", steps(3)).step == StepRef("2", 2)


def test_nothing_in_common_means_nothing_to_restore():
    b = Ballot(2, clock=Clock())
    b.vote(0, "a", steps(5))
    r = b.vote(1, "b", [])
    assert r.decided and r.step is None
    assert b.vote(0, "a", steps(5)).decided and b.vote(0, "a", steps(5)).step is None


def test_a_new_round_after_everyone_fetched_the_decision():
    b = Ballot(2, clock=Clock())
    b.vote(0, "a", steps(1))
    assert b.vote(1, "b", steps(1)).step == StepRef("1", 1)
    assert b.vote(0, "a", steps(1)).step == StepRef("1", 1)
    # The trainers restart: new vote ids, step 2 now everywhere.
    assert not b.vote(0, "a2", steps(1, 2)).decided
    assert b.vote(1, "b2", steps(1, 2)).step == StepRef("2", 2)
    assert b.decisions == 2


def test_a_counted_rank_voting_again_starts_a_new_round():
    """Rank 1's vote was counted, then its daemon died before it fetched the decision; its
    replacement votes anew (the job restarted): the old decision is not handed to the new
    vote, nor kept for rank 0 (whose trainer restarts too); the ranks decide again."""
    b = Ballot(2, clock=Clock())
    b.vote(1, "B", steps(1, 2))
    assert b.vote(0, "A", steps(1, 2)).step == StepRef("2", 2)  # rank 1 never fetches it
    r = b.vote(1, "C", steps(1))  # the replacement: new vote id, only step 1 now
    assert not r.decided and r.waiting_for == (0,)
    assert b.vote(0, "D", steps(1, 2)).step == StepRef("1", 1)
    assert b.vote(1, "C", steps(1)).step == StepRef("1", 1)


def test_a_repeated_call_gets_its_answer_even_after_everyone_fetched():
    b = Ballot(2, clock=Clock())
    b.vote(0, "a", steps(4))
    assert b.vote(1, "b", steps(4)).decided
    assert b.vote(0, "a", steps(4)).decided  # now every rank fetched it
    assert b.vote(1, "b", steps(4)).step == StepRef("4", 4)  # its reply was lost: asks again
    assert b.decisions == 1


def test_stale_votes_and_decisions_expire():
    clock = Clock()
    b = Ballot(2, clock=clock)
    b.vote(0, "a", steps(7))
    clock.t += VOTE_TTL_S + 1  # rank 0 stopped asking (its trainer died)
    assert not b.vote(1, "b", steps(7)).decided
    b.vote(0, "a2", steps(7))
    assert b.vote(1, "b", steps(7)).decided  # decided at rank 1's call
    clock.t += LATCH_S + 1  # rank 0 never fetched it: the latch lets go
    assert not b.vote(0, "a3", steps(7, 8)).decided


def test_a_rank_outside_the_job_is_refused():
    with pytest.raises(ValueError, match="outside 0..1"):
        Ballot(2).vote(2, "x", [])
