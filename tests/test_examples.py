"""The scripts in examples/ run as a user runs them (torchrun, plain python with hs.launch, the elastic
agent), on 2-4 CPU processes, and print what they promise; the README's code is the examples' code."""
import importlib.util
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from tests.distributed import assert_no_repeated_warning, scaled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _run(*args, timeout: float) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=scaled(timeout))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{args} failed ({proc.returncode}):\n{out}"
    assert "Traceback" not in out, out
    assert_no_repeated_warning(out)
    return proc.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only: its work runs under `if __name__ == "__main__"`
    return module


def _readme_python_blocks() -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), re.M | re.S)


@pytest.mark.slow
def test_switch_hf_model_under_torchrun_follows_one_device():
    """The README's torchrun line on 2 processes (dp2, tp2, tp2sp): every printed loss is the
    single-device model's under the same SGD steps, and every switch is reported."""
    out = _run("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
               "examples/switch_hf_model.py", "--steps", "1", timeout=600)
    assert re.search(r"^compiled dp2, tp2, tp2sp on 2 processes$", out, re.M), out
    losses = re.findall(r"^\s*(\w+)  loss (\d+\.\d{4})$", out, re.M)
    assert [name for name, _ in losses] == ["dp2", "tp2", "tp2sp", "dp2"], out
    example = _load("switch_hf_model")
    model, batch = example.qwen2_and_batch()
    for name, printed in losses:
        loss = model(**batch).loss
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= example.LR * p.grad
        assert abs(float(printed) - loss.item()) < 2e-4, (name, printed, loss.item())
    switches = re.findall(r"^switch (\w+) -> (\w+) +([\d.]+) MiB moved +([\d.]+) ms$", out, re.M)
    assert [(a, b) for a, b, _, _ in switches] == [("dp2", "tp2"), ("tp2", "tp2sp"), ("tp2sp", "dp2")], out
    assert float(switches[-1][2]) > 0  # back to dp2: each rank gathers the halves it lacks
    assert re.search(r"^final state: 139,840 parameters$", out, re.M), out


@pytest.mark.slow
def test_train_mixed_lengths_on_the_shipped_jsonl():
    """Plain python (hs.launch spawns 2 processes): the Trainer over examples/data/mixed_lengths.jsonl;
    within the 4 MiB budget the longest bucket runs under tp2sp, the short ones under dp2."""
    out = _run("examples/train_mixed_lengths.py", "--nproc", "2", "--steps", "2", timeout=900)
    steps = re.findall(r"^step (\d+) loss (\d+\.\d+) tokens (\d+) .* switch [\d.]+s "
                       r"\([\d.]+%, [\d.]+s overlapped\) (.*)$", out, re.M)
    assert [int(s) for s, *_ in steps] == [1, 2], out
    for _, loss, tokens, buckets in steps:
        assert 0 < float(loss) < 10 and int(tokens) > 0
        configs = dict(re.findall(r"\((\d+,\d+)\]:(\w+?)x\d+", buckets))
        assert configs[max(configs, key=lambda b: int(b.split(",")[1]))] == "tp2sp", buckets
        assert "dp2" in configs.values(), buckets
    assert re.search(r"^trained 2 steps under dp2, tp2sp; [\d,]+ parameters$", out, re.M), out


@pytest.mark.slow
def test_elastic_training_survives_a_sigkill_on_four_workers():
    """4 workers under dp4; the last SIGKILLs itself after step 1. The 3 survivors go on under dp3 at
    once, the state from survivors, and finish the 2 steps. (w1 is no ring neighbour of w3: gloo
    reports nothing to it, the start-of-step barrier does.) One candidate config keeps the test
    short (no profiling); scale-out, redeployment and restores from checkpoints:
    tests/test_elastic_world4.py."""
    out = _run("examples/elastic_training.py", "--workers", "4", "--configs", "dp4", "--scale", "none", "--kill", "1",
               "--steps", "2", timeout=900)
    assert re.search(r"^\[w3\] SIGKILL to myself after step 1$", out, re.M), out
    (change,) = re.findall(r"^change (\d) \((\w+)\): (.+?) -> (.+?) workers after step (\d), state from (\w+), "
                           r"[\d.]+ MiB moved in [\d.]+ s, training again after ([\d.]+) s$", out, re.M)
    assert change[:6] == ("1", "failure", "dp4 on 4", "dp3 on 3", "1", "survivors"), out
    assert float(change[6]) < scaled(60), out  # noticed at once, not after a collective's timeout (10 min)
    assert re.search(r"^2 steps on workers w0, w1, w2 under dp3; final loss \d+\.\d+$", out, re.M), out
    assert [int(s) for s in re.findall(r"^step (\d+) loss", out, re.M)] == [1, 2], out


def test_readme_python_is_the_examples_code():
    """The README's first Python block is pieces of examples/switch_hf_model.py, verbatim (and that
    example runs above), separated by "..." lines; nothing in it is left undefined."""
    block = _readme_python_blocks()[0]
    with open(os.path.join(EXAMPLES, "switch_hf_model.py")) as f:
        source = f.read()
    pieces = [p.strip("\n") for p in re.split(r"^\s*\.\.\.\n", block, flags=re.M) if p.strip()]
    assert len(pieces) >= 2 and "hs.compile(" in block and "cm.switch(" in block, block
    for piece in pieces:
        assert piece in source, piece
