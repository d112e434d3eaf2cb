"""`Trainer(configs="auto")` on 4 gloo processes: it measures a few configs, searches, trains, and the
steps equal single-device AdamW; the calibrated cost model ranks the measured configs as measured."""
import pytest

from hotswitch.train import data as D
from hotswitch.train.trainer import Trainer
from tests.distributed import dist_fixture
from tests.test_trainer_world4 import LR, _assert_equivalent, _model, _reference_steps, _steps_against

pytestmark = pytest.mark.slow  # spawns gloo processes and compiles; `-m 'not slow'` leaves it out

BUCKETS = [32, 128]


def _batches(steps=2):
    return [D.synthetic_skewed(12, 1001, 120, seed=s, min_length=2) for s in range(steps)]


def check_auto_configs_match_single_device():
    model = _model("gpt")
    batches = _batches()
    ref = _reference_steps(model, batches)
    trainer = Trainer(model, "auto", dict(name="adamw", lr=LR), buckets=BUCKETS, micro_batch_tokens=64,
                      profile_repeats=2)
    steps = _steps_against(trainer, batches, ref)
    search = trainer.search
    measured = [(p.config, p.length, p.rows, p.seconds, search.predicted_probe_seconds(p)) for p in search.probes]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    comm = {name: [(c.kind, c.nbytes, c.group_size, c.per_token) for c in profile.collectives]
            for name, profile in search.comm_profiles.items()}
    return dict(steps=steps, configs=[c.name for c in trainer.configs], chosen=[c.name for c in search.chosen],
                assignment=dict(search.assignment), lengths=list(search.lengths), measured=measured,
                calibrated_on=search.rates.calibrated_on, space={e.name for e in search.estimates[BUCKETS[-1]]},
                switches=[(p.source, p.destination, p.seconds) for p in search.switch_probes],
                switch_rates=(search.rates.per_switch, search.rates.switch_scale, search.rates.switches_calibrated_on),
                zero1=(trainer.zero1, search.zero1), comm=comm, params=params, table=search.table())


PLAIN = {"dp4", "dp2tp2", "dp2tp2sp", "tp4", "tp4sp"}  # the space's configs without fsdp or recomputation
results = dist_fixture(4, [check_auto_configs_match_single_device], env={"HOTSWITCH_PACK_BACKEND": "torch"})


def test_auto_configs_equal_single_device_adamw(results):
    out = results["check_auto_configs_match_single_device"].raise_if_failed()[0]
    assert out["lengths"] == BUCKETS and out["calibrated_on"] == 6  # 3 configs x the shortest and longest bucket
    assert {n for n in out["space"] if "-" not in n and "fsdp" not in n} == PLAIN
    assert {"fsdp4", "fsdp2tp2sp-full", "dp4-sel", "tp4sp-full"} <= out["space"]  # fsdp and recomputation priced
    assert out["configs"] == out["chosen"] and set(out["assignment"].values()) <= set(out["chosen"])
    for s in out["steps"]:  # the equivalence checks of the hand-written configs, on the chosen ones
        assert abs(s["loss"] - s["ref_loss"]) <= 1e-5 * abs(s["ref_loss"]), (s["loss"], s["ref_loss"])
        assert s["grads"] <= 1e-5 and s["weights"] <= 1e-5 and s["worst_tensor"] <= 1e-5, s
        assert sum(b.sequences for b in s["report"].buckets) == s["sequences"]
        assert {b.config for b in s["report"].buckets} <= set(out["chosen"])
    if len(out["chosen"]) > 1:
        _assert_equivalent(out["steps"], worst_tensor=1e-5, configs=set(out["chosen"]))


def test_calibrated_model_ranks_the_measured_configs(results):
    """At each length (where the search compares configs), every pair of measured configs whose times
    per token differ by more than 1.5x (what timing noise on a shared machine cannot flip) is
    predicted in the measured order."""
    out = results["check_auto_configs_match_single_device"].raise_if_failed()[0]
    per_token = [(f"{c}@{n}", m / (rows * n), p / (rows * n), n) for c, n, rows, m, p in out["measured"]]
    assert len(per_token) == 6
    clear = [(a, b) for a in per_token for b in per_token if a[3] == b[3] and b[1] > 1.5 * a[1]]
    assert clear, per_token  # dp4 and tp4sp differ by far more than that on gloo
    wrong = [(a[0], b[0]) for a, b in clear if not b[2] > a[2]]
    assert not wrong, (wrong, per_token)


def test_auto_prices_switches_and_communication_as_measured_and_compiled(results):
    """The search prices a switch by switches measured between the calibration configs, every config's
    communication by the collectives of its ExecGraph, and the Trainer runs with the ZeRO-1 choice."""
    out = results["check_auto_configs_match_single_device"].raise_if_failed()[0]
    timed = {"dp4", "dp2tp2", "tp4sp"}
    assert {(a, b) for a, b, _ in out["switches"]} == {(a, b) for a in timed for b in timed if a != b}
    assert all(seconds > 0 for *_, seconds in out["switches"])
    per_switch, scale, fitted_on = out["switch_rates"]
    assert fitted_on == 6 and per_switch + scale > 0
    assert out["zero1"][0] == out["zero1"][1]
    assert set(out["comm"]) == PLAIN  # lowered once per layout: fsdp and recomputation priced from them
    assert "from the collectives of their ExecGraphs" in out["table"]
    # dp4 communicates gradients only: one all-reduce per bucket, every parameter's bytes once
    # (the loss's numerator and denominator ride along)
    dp4 = out["comm"]["dp4"]
    assert dp4 and all(kind == "all_reduce" and size == 4 and not per_token for kind, _, size, per_token in dp4)
    assert 0 <= sum(nbytes for _, nbytes, *_ in dp4) - out["params"] <= 64
    # tensor parallelism moves activations inside every micro-batch
    for name in ("dp2tp2", "tp4", "tp4sp"):
        assert any(per_token and size in (2, 4) for _, _, size, per_token in out["comm"][name]), name
