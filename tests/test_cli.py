"""The `hotswitch` CLI: the demo end to end (4 gloo processes) and its pieces; `hotswitch.launch`."""
import math
import os
import re
import subprocess
import sys

import pytest

import hotswitch.cli as cli
from hotswitch.cli import common, demo
from hotswitch.distconfig import DistConfig
from hotswitch.distributed.launch import LaunchError, launch
from tests.distributed import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_demo_end_to_end():
    cmd = [
        sys.executable,
        "-m",
        "hotswitch.cli",
        "demo",
        "--steps",
        "2",
        "--layers",
        "1",
        "--batch",
        "4",
        "--seq",
        "16",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=scaled(600))
    out = proc.stdout
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{out}\n{proc.stderr}"
    for name, title in [("dp4", "dp=4 tp=1 sp=off"), ("dp2tp2", "dp=2 tp=2 sp=off"), ("tp4sp", "dp=1 tp=4 sp=on")]:
        assert f"compiled {name}" in out
        assert f"{name}: {title}, compiled in" in out, out
    # one row per step: "│ step │ loss │ ..." (rich) or "step loss ..." (plain)
    rows = re.findall(r"^\W*(\d+)\W+(-?\d+\.\d{6}|nan|inf)\s", out, re.M)
    assert [int(s) for s, _ in rows] == list(range(6)), out
    losses = [float(v) for _, v in rows]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]  # SGD on a fixed batch
    assert len(re.findall(r"^switch \S+ -> \S+: [\d.]+ s", out, re.M)) == 3  # dp4->dp2tp2->tp4sp->dp4
    assert re.search(r"^state preserved across switches: yes \(max \|Δw\| = ", out, re.M), out
    assert re.search(r"^losses follow the single-device trajectory: yes", out, re.M), out
    assert "Traceback" not in proc.stderr, proc.stderr


def test_parse_config():
    c = DistConfig.parse("dp2tp2")
    assert (c.name, c.dp, c.tp, c.sp) == ("dp2tp2", 2, 2, False)
    c = DistConfig.parse("tp4sp")
    assert (c.dp, c.tp, c.sp) == (1, 4, True)
    assert DistConfig.parse("dp8").dp == 8
    for bad in ("xx", "dp", "sp2", "tp4dp2"):
        with pytest.raises(Exception):
            DistConfig.parse(bad)
    assert demo.default_configs(4) == ["dp4", "dp2tp2", "tp4sp"]
    assert demo.default_configs(2) == ["dp2", "tp2sp"]


def test_main_without_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_demo_rejects_bad_arguments():
    with pytest.raises(SystemExit, match="unknown model"):
        cli.main(["demo", "--model", "nope"])
    with pytest.raises(SystemExit, match="compact name, e.g. 'dp4', 'dp2tp2'"):
        cli.main(["demo", "--configs", "dp4,banana"])


def test_plain_table_without_rich(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rich", None)  # import rich -> ImportError
    monkeypatch.setitem(sys.modules, "rich.console", None)
    common.render_table("t", ["step", "loss"], [["0", "6.9"], ["10", "6.5"]])
    assert capsys.readouterr().out.strip("\n").splitlines()[1:] == [
        "step  loss",
        "----  ----",
        "   0   6.9",
        "  10   6.5",
    ]


def test_format_counts():
    from collections import Counter

    assert common.format_counts(Counter(all_reduce=2, all_gather=1)) == "AG×1 AR×2"
    assert common.format_counts(Counter()) == "-"


def _fails_on_rank1(rank, tag):
    import torch
    import torch.distributed as dist

    x = torch.tensor([rank + 1.0])
    dist.all_reduce(x)
    if rank == 1:
        raise ValueError(f"{tag} sum={x.item()} world={os.environ['WORLD_SIZE']} omp={os.environ['OMP_NUM_THREADS']}")
    dist.barrier()  # rank 0 waits here for a rank that is gone: launch must not hang
    return x.item()


def test_launch_reraises_a_ranks_traceback():
    with pytest.raises(LaunchError) as info:
        launch(_fails_on_rank1, 2, "boom", timeout=scaled(300))
    assert info.value.rank == 1
    assert "rank 1 failed" in str(info.value) and "ValueError: boom sum=3.0 world=2 omp=1" in str(info.value)
