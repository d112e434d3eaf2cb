"""`hotswitch bench step` end to end on 2 gloo processes, small and eager (its compiled variants are
covered by tests/test_inductor_world2.py): every method computes the same global loss as one device,
the ratios and the chart are written."""
import json

import pytest

from hotswitch.bench import step
from hotswitch.cli import main

pytestmark = pytest.mark.slow  # spawns 2 processes


def test_bench_step_runs_every_method_on_the_same_loss(tmp_path, capsys):
    out, png = tmp_path / "step.json", tmp_path / "step.png"
    code = main(["bench", "step", "--world-size", "2", "--layers", "1", "--dim", "64", "--heads", "4",
                 "--rows", "4", "--length", "16", "--repeats", "1", "--eager-only", "--json", str(out),
                 "--plot", str(png)])
    assert code == 0
    result = json.loads(out.read_text())
    assert [m["model"] for m in result["models"]] == ["gpt", "llama"]
    for entry in result["models"]:
        methods = entry["methods"]
        assert set(methods) == {"hotswitch dp eager", "hotswitch tp eager", "DDP eager", "DTensor TP eager",
                                "one device"}, methods
        reference = methods["one device"]["loss"]
        for name, m in methods.items():
            assert "error" not in m, (name, m)
            assert m["seconds"] > 0 and abs(m["loss"] - reference) <= 1e-5 * abs(reference), (name, m, reference)
        assert [(mine, peer) for mine, peer, _ in step.ratios(methods)] == [
            ("hotswitch dp eager", "DDP eager"), ("hotswitch tp eager", "DTensor TP eager")]
    assert png.stat().st_size > 0
    assert "hotswitch dp eager / DDP eager" in capsys.readouterr().out


def test_bench_step_refuses_heads_that_do_not_split(capsys):
    assert main(["bench", "step", "--heads", "6"]) == 2
    assert "must divide over 4 ranks" in capsys.readouterr().err
