"""The `hotswitch` command line: one module per command, each with `add_parser(subparsers)` that
registers its parser and sets `run=<function taking the parsed args>`.

    hotswitch demo           train a small GPT on 4 CPU processes under dp4, dp2tp2 and tp4sp, switching between them
    hotswitch train          mixed-length training: a config per length bucket, hot-switched within each step
    hotswitch bench switch   what every switch between configs costs: planner algorithms and outside baselines
    hotswitch bench train    tokens/s of hot-switched training vs the best static config within a memory budget
    hotswitch bench elastic  a change of devices: planned move vs gathering on one rank vs checkpoint + restart
    hotswitch plan           plan one switch of a large model on a simulated cluster (pure, no processes)
    hotswitch configs        the Pareto front of configs per length and the set to hot-switch between (pure)
    hotswitch rendezvous     serve the store that elastic agents on several hosts meet in

Command modules import torch only inside their `run` functions, so `--help` stays fast.
"""
from __future__ import annotations

import argparse

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    return args.run(args) or 0


def build_parser() -> argparse.ArgumentParser:
    """The `hotswitch` parser and its sub-commands' (torch is not imported to build them)."""
    from hotswitch.cli import bench, configs, demo, plan, rendezvous, train
    from hotswitch.cli.common import HelpFormatter

    parser = argparse.ArgumentParser(prog="hotswitch", formatter_class=HelpFormatter,
                                     description="Compile a model once for several parallel layouts (DistConfigs) "
                                     "and hot-switch between them while training.",
                                     epilog="'hotswitch COMMAND --help' describes a command. In Python: "
                                     "hs.compile(model, example_inputs, ['dp4', 'tp4sp']); scripts to copy are in "
                                     "the repository's examples/ folder, e.g. 'torchrun --nproc-per-node 4 "
                                     "examples/switch_hf_model.py'.")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for command in (demo, train, bench, plan, configs, rendezvous):
        command.add_parser(subparsers)
    return parser
