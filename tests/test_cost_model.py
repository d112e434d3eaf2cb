"""The Trainer's cost model (pure): which config runs each bucket, and which holds the optimizer."""
import pytest

from hotswitch.train.cost_model import Base, BucketDemand, CostModel, NoConfigFits, Probe

MIB = 2**20
DEMANDS = [BucketDemand(64, 8), BucketDemand(256, 4)]
# dp4 is faster at both lengths; its replicas hold the whole model (weights + fp32 grads 40 MiB), tp4sp a quarter
STATE = {"dp4": 40 * MIB, "tp4sp": 10 * MIB}
OPTIMIZER = {"dp4": 80 * MIB, "tp4sp": 20 * MIB}  # AdamW's moments: whole in dp4, a quarter in tp4sp
ACTIVATIONS = {("dp4", 64): 4 * MIB, ("dp4", 256): 16 * MIB, ("tp4sp", 64): 1 * MIB, ("tp4sp", 256): 4 * MIB}


def _model(budget=None) -> CostModel:
    cost = CostModel(budget)
    for (config, length), peak in ACTIVATIONS.items():
        seconds = (0.1 if config == "dp4" else 0.3) * length / 64
        # profiled while tp4sp was the base: its resident state includes the optimizer
        state = STATE[config] + (OPTIMIZER[config] if config == "tp4sp" else 0)
        cost.add(Probe(config, length, rows=8, seconds=seconds, peak_bytes=state + peak, state_bytes=state))
    return cost


def _state(config: str, base: Base) -> int:
    optimizer = 0
    if config == base.config:
        optimizer = OPTIMIZER[config] // (4 if base.zero1 and config == "dp4" else 1)
    return STATE[config] + optimizer


def _cycle(used: frozenset[str], base: str) -> float:
    return 0.0 if used <= {base} else 0.05 * len(used | {base})  # one switch out and one back per other config


BASES = [Base("tp4sp"), Base("dp4"), Base("dp4", zero1=True)]


def test_a_step_whose_buckets_all_prefer_one_config_ends_there_and_never_switches():
    chosen, base = _model().choose(DEMANDS, ["dp4", "tp4sp"], BASES, _cycle, _state)
    assert chosen == ["dp4", "dp4"] and base == Base("dp4")  # no ZeRO-1: nothing needed it


def test_zero1_only_when_the_whole_optimizer_would_not_fit():
    # dp4 with its whole optimizer: 40 + 80 + 16 MiB at 256; split over 4 ranks: 40 + 20 + 16
    chosen, base = _model(budget=100 * MIB).choose(DEMANDS, ["dp4", "tp4sp"], BASES, _cycle, _state)
    assert chosen == ["dp4", "dp4"] and base == Base("dp4", zero1=True)


def test_the_optimizer_stays_model_parallel_when_pure_dp_cannot_hold_it():
    # even ZeRO-1's dp4 (40 + 20 + 4 MiB at 64) is over 60 MiB: tp4sp holds the optimizer, dp4 runs short rows
    budget = 60 * MIB
    chosen, base = _model(budget).choose(DEMANDS, ["dp4", "tp4sp"], BASES, _cycle, _state)
    assert base == Base("tp4sp") and chosen == ["dp4", "dp4"]
    assert _model(budget).seconds("dp4", DEMANDS[1], _state("dp4", Base("tp4sp"))) < float("inf")


def test_a_fixed_assignment_still_chooses_where_the_cycle_starts():
    chosen, base = _model().choose(DEMANDS, ["dp4", "tp4sp"], BASES, _cycle, _state, fixed=["dp4", "dp4"])
    assert chosen == ["dp4", "dp4"] and base == Base("dp4")
    chosen, base = _model().choose(DEMANDS, ["dp4", "tp4sp"], BASES, _cycle, _state, fixed=["dp4", "tp4sp"])
    assert base == Base("tp4sp")  # a tie: the first candidate (the current base) keeps it


def test_no_base_within_the_budget_is_named():
    # the rows fit under tp4sp (10 + 4 MiB), but dp4 holding the whole optimizer needs 120 MiB
    with pytest.raises(NoConfigFits, match="dp4 cannot hold the optimizer.*zero1=True"):
        _model(budget=60 * MIB).choose(DEMANDS, ["dp4", "tp4sp"], [Base("dp4")], _cycle, _state)
    with pytest.raises(NoConfigFits, match="no config fits rows of 64 tokens"):  # the rows' own error comes first
        _model(budget=12 * MIB).choose(DEMANDS, ["dp4", "tp4sp"], [Base("tp4sp")], _cycle, _state)
