"""Peer selection: which ranks hold copies of a rank's data. Pure functions, no I/O.

Every function returns the *peers* of one rank (the ranks its data is copied to), best first,
never the rank itself, and is deterministic: every node computes the same map from the same
inputs, so no one has to agree on it at run time. :func:`holders` inverts a placement (whose
data does a rank hold) for restore and garbage collection.

Failure coverage, for N nodes and failures of whole nodes (a node's RAM tier and the replicas
it holds are lost together):

==================  ==========================================================================
placement           the data of rank r is lost only if ...
==================  ==========================================================================
ring, R replicas    r and all of r+1..r+R fail: any R failures are survived; of the sets of
                    R+1 failed nodes, the N runs of consecutive ranks lose data.
group, m copies     its whole group of m fails: any m-1 failures are survived; of the sets of
(Gemini)            m failed nodes only the N/m groups lose data, m times fewer than a ring
                    with the same m-1 replicas. Gemini (Wang et al., "Gemini: Fast Failure
                    Recovery in Distributed Training with In-Memory Checkpoints", SOSP'23)
                    shows group placement maximises the probability of recovering from
                    CPU memory when m divides N, and m = 2 already covers most failures.
data-parallel, D    all D data-parallel replicas of r's shard fail (they wrote identical data,
                    so each holds it whether or not it was sent): group placement with the D
                    replicas of a shard as the group, at the cost of hashes only.
topology            r, its close peer (same block) and its distant peer (another zone) all
(close + distant)   fail: a whole block or zone can go (its members' distant copies are
                    elsewhere), and so can any 2 nodes; losing data needs failures in two
                    failure domains at once. A single failure restores at intra-block speed.
==================  ==========================================================================

Ranks are usually numbered by position (consecutive ranks share a host block or slice), so a
ring's neighbours share failure domains: one block failure can take r and r+1..r+R together.
Use topology labels or data-parallel pairing where correlated failures matter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

#: Label naming the close failure domain (high bandwidth inside it), e.g. a block or slice.
CLOSE_KEY = "block"
#: Label naming the distant failure domain, e.g. a zone or superblock.
FAR_KEY = "zone"


def _check(rank: int, nodes: int) -> None:
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    if not 0 <= rank < nodes:
        raise ValueError(f"rank {rank} is outside 0..{nodes - 1}")


def _check_replicas(replicas: int, nodes: int) -> None:
    if not 0 <= replicas <= nodes - 1:
        raise ValueError(f"{replicas} replicas need 0..{nodes - 1} (nodes - 1) other nodes")


def ring_peers(rank: int, nodes: int, replicas: int = 1) -> list[int]:
    """The ring: rank r's data goes to r+1, ..., r+R (mod N).

    Each node holds the replicas of exactly R others, so load is even.

    Raises:
        ValueError: if ``rank`` is outside 0..N-1 or ``replicas`` outside 0..N-1.
    """
    _check(rank, nodes)
    _check_replicas(replicas, nodes)
    return [(rank + k) % nodes for k in range(1, replicas + 1)]


def group_peers(rank: int, nodes: int, copies: int = 2) -> list[int]:
    """Gemini's group placement: ranks in groups of ``copies`` (m) consecutive ranks; each
    rank's data goes to the other m-1 members of its group.

    When m does not divide N, Gemini's *mixed* placement: the first floor(N/m)-1 groups as
    above, and the last m + (N mod m) ranks as a ring with m-1 replicas each.

    Raises:
        ValueError: if ``rank`` is out of range or ``copies`` outside 1..N.
    """
    _check(rank, nodes)
    if not 1 <= copies <= nodes:
        raise ValueError(f"copies must be 1..{nodes}, got {copies}")
    groups = nodes // copies
    if nodes % copies == 0 or rank < (groups - 1) * copies:
        first = rank - rank % copies
        return [first + (rank - first + k) % copies for k in range(1, copies)]
    tail_start = (groups - 1) * copies
    tail = nodes - tail_start
    pos = rank - tail_start
    return [tail_start + (pos + k) % tail for k in range(1, copies)]


def data_parallel_peers(rank: int, nodes: int, dp: int, replicas: int = 1) -> list[int]:
    """Pair ranks that hold identical data (``assume_data_parallelism=D``).

    With N nodes and D data-parallel replicas, ranks r, r+N/D, r+2N/D, ... hold the same
    shard, so r's peers are r+N/D, r-N/D, r+2N/D, r-2N/D, ... (mod N): replication between
    them moves hashes, not bytes. Beyond the D-1 identical ranks, further replicas follow the
    ring (and cost bytes).

    Raises:
        ValueError: if ``rank`` is out of range, D does not divide N, or ``replicas`` is
            outside 0..N-1.
    """
    _check(rank, nodes)
    _check_replicas(replicas, nodes)
    if dp < 1 or nodes % dp:
        raise ValueError(f"assume_data_parallelism={dp} must divide nodes={nodes}")
    stride = nodes // dp
    out: list[int] = []
    for k in range(1, dp):
        for cand in ((rank + k * stride) % nodes, (rank - k * stride) % nodes):
            if cand != rank and cand not in out:
                out.append(cand)
    for k in range(1, nodes):
        if (rank + k) % nodes not in out:
            out.append((rank + k) % nodes)
    return out[:replicas]


def topology_peers(rank: int, labels: Sequence[Mapping[str, str]], replicas: int = 2, *,
                   close_key: str = CLOSE_KEY, far_key: str = FAR_KEY) -> list[int]:
    """One close peer in the same block, one distant peer in another zone, then the rest.

    ``labels[r]`` are rank r's topology labels (``{"zone": "a", "block": "3"}``); a missing
    label counts as the value "". The choices keep load even:

    * close: the next rank (cyclically, by rank) in r's own (zone, block);
    * distant: in the next zone (zones in sorted order, cyclically), the member at r's
      position within its own zone (position modulo that zone's size), like Orbax's
      "same index in another slice". With one zone, the same rule over blocks;
    * further replicas: the positional member of the zone after that, and so on, then the
      ring order.

    When a domain is missing (a block of one, a single zone), the slot falls back to the next
    rule rather than being skipped. With ``replicas=1`` only the close peer is chosen, which
    covers node failures only: use 2 for domain failures.

    Raises:
        ValueError: if ``rank`` is outside the labels list or ``replicas`` outside 0..N-1.
    """
    nodes = len(labels)
    _check(rank, nodes)
    _check_replicas(replicas, nodes)

    def far(r: int) -> str:
        return labels[r].get(far_key, "")

    def close(r: int) -> tuple[str, str]:
        return far(r), labels[r].get(close_key, "")

    out: list[int] = []

    def add(r: int | None) -> None:
        if r is not None and r != rank and r not in out:
            out.append(r)

    same_block = [r for r in range(nodes) if close(r) == close(rank)]
    if len(same_block) > 1:
        add(same_block[(same_block.index(rank) + 1) % len(same_block)])
    zones = sorted({far(r) for r in range(nodes)})
    if len(zones) > 1:
        mine = [r for r in range(nodes) if far(r) == far(rank)]
        pos = mine.index(rank)
        zi = zones.index(far(rank))
        for k in range(1, len(zones)):
            members = [r for r in range(nodes) if far(r) == zones[(zi + k) % len(zones)]]
            add(members[pos % len(members)])
    else:
        blocks = sorted({close(r) for r in range(nodes)})
        if len(blocks) > 1:
            pos = same_block.index(rank)
            bi = blocks.index(close(rank))
            for k in range(1, len(blocks)):
                members = [r for r in range(nodes) if close(r) == blocks[(bi + k) % len(blocks)]]
                add(members[pos % len(members)])
    for k in range(1, nodes):
        add((rank + k) % nodes)
    return out[:replicas]


def holders(nodes: int, peers_of: Callable[[int], Sequence[int]]) -> dict[int, list[int]]:
    """Invert a placement: for each rank, the ranks whose data it holds, sorted.

    Args:
        nodes: N.
        peers_of: a placement bound to its parameters, e.g.
            ``lambda r: ring_peers(r, nodes, 2)``.
    """
    out: dict[int, list[int]] = {r: [] for r in range(nodes)}
    for r in range(nodes):
        for p in peers_of(r):
            out[p].append(r)
    for held in out.values():
        held.sort()
    return out


def parse_labels(text: str) -> dict[str, str]:
    """Parse ``"zone=a,block=3,host=17"`` (the ``topology=`` option) into a dict.

    Raises:
        ValueError: on an item without ``=``, an empty key, or a key given twice.
    """
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"bad topology label {item!r}: want key=value")
        if key in out:
            raise ValueError(f"topology label {key!r} given twice")
        out[key] = value.strip()
    return out
