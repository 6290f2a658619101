"""Tier-1 tests of peer selection (placement) and of the soft membership table: pure logic,
checked against the failure coverage the docs claim, by brute force over failure sets."""

from __future__ import annotations

from itertools import combinations

import pytest

from mtcfs.tiers.peer.placement import (
    data_parallel_peers, group_peers, holders, parse_labels, ring_peers, topology_peers,
)


def lost_ranks(peer_map: dict[int, list[int]], failed: set[int],
               identical: dict[int, set[int]] | None = None) -> set[int]:
    """Ranks whose data is gone when ``failed`` nodes die: the rank and all its peers (and,
    with data parallelism, all ranks holding identical data) are among the failed."""
    out = set()
    for r, peers in peer_map.items():
        holders_ = {r, *peers} | (identical or {}).get(r, set())
        if holders_ <= failed:
            out.add(r)
    return out


def bad_sets(peer_map: dict[int, list[int]], k: int) -> int:
    return sum(1 for f in combinations(peer_map, k) if lost_ranks(peer_map, set(f)))


# -- ring -----------------------------------------------------------------------------------

def test_ring():
    assert ring_peers(0, 4) == [1]
    assert ring_peers(3, 4, 2) == [0, 1]
    assert ring_peers(2, 4, 0) == []
    assert ring_peers(0, 1, 0) == []
    for bad in ((0, 4, 4), (4, 4, 1), (-1, 4, 1), (0, 0, 0)):
        with pytest.raises(ValueError):
            ring_peers(*bad)
    n, r = 10, 2
    pm = {x: ring_peers(x, n, r) for x in range(n)}
    assert all(len(v) == r for v in holders(n, lambda x: ring_peers(x, n, r)).values())
    assert bad_sets(pm, r) == 0                     # any R failures survived
    assert bad_sets(pm, r + 1) == n                 # only runs of R+1 consecutive ranks


# -- Gemini group placement -----------------------------------------------------------------

def test_group_placement_when_m_divides_n():
    assert [group_peers(r, 8, 2) for r in range(8)] == \
        [[1], [0], [3], [2], [5], [4], [7], [6]]
    assert group_peers(4, 9, 3) == [5, 3]
    pm = {r: group_peers(r, 8, 2) for r in range(8)}
    ring = {r: ring_peers(r, 8, 1) for r in range(8)}
    # Gemini: of the 28 pairs of failed nodes, groups lose data on N/m = 4, a ring on N = 8
    assert bad_sets(pm, 1) == 0 and bad_sets(pm, 2) == 4 and bad_sets(ring, 2) == 8


def test_mixed_placement_when_m_does_not_divide_n():
    n, m = 7, 2
    pm = {r: group_peers(r, n, m) for r in range(n)}
    assert pm[0] == [1] and pm[2] == [3]
    assert (pm[4], pm[5], pm[6]) == ([5], [6], [4])  # the tail of m + N mod m is a ring
    assert all(len(p) == m - 1 for p in pm.values())
    assert all(len(h) == m - 1 for h in holders(n, lambda r: group_peers(r, n, m)).values())
    assert bad_sets(pm, m - 1) == 0
    assert group_peers(0, 3, 1) == []
    with pytest.raises(ValueError):
        group_peers(0, 3, 4)


# -- data-parallel pairing ------------------------------------------------------------------

def test_data_parallel_pairs_identical_ranks():
    n, d = 8, 4                         # stride N/D = 2: ranks r, r+2, r+4, r+6 are identical
    assert data_parallel_peers(1, n, d, 1) == [3]
    assert data_parallel_peers(1, n, d, 3) == [3, 7, 5]
    assert data_parallel_peers(1, n, d, 4) == [3, 7, 5, 2]   # beyond D-1: the ring, bytes
    assert data_parallel_peers(0, 4, 2, 1) == [2]
    assert data_parallel_peers(2, 4, 2, 1) == [0]
    assert data_parallel_peers(0, 4, 1, 1) == [1]           # D=1: nothing identical: ring
    for r in range(n):
        assert all((p - r) % 2 == 0 for p in data_parallel_peers(r, n, d, d - 1))
    with pytest.raises(ValueError):
        data_parallel_peers(0, 6, 4, 1)
    # coverage: a shard is lost only when all D of its holders fail
    ident = {r: {x for x in range(n) if (x - r) % 2 == 0} for r in range(n)}
    pm = {r: data_parallel_peers(r, n, d, 1) for r in range(n)}
    assert not any(lost_ranks(pm, set(f), ident) for f in combinations(range(n), d - 1))
    assert lost_ranks(pm, {1, 3, 5, 7}, ident) == {1, 3, 5, 7}


# -- topology -------------------------------------------------------------------------------

def labels_2x2x2() -> list[dict[str, str]]:
    """8 nodes: zones a, b; blocks 0, 1 in each; 2 nodes per block."""
    return [{"zone": "ab"[r // 4], "block": str(r // 2 % 2), "host": str(r)} for r in range(8)]


def test_topology_close_then_distant():
    labels = labels_2x2x2()
    pm = {r: topology_peers(r, labels, 2) for r in range(8)}
    for r, (close, far) in pm.items():
        assert labels[close]["zone"] == labels[r]["zone"]
        assert labels[close]["block"] == labels[r]["block"]
        assert labels[far]["zone"] != labels[r]["zone"]
    assert all(len(h) == 2 for h in holders(8, lambda r: topology_peers(r, labels, 2)).values())
    assert topology_peers(0, labels, 1) == [1]
    # coverage: a whole block or a whole zone goes, and no data is lost
    for zone in "ab":
        assert not lost_ranks(pm, {r for r in range(8) if labels[r]["zone"] == zone})
    for blk in {(x["zone"], x["block"]) for x in labels}:
        assert not lost_ranks(pm, {r for r in range(8)
                                   if (labels[r]["zone"], labels[r]["block"]) == blk})
    assert bad_sets(pm, 2) == 0


def test_topology_fallbacks():
    one_zone = [{"zone": "a", "block": str(r // 2)} for r in range(6)]
    for r in range(6):
        close, far = topology_peers(r, one_zone, 2)
        assert one_zone[close]["block"] == one_zone[r]["block"]
        assert one_zone[far]["block"] != one_zone[r]["block"]
    no_labels = [{} for _ in range(5)]
    assert topology_peers(2, no_labels, 2) == [3, 4]          # the ring
    lonely = [{"zone": "a", "block": "0"}, {"zone": "b", "block": "0"},
              {"zone": "b", "block": "0"}]
    assert topology_peers(0, lonely, 2) == [1, 2]             # no block mate: distant first


def test_parse_labels():
    assert parse_labels("zone=a, block=3,host=17") == {"zone": "a", "block": "3", "host": "17"}
    assert parse_labels("") == {}
    for bad in ("zone", "=a", "zone=a,zone=b"):
        with pytest.raises(ValueError):
            parse_labels(bad)
