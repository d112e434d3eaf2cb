"""Helpers the command modules share: tables, counts, progress lines, options spelled once."""
from __future__ import annotations

import sys
from collections import Counter

__all__ = ["add_train_arguments", "format_counts", "plural", "progress", "render_table"]


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


def add_train_arguments(p) -> None:
    """The options `hotswitch train` and `hotswitch bench train` share, spelled once."""
    from hotswitch.train.loop import HF_MODELS

    p.add_argument("--model", default="gpt-tiny", help="built-in model (hotswitch.models.MODEL_CONFIGS) or "
                   f"{', '.join(HF_MODELS)} (a Hugging Face model from a small config); default gpt-tiny")
    p.add_argument("--world-size", type=int, default=4, help="processes to spawn (default 4)")
    p.add_argument("--dataset", default="synthetic-skewed", help="'synthetic-skewed' (seeded long-tailed lengths) "
                   "or a JSONL file of token ids (one list, or {\"input_ids\": [...]}, per line)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    p.add_argument("--batch-size", type=int, default=64, help="sequences per global batch (default 64)")
    p.add_argument(
        "--max-length", type=int, default=None, help="longest synthetic sequence (default: the model's limit)"
    )
    p.add_argument("--configs", default=None, help="semicolon-separated DistConfigs, e.g. 'dp=4;dp=2,tp=2;tp=4,sp' "
                   "(default: dp<W>;tp<W>,sp)")
    p.add_argument(
        "--memory-budget-mib", type=float, default=None, help="per-rank memory budget in MiB (default: none)"
    )
    p.add_argument("--micro-batch-tokens", type=int, default=1024, help="tokens per data-parallel replica per "
                   "micro-batch (default 1024)")
    p.add_argument("--buckets", default=None, help="comma-separated bucket bounds, e.g. 32,64,256 (default: from the "
                   "first batch's length distribution)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zero1", action="store_true", help="shard AdamW states over the base config's dp ranks")
