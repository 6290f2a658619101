"""mtcfs plan: the RAM tier sizing rule and Young/Daly's checkpoint interval (mtcfs/plan.py),
checked against the worked example of the sizing rule's source and the papers' formulas."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from mtcfs.plan import parse_params, plan_interval, plan_size


def test_the_sizing_rules_worked_example():
    """GKE's example (../shared/seeds): 70B parameters over 32 hosts: 840 GB in all, 26.25 GB
    per host, x 2 = 52.5 GB, + 15 % = 60.4 GB ("at least 60 GB")."""
    p = plan_size(parse_params("70B"), 32)
    assert p.total == 840_000_000_000
    assert p.shard == 26_250_000_000
    assert p.own == 52_500_000_000
    assert p.size == math.ceil(52_500_000_000 * 1.15)
    with_peer = plan_size(parse_params("70B"), 32, replicas=1)
    assert with_peer.size == math.ceil(3 * 26_250_000_000 * 1.15)


def test_young_and_daly():
    ip = plan_interval(3 * 3600, 20)
    assert ip.young_s == pytest.approx(math.sqrt(2 * 20 * 10800))  # 657 s
    x = 20 / (2 * 10800)
    assert ip.daly_s == pytest.approx(ip.young_s * (1 + math.sqrt(x) / 3 + x / 9) - 20)
    assert ip.waste == pytest.approx(20 / ip.daly_s + (ip.daly_s + 20) / (2 * 10800))
    # a save longer than twice the MTBF: checkpoint once per MTBF (Daly)
    assert plan_interval(10, 30).daly_s == 30
    # the optimum is an optimum: nearby intervals lose more
    def waste(t: float) -> float:
        return 20 / t + (t + 20) / (2 * 10800)
    assert waste(ip.daly_s) <= min(waste(ip.daly_s * 0.8), waste(ip.daly_s * 1.25))


@pytest.mark.parametrize("bad", ["", "x", "-3B", "0", "7Q"])
def test_bad_parameter_counts(bad):
    with pytest.raises(ValueError):
        parse_params(bad)


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mtcfs", "plan", *args], capture_output=True,
                          text=True, timeout=60)


def test_the_command():
    r = _plan("--params", "70B", "--hosts", "32", "--mtbf", "3h", "--save-seconds", "20")
    assert r.returncode == 0, r.stderr
    assert "60.4 GB" in r.stdout and "size=57G" in r.stdout
    assert "10.7 min" in r.stdout and "Young 1974: 11.0 min" in r.stdout


@pytest.mark.parametrize("args", [(), ("--params", "70B"), ("--hosts", "0", "--params", "1B"),
                                  ("--mtbf", "soon", "--save-seconds", "20"),
                                  ("--params", "1B", "--hosts", "4", "--replicas", "4")])
def test_bad_input_is_one_line_and_exit_2(args):
    r = _plan(*args)
    assert r.returncode == 2, r
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("mtcfs: "), r.stderr


def test_expected_waste_is_the_model_of_plan_interval():
    from mtcfs.plan import expected_waste
    ip = plan_interval(10800, 20, restart_s=120)
    assert expected_waste(ip.daly_s, 10800, 20, 120) == pytest.approx(ip.waste)
    # a longer interval than the optimum saves less often but redoes more
    assert expected_waste(2 * ip.daly_s, 10800, 20, 120) > ip.waste
    assert expected_waste(1e9, 1, 1) == 1.0
    with pytest.raises(ValueError):
        expected_waste(0, 10800, 20)
