"""The `hotswitch` CLI: the demo end to end (4 gloo processes) and its pieces; `hotswitch.launch`."""
import argparse
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
from tests.distributed import assert_no_repeated_warning, scaled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_demo_end_to_end():
    cmd = [sys.executable, "-m", "hotswitch.cli", "demo", "--steps", "2", "--layers", "1", "--batch-size", "4",
           "--seq-len", "16"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=scaled(600))
    out = proc.stdout
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{out}\n{proc.stderr}"
    # one line for the whole compile, its parts adding up: "hs.compile: T s = tracing a s + lowering b s (...) + ..."
    total, *parts = (float(x) for x in re.search(
        r"^hs\.compile: ([\d.]+) s = tracing ([\d.]+) s \+ lowering ([\d.]+) s \(.*\) \+ meshes and layouts "
        r"(-?[\d.]+) s$", out, re.M).groups())
    assert abs(sum(parts) - total) < 0.02, out
    for name, title in [("dp4", "dp=4 tp=1 sp=off"), ("dp2tp2", "dp=2 tp=2 sp=off"), ("tp4sp", "dp=1 tp=4 sp=on")]:
        assert f"lowering {name} for local inputs" in out, out  # progress while compiling
        assert f"{name}: {title}, lowered in" in out, out
    # one row per step: "│ step │ loss │ ..." (rich) or "step loss ..." (plain)
    rows = re.findall(r"^\W*(\d+)\W+(-?\d+\.\d{6}|nan|inf)\s", out, re.M)
    assert [int(s) for s, _ in rows] == list(range(6)), out
    losses = [float(v) for _, v in rows]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]  # SGD on a fixed batch
    assert len(re.findall(r"^switch \S+ -> \S+: [\d.]+ s", out, re.M)) == 3  # dp4->dp2tp2->tp4sp->dp4
    assert re.search(r"^state preserved across switches: yes \(max \|Δw\| = ", out, re.M), out
    assert re.search(r"^losses follow the single-device trajectory: yes", out, re.M), out
    assert re.search(r"^demo finished in [\d.]+ s \(", out, re.M), out
    assert "Traceback" not in proc.stderr, proc.stderr
    assert_no_repeated_warning(out + proc.stderr)


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


def _parsers(parser=None, path=("hotswitch",)):
    """Every (sub-)command's parser, by its command line."""
    parser = parser or cli.build_parser()
    yield " ".join(path), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_help_is_plain_text_with_every_option_explained_and_defaults_shown():
    seen = {}
    for command, parser in _parsers():
        text = parser.format_help()
        assert "**" not in text and "`" not in text, (command, text)  # Markdown reads raw on a terminal
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help, f"{command} {action.option_strings}: no help"
            shown = formatter._get_help_string(action)
            assert shown.count("(default:") <= 1, (command, shown)
            has_default = not (action.default is None or action.default is False or action.default == argparse.SUPPRESS
                               or action.default == [])  # repeatable options start empty
            if has_default and action.option_strings:
                assert "(default:" in shown, (command, action.option_strings, shown)
            for option in action.option_strings:
                seen.setdefault(option, set()).add(command)
    # the options commands share are spelled one way (the old --batch, --seq, --max-length are gone from help)
    assert not {"--batch", "--seq", "--max-length", "--seq-length", "--world"} & set(seen), sorted(seen)
    for command in ("hotswitch demo", "hotswitch train", "hotswitch bench train"):
        for option in ("--world-size", "--configs", "--batch-size", "--seq-len", "--json"):
            assert command in seen[option], (command, option)
    for command in ("hotswitch bench switch", "hotswitch bench elastic", "hotswitch bench cp", "hotswitch plan"):
        assert command in seen["--json"], command


def test_help_imports_no_torch():
    """Every command's --help builds its parsers without torch (that import costs seconds): the
    measure of a quick `hotswitch --help` that does not depend on the machine's load."""
    code = (
        "import sys, contextlib, io\n"
        "from hotswitch.cli import main\n"
        "for argv in ([], ['demo'], ['train'], ['bench'], ['bench', 'switch'], ['bench', 'train'],\n"
        "             ['bench', 'elastic'], ['bench', 'cp'], ['bench', 'step'], ['plan']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        main(argv + ['--help'])\n"
        "heavy = sorted(m for m in ('torch', 'numpy', 'transformers', 'hotswitch.compiler') if m in sys.modules)\n"
        "assert not heavy, heavy\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120))
    assert proc.returncode == 0, proc.stderr


def test_configs_option_takes_both_spellings():
    assert [c.name for c in common.parse_configs("dp4,dp2tp2,tp4sp", 4, "demo")] == ["dp4", "dp2tp2", "tp4sp"]
    assert [c.name for c in common.parse_configs("dp=4;dp=2,tp=2;tp=4,sp", 4, "train")] == ["dp4", "dp2tp2", "tp4sp"]
    assert [c.name for c in common.parse_configs("dp=2,tp=2", 4, "train")] == ["dp2tp2"]
    with pytest.raises(SystemExit, match=r"hotswitch train: --configs: .*'banana'.*compact name, e\.g\. 'dp4'"):
        common.parse_configs("dp4;banana", 4, "train")
    with pytest.raises(SystemExit, match="uses dp\\*tp\\*pp = 2 devices but the job has 4"):
        common.parse_configs("dp2", 4, "demo")


def test_train_options_carry_the_compile_backend():
    from hotswitch.cli.train import options

    parser = cli.build_parser()
    args = parser.parse_args(["train", "--world-size", "2", "--compile-backend", "inductor"])
    assert options(args).compile_backend == "inductor"
    assert options(parser.parse_args(["train", "--world-size", "2"])).compile_backend == "eager"
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--compile-backend", "tensorrt"])


def test_plain_and_elastic_training_give_the_trainer_the_same_options():
    """One copy of the Trainer's options for `hotswitch train` with and without --elastic (the elastic
    job once dropped --no-prefetch and --cp-layout)."""
    from hotswitch.cli.train import options
    from hotswitch.train.loop import trainer_options

    args = cli.build_parser().parse_args(["train", "--world-size", "2", "--elastic", "2:4", "--no-prefetch",
                                          "--cp-layout", "zigzag", "--compile-backend", "inductor",
                                          "--grad-bucket-mib", "0.5"])
    got = trainer_options(options(args), None, (64, 128))
    assert (got["prefetch"], got["cp_layout"], got["backend"], got["buckets"]) == (False, "zigzag", "inductor",
                                                                                  (64, 128))
    assert got["grad_bucket_bytes"] == 2**19, got
    plain = trainer_options(options(cli.build_parser().parse_args(["train", "--world-size", "2"])), None, None)
    assert plain["grad_bucket_bytes"] is None  # hs.compile's default
    with pytest.raises(SystemExit, match="--grad-bucket-mib must be positive"):
        options(cli.build_parser().parse_args(["train", "--world-size", "2", "--grad-bucket-mib", "0"]))


def test_several_hosts_options_are_checked_and_passed_on():
    from hotswitch.cli.train import options
    from hotswitch.elastic.membership import Rendezvous

    def parse(*extra):
        return options(cli.build_parser().parse_args(["train", "--world-size", "4", "--elastic", "2:6", *extra]))

    opts = parse("--rdzv-endpoint", "node0:29400", "--nproc-per-node", "2", "--rdzv-id", "job7",
                 "--checkpoint-dir", "/shared/ckpt")
    assert opts.rendezvous == Rendezvous("node0:29400", "job7", 2, "c10d")
    assert parse().rendezvous is None  # one host
    with pytest.raises(SystemExit, match="--rdzv-endpoint needs --checkpoint-dir, a directory every host"):
        parse("--rdzv-endpoint", "node0:29400")
    with pytest.raises(SystemExit, match="--nproc-per-node needs --rdzv-endpoint"):
        parse("--nproc-per-node", "2")
    with pytest.raises(SystemExit, match="--rdzv-endpoint takes HOST:PORT, got 'node0'"):
        parse("--rdzv-endpoint", "node0", "--checkpoint-dir", "/c")
    with pytest.raises(SystemExit, match="--rdzv-backend zookeeper: .*register_rendezvous_store.'zookeeper'"):
        parse("--rdzv-endpoint", "node0:1", "--checkpoint-dir", "/c", "--rdzv-backend", "zookeeper")


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


def _environ(rank, name):
    return os.environ.get(name), os.environ["RANK"], os.environ["WORLD_SIZE"]


def test_launched_ranks_see_the_environment_of_their_launch(monkeypatch):
    """Ranks fork from a server that the first launch started (process_context): a later launch's
    ranks see the launcher's environment as it is then, not as it was when the server started."""
    monkeypatch.setenv("HOTSWITCH_TEST_VALUE", "before")
    assert launch(_environ, 2, "HOTSWITCH_TEST_VALUE", timeout=scaled(300)) == ("before", "0", "2")
    monkeypatch.setenv("HOTSWITCH_TEST_VALUE", "after")
    assert launch(_environ, 2, "HOTSWITCH_TEST_VALUE", timeout=scaled(300)) == ("after", "0", "2")
    monkeypatch.delenv("HOTSWITCH_TEST_VALUE")
    assert launch(_environ, 2, "HOTSWITCH_TEST_VALUE", timeout=scaled(300)) == (None, "0", "2")


def _prints_lines(rank: int, count: int) -> None:
    import torch.distributed as dist

    dist.barrier()  # both ranks print at the same time
    for i in range(count):
        print(f"rank {rank} line {i} " + "x" * 80)


def test_ranks_print_whole_lines_under_pythonunbuffered():
    """CI runners often set PYTHONUNBUFFERED: `print` then writes a line and its newline separately,
    and the other rank's line landed between them (a CI failure of the elastic example)."""
    code = "from hotswitch.distributed.launch import launch; from tests.test_cli import _prints_lines; " \
           "launch(_prints_lines, 2, 2000)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"), timeout=scaled(300))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert sorted(lines) == sorted(f"rank {r} line {i} " + "x" * 80 for r in range(2) for i in range(2000)), \
        [line for line in lines if not re.fullmatch(r"rank \d line \d+ x{80}", line)][:5]
