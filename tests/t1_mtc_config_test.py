"""replicator.yaml, as Orbax's multi-tier checkpointing writes it: parsed, checked, and every
refusal names the key and the problem (it reaches the trainer through replicator.failed)."""

import pytest

from mtcfs.tiers.mtc.config import ReplicatorConfigError, parse_replicator_yaml

ORBAX = """job-name: run-7
framework: orbax
assume-data-parallelism: 2
node-rank: 1
nodes: 4
peer-ranks: [3]
backup-interval-minutes: 30
"""


def test_what_orbax_writes():
    c = parse_replicator_yaml(ORBAX, nodes=4, rank=1)
    assert (c.job_name, c.framework, c.node_rank, c.nodes) == ("run-7", "orbax", 1, 4)
    assert c.peer_ranks == (3,) and c.assume_data_parallelism == 2
    assert (c.backup_interval_minutes, c.backup_interval_steps) == (30, None)
    assert c.warnings == ()


def test_steps_interval_and_optional_keys():
    c = parse_replicator_yaml("node-rank: 0\nnodes: 2\nbackup-interval-steps: 100\n"
                              "workers-per-node: 1\n")
    assert c.backup_interval_steps == 100 and c.backup_interval_minutes is None
    assert c.peer_ranks == () and c.assume_data_parallelism is None


def test_warnings_for_what_the_job_can_run_with():
    c = parse_replicator_yaml(ORBAX.replace("orbax", "pathways") + "colour: blue\n", rank=1)
    assert any("'colour'" in w for w in c.warnings)
    assert any("pathways" in w for w in c.warnings)
    assert c.node_rank == 1


def test_a_rank_other_than_this_nodes_is_refused():
    with pytest.raises(ReplicatorConfigError, match=r"node-rank: 1, but this node is rank=2"):
        parse_replicator_yaml(ORBAX, rank=2)


@pytest.mark.parametrize("change,words", [
    (("node-rank: 1", "node-rank: 4"), ["node-rank: 4", "out of range", "0..3"]),
    (("peer-ranks: [3]", "peer-ranks: [1]"), ["peer-ranks: 1", "this node"]),
    (("peer-ranks: [3]", "peer-ranks: [3, 3]"), ["peer-ranks", "twice"]),
    (("peer-ranks: [3]", "peer-ranks: [7]"), ["peer-ranks: 7", "out of range"]),
    (("peer-ranks: [3]", "peer-ranks: three"), ["peer-ranks", "list of integers"]),
    (("assume-data-parallelism: 2", "assume-data-parallelism: 3"),
     ["assume-data-parallelism: 3", "does not divide nodes: 4"]),
    (("node-rank: 1\n", ""), ["node-rank is missing"]),
    (("nodes: 4", "nodes: four"), ["nodes: 'four'", "not an integer"]),
    (("backup-interval-minutes: 30", "backup-interval-steps: 5\nbackup-interval-minutes: 3"),
     ["exactly one"]),
    (("backup-interval-minutes: 30", "backup-interval-minutes: 0"),
     ["backup-interval-minutes: 0", "below 1"]),
])
def test_refusals_name_the_problem(change, words):
    with pytest.raises(ReplicatorConfigError) as ei:
        parse_replicator_yaml(ORBAX.replace(*change))
    for w in words:
        assert w in str(ei.value)


def test_nodes_must_match_the_job():
    with pytest.raises(ReplicatorConfigError, match="nodes: 4, but this job's mounts have nodes=8"):
        parse_replicator_yaml(ORBAX, nodes=8)


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "key: [unclosed\n"])
def test_not_a_replicator_yaml(text):
    with pytest.raises(ReplicatorConfigError, match="replicator.yaml"):
        parse_replicator_yaml(text)


def test_no_backup_interval_is_orbaxs_default_with_a_warning():
    c = parse_replicator_yaml(ORBAX.replace("backup-interval-minutes: 30\n", ""))
    assert c.backup_interval_minutes == 30 and c.backup_interval_steps is None
    assert any("no backup interval" in w for w in c.warnings)
