"""Helpers the command modules share: tables, counts, progress lines, help text, options spelled once.

Options that several commands take are spelled the same everywhere: --world-size, --configs,
--batch-size, --seq-len, --json PATH (and --model, --steps, --seed, --lr).
"""
from __future__ import annotations

import argparse
import re
import sys
import textwrap
from collections import Counter

from hotswitch.progress import write_json

__all__ = ["HelpFormatter", "add_configs_argument", "add_json_argument", "add_train_arguments", "format_counts",
           "parse_configs", "plain", "plural", "progress", "render_table", "write_json"]


class HelpFormatter(argparse.HelpFormatter):
    """Descriptions are filled to the terminal paragraph by paragraph, indented blocks (command
    lines) kept as written; every option with a default shows it, "(default: X)". (argparse's
    ArgumentDefaultsHelpFormatter also prints "default: None" and "default: False".)"""

    def _fill_text(self, text, width, indent):
        paragraphs = re.split(r"\n\s*\n", text.strip("\n"))
        return "\n\n".join(p if p[:1].isspace() else textwrap.fill(" ".join(p.split()), width, initial_indent=indent,
                                                                     subsequent_indent=indent, break_on_hyphens=False)
                             for p in paragraphs)

    def _split_lines(self, text, width):  # option names such as --world-size stay whole
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action):
        text = action.help or ""
        shown = not (action.default is None or action.default is False or action.default == argparse.SUPPRESS
                     or isinstance(action.default, list))
        if shown and action.option_strings and "%(default)" not in text and "(default" not in text:
            text += " (default: %(default)s)"
        return text


def plain(text: str) -> str:
    """Help text from a docstring: Markdown's `code` and **bold** marks dropped (terminals show them raw)."""
    return re.sub(r"\*\*(.+?)\*\*", r"\1", text or "").replace("`", "")


def add_configs_argument(p, default_help: str) -> None:
    p.add_argument("--configs", default=None, metavar="CONFIGS",
                   help="DistConfigs, separated by ';' or by ',' between compact names: 'dp4,dp2tp2,tp4sp' or "
                   f"'dp=4;dp=2,tp=2;tp=4,sp' (default: {default_help})")


def parse_configs(text: str, world_size: int, command: str) -> list:
    """--configs read with the one config grammar and checked against the world size; SystemExit
    naming the command and the accepted forms otherwise."""
    from hotswitch.distconfig import parse_configs as parse

    try:
        configs = parse(text)
        for c in configs:
            c.check_world_size(world_size)
    except ValueError as e:
        raise SystemExit(f"hotswitch {command}: --configs: {e}") from None
    return configs


def add_backend_argument(p) -> None:
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="process group backend: nccl puts each process on GPU LOCAL_RANK, gloo on the CPU "
                   "(default: nccl when every process gets a GPU, else gloo)")


def processes(n: int, backend: str | None, what: str = "processes") -> str:
    from hotswitch.distributed.device import describe_processes  # imports torch: only when a command runs

    return describe_processes(n, backend, what)


def add_json_argument(p, default: str | None, what: str) -> None:
    p.add_argument("--json", default=default, metavar="PATH", nargs="?", const="-",
                   help=f"write {what} as JSON to PATH (--json alone or '-': to standard output)")


def format_counts(kinds: Counter) -> str:
    short = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all_single": "A2A"}
    return " ".join(f"{short.get(k, k)}×{n}" for k, n in sorted(kinds.items())) or "-"


def render_table(title: str, columns: list[str], rows: list[list[str]], console=None) -> None:
    """A rich table when rich is importable, else aligned plain text."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
        print(f"\n{title}")
        print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
        print("  ".join("-" * w for w in widths))
        for r in rows:
            print("  ".join(v.rjust(w) for v, w in zip(r, widths)))
        return
    table = Table(title=title, title_justify="left")
    for c in columns:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*r)
    (console or Console(width=None if sys.stdout.isatty() else 120)).print(table)


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def progress(message: str) -> None:
    print(message, flush=True)


def add_train_arguments(p, micro_batch_tokens: int = 1024) -> None:
    """The options `hotswitch train` and `hotswitch bench train` share, spelled once."""
    from hotswitch.train.loop import HF_MODELS

    p.add_argument("--model", default="gpt-tiny", help="built-in model (hotswitch.models.MODEL_CONFIGS) or "
                   f"{', '.join(HF_MODELS)} (a Hugging Face model from a small config)")
    p.add_argument("--world-size", type=int, default=4, help="processes to spawn")
    add_backend_argument(p)
    p.add_argument("--dataset", default="synthetic-skewed", help="'synthetic-skewed' (seeded long-tailed lengths) "
                   "or a JSONL file of token ids (one list, or {\"input_ids\": [...]}, per line)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=64, help="sequences per global batch")
    p.add_argument("--seq-len", type=int, default=None, help="longest synthetic sequence (default: the model's limit)")
    p.add_argument("--max-length", dest="seq_len", type=int, help=argparse.SUPPRESS)  # the earlier spelling
    add_configs_argument(p, "dp<W>;tp<W>,sp for W processes")
    p.add_argument("--memory-budget-mib", type=float, default=None, help="per-rank memory budget in MiB "
                   "(default: none)")
    p.add_argument("--micro-batch-tokens", type=int, default=micro_batch_tokens, help="tokens per data-parallel "
                   f"replica per micro-batch (default: {micro_batch_tokens}); a longer row is a micro-batch of its own")
    p.add_argument("--buckets", default=None, help="comma-separated bucket bounds, e.g. 32,64,256 (default: from the "
                   "first batch's length distribution)")
    p.add_argument("--grad-bucket-mib", type=float, default=None, help="size of the buckets in which data-parallel "
                   "gradients are all-reduced behind the backward (DDP's bucket_cap_mb; default: 25)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the synthetic data and its order")
    p.add_argument("--zero1", action="store_true", help="shard AdamW states over the base config's dp ranks")
    p.add_argument("--cp-layout", choices=("contiguous", "zigzag", "document"), default="contiguous",
                   help="how cp configs lay the sequence out: rank i's chunk of every row; chunks i and 2cp-1-i "
                   "(causal balance); or documents whole where the balance allows, placed per micro-batch (DCP). "
                   "zigzag and document need a built-in model (its attention reads document ids)")
    p.add_argument("--compile-backend", choices=("eager", "inductor"), default="eager",
                   help="how ExecGraphs run: op by op (eager), or compiled by Inductor on first use (C++ on CPU, "
                   "Triton on GPU; compiled programs are cached beside hotswitch's compile cache). --backend names "
                   "the process-group backend")
    p.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                   help="move each config's weights when the step reaches it, not behind the previous config's compute")
