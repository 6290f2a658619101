"""``mtcfs plan``: how large a RAM tier per host, and how often to checkpoint.

Two rules of thumb as functions, each with its source:

- **RAM tier size** (GKE multi-tier checkpointing's sizing rule, ../shared/seeds): a full
  training checkpoint is about parameters x 12 bytes (bf16 weights, fp32 master weights and
  two fp32 Adam moments, rounded); sharded over H hosts, each host holds 1/H of it, twice
  while a save runs (the newest complete checkpoint stays until the next one commits), plus
  a 10-15 % buffer. With the peer tier (``replicas=R``), a host also holds the replicas of
  R other hosts' shards of the newest complete checkpoint: R x shard more (mtcfs's own
  addition; the replica store shares the same ``size=`` budget, ``replica_quota=``).
- **Checkpoint interval** (J. W. Young, "A first order approximation to the optimum
  checkpoint interval", CACM 17(9), 1974; J. T. Daly, "A higher order estimate of the
  optimum checkpoint interval for restart dumps", FGCS 22(3), 2006): with a save costing
  delta seconds of training and a mean time between failures M, the interval that loses
  least is tau = sqrt(2 delta M) (Young) or, to higher order while delta < 2M,
  tau = sqrt(2 delta M) [1 + sqrt(delta/(2M))/3 + (delta/(2M))/9] - delta (Daly). The
  expected share of time lost, to first order, is delta/tau (saving) + (tau + delta)/(2M)
  (work redone after a failure, half an interval on average) + R/M (restart).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

#: Bytes of checkpoint per model parameter (the sizing rule's 12).
BYTES_PER_PARAM = 12
_PARAMS_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmbt]?)", re.IGNORECASE)
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def parse_params(text: str) -> int:
    """``"70B"`` -> 70_000_000_000 (suffixes K, M, B, T are powers of 1000).

    Raises:
        ValueError: not a parameter count, or not positive.
    """
    m = _PARAMS_RE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"expected a parameter count like 7B or 350M, got {text!r}")
    n = int(float(m.group(1)) * _SCALE[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"the parameter count must be positive, got {text!r}")
    return n


@dataclass(frozen=True)
class SizePlan:
    """A RAM tier size per host (bytes)."""

    total: int  #: the full checkpoint, every host together
    shard: int  #: one host's part of it
    own: int  #: two checkpoints of this host's shard
    replicas: int  #: the replicas this host holds for R peers
    size: int  #: own + replicas, plus the buffer: the ``size=`` to give


def plan_size(params: int, hosts: int, replicas: int = 0, buffer: float = 0.15) -> SizePlan:
    """The ``size=`` per host for a model of ``params`` parameters over ``hosts`` hosts.

    Raises:
        ValueError: hosts < 1, replicas < 0 or >= hosts, buffer outside [0, 1].
    """
    if hosts < 1:
        raise ValueError("--hosts must be at least 1")
    if replicas < 0 or replicas > hosts - 1:
        raise ValueError("--replicas must be in 0..hosts-1")
    if not 0 <= buffer <= 1:
        raise ValueError("--buffer must be a fraction in 0..1 (0.15 for 15 %)")
    total = params * BYTES_PER_PARAM
    shard = math.ceil(total / hosts)
    own = 2 * shard
    held = replicas * shard
    return SizePlan(total, shard, own, held, math.ceil((own + held) * (1 + buffer)))


@dataclass(frozen=True)
class IntervalPlan:
    """A checkpoint interval (seconds) and what it costs."""

    young_s: float  #: sqrt(2 delta M)
    daly_s: float  #: Daly's higher-order optimum (M when delta >= 2M)
    waste: float  #: expected share of wall-clock time lost at daly_s (0..1)


def plan_interval(mtbf_s: float, save_s: float, restart_s: float = 0.0) -> IntervalPlan:
    """The interval between checkpoints that loses least to saves and failures.

    Args:
        mtbf_s: mean time between failures of the whole job, seconds.
        save_s: seconds of training each save costs (the time the trainer is blocked).
        restart_s: seconds from a failure to training again (restore included).

    Raises:
        ValueError: a value that is not positive (restart_s: negative).
    """
    if mtbf_s <= 0 or save_s <= 0 or restart_s < 0:
        raise ValueError("--mtbf and --save-seconds must be positive, --restart-seconds >= 0")
    young = math.sqrt(2 * save_s * mtbf_s)
    if save_s < 2 * mtbf_s:
        x = save_s / (2 * mtbf_s)
        daly = young * (1 + math.sqrt(x) / 3 + x / 9) - save_s
    else:
        daly = mtbf_s
    daly = max(daly, save_s)
    return IntervalPlan(young, daly, expected_waste(daly, mtbf_s, save_s, restart_s))


def expected_waste(interval_s: float, mtbf_s: float, save_s: float,
                   restart_s: float = 0.0) -> float:
    """The expected share of wall-clock time lost (0..1), to first order, when checkpointing
    every ``interval_s`` seconds of training: ``save_s / interval_s`` (saving) +
    ``(interval_s + save_s) / (2 mtbf_s)`` (half an interval redone per failure) +
    ``restart_s / mtbf_s`` (restart), capped at 1. The model of :func:`plan_interval`, for
    an interval that is not the optimum (e.g. another strategy's).

    Raises:
        ValueError: interval or MTBF not positive, save or restart time negative.
    """
    if interval_s <= 0 or mtbf_s <= 0 or save_s < 0 or restart_s < 0:
        raise ValueError("interval and MTBF must be positive, save and restart times >= 0")
    return min(1.0, save_s / interval_s + (interval_s + save_s) / (2 * mtbf_s)
               + restart_s / mtbf_s)
