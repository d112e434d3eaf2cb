"""Compile time against depth and against the number of sequence lengths, cold and warm cache.

    python benchmarks/compile_time.py [--layers 2,8] [--lengths 1,4] [--configs dp2tp2,tp4sp]
                                      [--world-size 4] [--dynamic] [--repeat N] [--json PATH]

The model is a Hugging Face Llama (hidden 256, 8 heads, intermediate 512, random weights) with
`--layers` layers, trained on packed rows (`PackedCausalLMLoss`: input ids, positions, labels) of
micro-batch 4 x 64 tokens. For each depth, `--world-size` gloo processes run `hs.compile` (one
trace, then every config lowered at length 64) and then lower each config at `n - 1` further lengths
(128, 192, ...) for each n of `--lengths`: the first lowering of a config searches DTensor's
strategies, the second length replays its decisions as a sample and fits the two programs, and the
second and later lengths are written from that fit (`hotswitch.compiler.lengths`). Each depth runs
twice in fresh processes, first with an empty compile cache (cold) and then with the cache the first
run left (warm: decisions replayed from disk). For scale, rank 0 also times `torch.export` of the
same model alone. `--dynamic` adds a third run per depth, cold, compiled with `dynamic=True`: each
config is lowered at 64 and (its decisions replayed) at 32 and fitted while compiling, so every
further length is written from the fit; its "first" column is that whole compile of the config.
`--repeat N` runs each depth cold N times (a fresh cache each; the `--dynamic` run too) and reports
each figure's median: on 4 processes sharing 2 cores one run's slowest rank moves the depth ratio by
0.3 from run to run.
Times are the slowest rank's. Of each new length's time it also prints what that rank's garbage
collector took (`gc.callbacks`): the full collections the objects of earlier lowerings set off land
in whichever length comes next.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings


def _model(layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hotswitch.models import PackedCausalLMLoss

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024, use_cache=False)
    return PackedCausalLMLoss(LlamaForCausalLM(config))


class _Collections:
    """Seconds the garbage collector spends collecting (a `gc.callbacks` entry), in all."""

    def __init__(self):
        self.seconds, self._started = 0.0, None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None


def measure(rank: int, layers: int, config_names: tuple[str, ...], lengths: int,
            dynamic: bool | None = None) -> dict | None:
    import gc

    import torch
    import torch.distributed as dist

    import hotswitch as hs
    from hotswitch.train.data import full_length_micro_batch

    warnings.filterwarnings("ignore")
    model = _model(layers)
    export_seconds = None
    if rank == 0:
        inputs = full_length_micro_batch(4, 64)
        t = time.perf_counter()
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            dims = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
            torch.export.export(model, inputs, dynamic_shapes=tuple(dims for _ in inputs), strict=False)
        export_seconds = time.perf_counter() - t
    dist.barrier()
    t = time.perf_counter()
    cm = hs.compile(model, full_length_micro_batch(4, 64), configs=list(config_names), dynamic=dynamic)
    total = time.perf_counter() - t
    first = {c: cm.compile_seconds(c) for c in config_names}
    later: dict[str, list[float]] = {c: [] for c in config_names}
    collecting: dict[str, list[float]] = {c: [] for c in config_names}  # of `later`: the garbage collector's
    collections = _Collections()
    gc.callbacks.append(collections)
    for c in config_names:
        for k in range(1, lengths):
            # every rank starts each length together: a rank timed while another still lowers the
            # previous length (for both, as dp ranks share programs) would count that one's work
            dist.barrier()
            t, collected = time.perf_counter(), collections.seconds
            # what a first forward_backward at this length pays before it runs: the program, and
            # what the runner makes of it (nothing more, now that its attention kernels are in it)
            cm.graph_runner(cm.exec_graph(c, ((4, 64 * (k + 1)),) * 3))
            later[c].append(time.perf_counter() - t)
            collecting[c].append(collections.seconds - collected)
    gc.callbacks.remove(collections)
    mine = {"trace": cm.trace_seconds, "total": total, "first": first, "later": later, "collecting": collecting}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None
    slowest = lambda f: max(f(r) for r in everyone)  # noqa: E731
    return {"layers": layers, "export_s": export_seconds, "trace_s": slowest(lambda r: r["trace"]),
            "compile_s": slowest(lambda r: r["total"]),
            "first_lowering_s": {c: slowest(lambda r, c=c: r["first"][c]) for c in config_names},
            "new_length_s": {c: [slowest(lambda r, c=c, k=k: r["later"][c][k]) for k in range(lengths - 1)]
                             for c in config_names},
            # of each length's time on its slowest rank, what that rank's garbage collector took
            "new_length_gc_s": {c: [max(everyone, key=lambda r, c=c, k=k: r["later"][c][k])["collecting"][c][k]
                                    for k in range(lengths - 1)] for c in config_names}}


def _collected(row: dict, configs: list[str]) -> str:
    """How much of a run's new lengths the slowest rank's garbage collector took, per config."""
    return "of the new lengths' seconds, the garbage collector's " + ", ".join(
        f"{c} {sum(row['new_length_gc_s'][c]):.2f} of {sum(row['new_length_s'][c]):.2f}" for c in configs)


def _median(rows: list[dict]):
    """One row of `rows` (runs of one measurement) holding each figure's median across them."""
    first = rows[0]
    if isinstance(first, dict):
        return {k: _median([r[k] for r in rows]) for k in first}
    if isinstance(first, list):
        return [_median(list(xs)) for xs in zip(*rows)]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return statistics.median(rows)
    return first  # (the same in every run: the depth, the cache's label)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def render(rows: list[dict], configs: list[str]) -> None:
    from hotswitch.cli.common import render_table

    columns = ["layers", "cache", "export s", "trace s", "hs.compile s"]
    columns += [f"{c} first s" for c in configs] + [f"{c} new length s" for c in configs]
    table = []
    for r in rows:
        table.append([str(r["layers"]), r["cache"], f"{r['export_s']:.1f}", f"{r['trace_s']:.1f}",
                      f"{r['compile_s']:.1f}"]
                     + [f"{r['first_lowering_s'][c]:.1f}" for c in configs]
                     + [f"{_mean(r['new_length_s'][c]):.1f}" for c in configs])
    render_table("compile time: slowest rank; 'new length': mean over the extra lengths", columns, table)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="2,8", help="comma-separated depths (default 2,8)")
    p.add_argument("--lengths", default="1,4", help="numbers of distinct sequence lengths (default 1,4)")
    p.add_argument("--configs", default="dp2tp2,tp4sp")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--dynamic", action="store_true",
                   help="also compile with dynamic=True (fitted in the length while compiling), cold")
    p.add_argument("--repeat", type=int, default=1,
                   help="cold runs per depth (default 1); the table and ratios take each figure's median")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    from hotswitch.distributed.launch import launch

    configs = args.configs.split(",")
    lengths = max(int(n) for n in args.lengths.split(","))
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    rows, runs = [], {}  # runs: "cold" or "cold, dynamic" -> depth -> its runs, each as measured
    for layers in (int(x) for x in args.layers.split(",")):
        for label in ("cold",) * args.repeat + ("warm",) + (("cold, dynamic",) * args.repeat if args.dynamic else ()):
            if label != "warm":  # (warm: the last cold run's cache)
                os.environ["HOTSWITCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="hotswitch-bench-cache-")
            print(f"{layers} layers, {label} cache ...", flush=True)
            row = launch(measure, args.world_size, layers, tuple(configs), lengths,
                         True if label == "cold, dynamic" else None)
            row["cache"] = label
            if label != "warm":
                repeated = runs.setdefault(label, {}).setdefault(layers, [])
                repeated.append(row)
                if len(repeated) < args.repeat:
                    continue
                row = _median(repeated)
            rows.append(row)
    render(rows, configs)
    cold = {r["layers"]: r for r in rows if r["cache"] == "cold"}
    warm = {r["layers"]: r for r in rows if r["cache"] == "warm"}
    dynamic = {r["layers"]: r for r in rows if r["cache"] == "cold, dynamic"}
    for layers, r in cold.items():
        lowering = sum(r["first_lowering_s"].values())
        print(f"{layers} layers: trace / torch.export {r['trace_s'] / r['export_s']:.2f}; warm / cold lowering "
              f"{sum(warm[layers]['first_lowering_s'].values()) / lowering:.2f}; new length / first lowering "
              + ", ".join(f"{c} {_mean(r['new_length_s'][c]) / r['first_lowering_s'][c]:.2f}" for c in configs))
        if lengths > 2:  # the second length samples a replay and fits it; later ones are written from that fit
            print(f"{layers} layers: second length / first lowering "
                  + ", ".join(f"{c} {r['new_length_s'][c][0] / r['first_lowering_s'][c]:.2f}" for c in configs)
                  + "; later lengths / first lowering "
                  + ", ".join(f"{c} {_mean(r['new_length_s'][c][1:]) / r['first_lowering_s'][c]:.2f}"
                              for c in configs))
        print(f"{layers} layers: {_collected(r, configs)}")
        if layers in dynamic:  # the same lengths, every one after the first written from a fit made in compile
            d = dynamic[layers]
            print(f"{layers} layers, dynamic=True: compile of each config / first lowering "
                  + ", ".join(f"{c} {d['first_lowering_s'][c] / r['first_lowering_s'][c]:.2f}" for c in configs)
                  + "; new length / first lowering "
                  + ", ".join(f"{c} {_mean(d['new_length_s'][c]) / r['first_lowering_s'][c]:.2f}" for c in configs))
            print(f"{layers} layers, dynamic=True: {_collected(d, configs)}")
    depth_ratios = (("cold", cold, "lowering"), ("cold, dynamic", dynamic, "dynamic=True: compile of each config"))
    for label, by_depth, what in depth_ratios:
        depths = sorted(by_depth)
        if len(depths) < 2:
            continue
        a, b = by_depth[depths[0]], by_depth[depths[-1]]
        each = ""
        if args.repeat > 1:  # run i at one depth against run i at the other
            each = "; run by run " + ", ".join(
                f"{c} " + " ".join(f"{y['first_lowering_s'][c] / x['first_lowering_s'][c]:.2f}"
                                   for x, y in zip(runs[label][depths[0]], runs[label][depths[-1]])) for c in configs)
        print(f"{what} at {depths[-1]} layers / at {depths[0]} layers: "
              + ", ".join(f"{c} {b['first_lowering_s'][c] / a['first_lowering_s'][c]:.2f}" for c in configs)
              + (f" (medians of {args.repeat} {label} runs{each})" if args.repeat > 1 else ""))
    if args.json:
        import torch

        with open(args.json, "w") as f:
            json.dump({"rows": rows, "cold_runs": runs.get("cold", {}), "dynamic_runs": runs.get("cold, dynamic", {}),
                       "torch": torch.__version__, "cpus": os.cpu_count(),
                       "python": platform.python_version()}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
