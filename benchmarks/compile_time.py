"""Compile time of a GPT-2-small-sized model (12 layers, 768 wide, 12 heads, 50257 vocab) per DistConfig.

    python benchmarks/compile_time.py [--json PATH] [--model gpt2-small] [--configs dp4,dp2tp2,tp4,tp4sp]

Config names are dp<N>tp<M>pp<K>[sp] with any part left out (dp2pp2, tp2pp2sp). Under pp > 1 the
lowering time is the slowest rank's time for its stage (ranks of different stages lower different
graphs), and the ExecGraph shown is rank 0's stage (its gradient reduction is a separate program).

Spawns --world-size gloo processes (hotswitch.launch), traces the model once per rank and lowers it
for every config; prints the trace time, each config's lowering time (the slowest rank's), and the
size of rank 0's ExecGraph: nodes and collectives by phase (fwd | bwd | grad reduce).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings


def measure(rank: int, model_name: str, config_names: tuple[str, ...], batch: int, seq: int) -> dict | None:
    import torch
    import torch.distributed as dist

    import hotswitch as hs
    from hotswitch.cli.demo import synthetic_batch
    from hotswitch.compiler.lower import count_collectives
    from hotswitch.distconfig import DistConfig
    from hotswitch.models import build_model

    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    say = (lambda m: print(m, flush=True)) if rank == 0 else (lambda m: None)
    torch.manual_seed(0)
    model = build_model(model_name)
    ids, labels = synthetic_batch(model.cfg.vocab_size, batch, seq, seed=1)
    configs = [DistConfig.parse(n) for n in config_names]
    n_params = sum(p.numel() for p in model.parameters())

    say(f"tracing {model_name} ({n_params / 1e6:.1f}M parameters) and compiling {', '.join(config_names)} "
        f"on {dist.get_world_size()} ranks ...")
    t = time.perf_counter()
    cm = hs.compile(model, (ids, labels), configs=configs)
    total = time.perf_counter() - t
    mine = {"trace": cm.trace_seconds, "total": total,
            "lower": {c.name: cm.compile_seconds(c.name) for c in configs}}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None
    rows = []
    for c in configs:
        gm = cm.exec_graph(c.name)
        rows.append({
            "config": c.name, "dp": c.dp, "tp": c.tp, "pp": c.pp, "sp": c.sp,
            "lower_s": max(r["lower"][c.name] for r in everyone),
            "lower_s_per_rank": [r["lower"][c.name] for r in everyone],
            "nodes": len(gm.graph.nodes),
            "collectives": {phase: dict(count_collectives(gm, phase)) for phase in ("forward", "backward", "reduce")},
        })
    return {
        "model": model_name,
        "parameters": n_params,
        "batch": batch,
        "seq": seq,
        "world_size": dist.get_world_size(),
        "trace_s": max(r["trace"] for r in everyone),
        "compile_total_s": max(r["total"] for r in everyone),
        "configs": rows,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }


def render(result: dict) -> None:
    from hotswitch.cli.common import format_counts, render_table

    total = lambda kinds: sum(kinds.values())  # noqa: E731
    rows = [[r["config"], f"{r['lower_s']:.2f}", str(r["nodes"]), str(sum(total(k) for k in r["collectives"].values())),
             format_counts(r["collectives"]["forward"]), format_counts(r["collectives"]["backward"]),
             format_counts(r["collectives"]["reduce"])] for r in result["configs"]]
    print(
        f"compile time: {result['model']} ({result['parameters'] / 1e6:.1f}M parameters), "
        f"batch {result['batch']} x seq {result['seq']}, {result['world_size']} gloo ranks on {result['cpus']} CPUs, "
        f"torch {result['torch']}"
    )
    render_table("lowering: slowest rank; nodes and collectives: rank 0's ExecGraph",
                 ["config", "lowering s", "nodes", "collectives", "fwd", "bwd", "grad reduce"], rows)
    lowering = sum(r["lower_s"] for r in result["configs"])
    print(f"trace (once): {result['trace_s']:.2f} s; lowering, all configs: {lowering:.2f} s; "
          f"hs.compile total: {result['compile_total_s']:.2f} s (slowest rank each)", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2-small")
    p.add_argument("--configs", default="dp4,dp2tp2,tp4,tp4sp")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    from hotswitch.distributed.launch import launch

    t = time.perf_counter()
    result = launch(measure, args.world_size, args.model, tuple(args.configs.split(",")), args.batch, args.seq)
    result["wall_s"] = time.perf_counter() - t
    render(result)
    print(f"wall time including process start: {result['wall_s']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
