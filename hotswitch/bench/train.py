"""`hotswitch bench train`: hot switching against every static config that fits the budget, on the
same batches, in one run.

In one set of processes: the hot-switching trainer profiles each config at each bucket length
(buckets from the dataset's lengths); unless a memory budget is given, the budget is set so that
pure DP cannot hold the longest bucket (`budget_fraction` of its estimated peak there). After one
warm-up step, hot switching trains the given steps; then each static config that fits every
bucket within the budget trains the same batches (warm-up step, then the steps). Prints tokens/s
of each (step time: compilation and profiling excluded), the ratio hot / best static, and the share
of the hot step time spent switching. Default configs: dp=W and tp=W,sp.
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict

from hotswitch.progress import write_json
from hotswitch.train.loop import TrainingRun, TrainOptions, run_side_by_side, summary_line

__all__ = ["run"]


def run(opts: TrainOptions, budget_fraction: float, json_path: str) -> int:
    """Run the benchmark on `opts.world_size` processes, print the comparison, write `json_path`."""
    from hotswitch.distconfig import DistConfig
    from hotswitch.distributed.launch import LaunchError, launch

    names = ", ".join(DistConfig.parse(c).name for c in opts.configs)
    from hotswitch.distributed.device import describe_processes

    where = describe_processes(opts.world_size, opts.backend)
    print(f"hotswitch bench train: {opts.model} on {where}, configs {names}, "
          f"{opts.steps} steps of {opts.batch_size} sequences (+1 warm-up) from {opts.dataset}", flush=True)
    t0 = time.perf_counter()
    try:
        out = launch(_bench_worker, opts.world_size, opts, budget_fraction, backend=opts.backend)
    except LaunchError as e:
        print(f"hotswitch bench train: {e}", file=sys.stderr, flush=True)
        return 1
    out["seconds"] = time.perf_counter() - t0
    if out["best_static"] is None:
        print("no static config fits every bucket within the budget: only hot switching can run this data")
    else:
        h, b = out["hot"]["summary"], out["static"][out["best_static"]]["summary"]
        print(f"\nhot switching {h['tokens_per_second']:,.0f} tokens/s vs the best static config that fits "
              f"({out['best_static']}) {b['tokens_per_second']:,.0f} tokens/s: ratio {out['ratio']:.2f}x; "
              f"exposed switching takes {100 * h['switch_share']:.1f}% of the hot step time "
              f"({h['switch_seconds']:.3f} s; {h['overlapped_switch_seconds']:.3f} s more moved behind compute, "
              f"and {h['handed_off_bytes'] / 1e6:.1f} MB of gradients during the backward that made them final)")
    write_json(json_path, out)
    print(f"{'' if json_path == '-' else f'wrote {json_path} '}(total {out['seconds']:.0f} s)")
    return 0


def _bench_worker(rank: int, opts: TrainOptions, budget_fraction: float) -> dict:

    say = (lambda m: print(m, flush=True)) if rank == 0 else (lambda m: None)
    hot = TrainingRun(opts, list(opts.configs), rank)
    budget = opts.memory_budget
    if budget is None:
        hot.trainer.profile(hot.bounds)
        dp = max(hot.trainer.configs, key=lambda c: c.dp)
        peak = next(
            r["peak_bytes"]
            for r in hot.trainer.cost.table()
            if r["config"] == dp.name and r["length"] == hot.bounds[-1]
        )
        budget = int(budget_fraction * peak)
        say(f"budget: {budget / 2**20:.1f} MiB per rank = {budget_fraction:g} x the estimated peak of pure DP "
            f"({dp.name}) at the longest bucket ({hot.bounds[-1]} tokens)")
    hot.trainer.memory_budget_bytes = budget
    hot.trainer.profile(hot.bounds)
    table = hot.trainer.cost.table()
    for row in table:
        say(f"  profile {row['config']:>8} at {row['length']:>4} tokens: {row['peak_bytes'] / 2**20:7.1f} MiB"
            + (f", {row['seconds'] * 1e3:7.1f} ms per micro-batch of {row['rows']} rows" if row["seconds"] else "")
            + ("" if row["fits"] else "  (over budget: never run)"))
    fitting = [c for c in hot.trainer.configs if all(r["fits"] for r in table if r["config"] == c.name)]
    statics = {c.name: TrainingRun(opts, [c], rank, budget=budget, bounds=hot.bounds) for c in fitting}
    runs = {"hot switching": hot, **{f"static {n}": r for n, r in statics.items()}}
    run_side_by_side(runs, opts.warmup_steps + opts.steps)
    result = dict(budget_bytes=budget, profile=table, hot=hot.result(),
                  static={n: r.result() for n, r in statics.items()})
    say(f"hot switching: {summary_line(result['hot'])}")
    for n, r in result["static"].items():
        say(f"static {n}: {summary_line(r)}")
    speeds = {n: r["summary"]["tokens_per_second"] for n, r in result["static"].items()}
    best = max(speeds, key=speeds.get) if speeds else None
    result.update(
        best_static=best,
        ratio=result["hot"]["summary"]["tokens_per_second"] / speeds[best] if best else None,
        switch_share=result["hot"]["summary"]["switch_share"],
        options=asdict(opts),
    )
    return result

