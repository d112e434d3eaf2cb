"""`hotswitch bench memory`: one rank compiled on the meta device holds a small fraction of the model;
a small Llama's measured step against the compiler's estimate; recomputation and fsdp measured lower."""
import json

import pytest

from hotswitch.bench.memory import MODEL_SHAPES, ModelShape, _ratios, measure_rank, plot, table
from hotswitch.cli import main

SMALL = ModelShape("llama-2x128", 2, 128, 4, 2, 352, 512, 2)  # one rank of 2


def test_a_7b_rank_compiles_on_meta_in_a_small_fraction_of_the_model():
    """The 7B-shaped Llama built on meta, compiled as rank 0 of a fake group of 8 under fsdp2tp4sp:
    the process never held more than a quarter of the model's fp32 bytes (it holds about 3%), and
    its shards are an eighth of the model. (With one row per replica, the LM head's [b*s, V] ->
    [b, s, V] has 2 rows that do not divide over tp4, which DTensor's view rule refused:
    `propagate._unflatten_strided` answers.)"""
    r = measure_rank(MODEL_SHAPES["llama2-7b"], "fsdp2tp4sp", 4096)
    assert r.peak_rss_bytes < 0.25 * r.model_fp32_bytes, r
    eighth = r.model_fp32_bytes / 4 / 8
    assert eighth < r.param_bytes / 2 < 1.1 * eighth, r  # (the norms stay whole over tp)
    assert r.activation_bytes > 0 and r.optimizer_bytes == 6 * r.param_bytes


def test_measured_steps_against_the_estimate(tmp_path):
    rows = [measure_rank(SMALL, config, 256, run_step=True) for config in ("dp2", "dp2-full", "fsdp2")]
    by = {r.config: r for r in rows}
    for r in rows:  # the liveness estimate tracks what the step allocates
        assert 0.5 < r.measured_bytes / r.activation_bytes < 2.0, r
    assert by["dp2-full"].measured_bytes < by["dp2"].measured_bytes  # recomputation keeps less
    assert by["dp2-full"].activation_bytes < by["dp2"].activation_bytes
    assert by["fsdp2"].param_bytes < 0.6 * by["dp2"].param_bytes  # fsdp holds half the weights (and their state)
    ratios = {r["config"]: r for r in _ratios(rows)}
    assert ratios["dp2-full"]["plain"] == "dp2" and ratios["dp2-full"]["step_ratio"] < 1
    assert ratios["fsdp2"]["rank_ratio"] < 1
    out = {"budget_bytes": 2**30, "ranks": [r.to_dict() for r in rows], "measured": [], "ratios": _ratios(rows)}
    text = table(out)
    assert "dp2-full" in text and "measured/estimated" in text
    plot(out, str(tmp_path / "memory.png"))
    assert (tmp_path / "memory.png").stat().st_size > 10_000
    json.dumps(out)


@pytest.mark.parametrize("args, message", [
    (["--models", "gpt9"], "--models takes llama2-7b, llama3-70b"),
    (["--lengths", "4k"], "--lengths positive integers"),
    (["--models", "llama2-7b", "--configs", "tp4", "--measure-layers", "0"], "tp4 runs on 4 devices"),
])
def test_bad_arguments_are_named(args, message, capsys):
    assert main(["bench", "memory", *args, "--json", "", "--plot", ""]) != 0
    assert message in capsys.readouterr().err
