"""`hotswitch train` end to end (2 gloo processes) and its argument errors."""
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import hotswitch.cli as cli
from hotswitch.models import build_model
from tests.distributed import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(*args, timeout=1200):
    cmd = [sys.executable, "-m", "hotswitch.cli", "train", "--world-size", "2", "--configs", "dp=2;tp=2,sp",
           "--batch-size", "12", "--seq-len", "64", "--micro-batch-tokens", "64", "--buckets", "32,64", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=scaled(timeout))
    assert proc.returncode == 0, f"train failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_train_from_jsonl_prints_steps_and_saves_the_final_state(tmp_path):
    g = torch.Generator().manual_seed(0)
    lengths = [5, 9, 12, 40, 60, 7, 3, 33, 18, 25, 64, 11] * 2
    data = tmp_path / "tokens.jsonl"
    data.write_text("".join(json.dumps(torch.randint(1, 1000, (n,), generator=g).tolist()) + "\n" for n in lengths))
    final = tmp_path / "final.pt"
    out = _train("--dataset", str(data), "--steps", "2", "--save-final", str(final))
    steps = re.findall(
        r"^step (\d+) loss (\S+) tokens (\d+) ([\d,]+) tok/s .* switch ([\d.]+)s .*\]:(dp2|tp2sp)x\d+", out, re.M
    )
    assert [int(s[0]) for s in steps] == [1, 2], out
    assert all(math.isfinite(float(s[1])) and int(s[2]) > 0 for s in steps)
    assert re.search(r"^2 steps: [\d,]+ tokens/s, exposed switching [\d.]+ s = [\d.]+% of step time "
                     r"\([\d.]+ s overlapped\)", out, re.M), out
    state = torch.load(final)
    assert set(state) == set(build_model("gpt-tiny").state_dict())  # the model's own keys, full tensors
    assert all(torch.isfinite(v).all() for v in state.values())


@pytest.mark.slow
def test_train_static_runs_one_config_without_switching():
    out = _train("--steps", "1", "--static", "tp=2,sp")
    line = re.search(r"^step 1 .* switch ([\d.]+)s .*", out, re.M)
    assert line and float(line[1]) == 0.0, out
    assert "dp2x" not in line[0] and "tp2spx" in line[0]


@pytest.mark.slow
def test_elastic_train_switches_nothing_when_every_bucket_runs_dp():
    """A redeployment hands the new workers trained AdamW moments in the job's default base (tp2sp);
    every bucket runs under dp2 (several times faster than tp2sp at these lengths), so their first step
    moves the optimizer to dp2 and no step switches (elastic jobs used to switch every step)."""
    out = _train("--elastic", "2:2", "--redeploy", "2", "--steps", "3")
    assert "redeploy: dp2 on 2 -> tp2sp on 2 workers after step 2, state from survivors" in out, out
    steps = re.findall(r"^step (\d+) .* switch ([\d.]+)s \(.*?\) (.*)$", out, re.M)
    assert [int(s[0]) for s in steps] == [1, 2, 3], out
    for _, switch, buckets in steps:
        assert {b.rpartition(":")[2].rpartition("x")[0] for b in buckets.split()} == {"dp2"}, out
        assert float(switch) == 0.0, out
    assert re.search(r"^3 steps on workers w2, w3 under dp2, tp2sp", out, re.M), out


def test_train_rejects_bad_arguments(tmp_path):
    with pytest.raises(SystemExit, match="unknown model"):
        cli.main(["train", "--model", "nope"])
    with pytest.raises(SystemExit, match="neither 'synthetic-skewed' nor a JSONL file"):
        cli.main(["train", "--dataset", str(tmp_path / "missing.jsonl")])
    with pytest.raises(SystemExit, match="dp\\*tp\\*pp"):
        cli.main(["train", "--world-size", "4", "--configs", "dp=2"])
