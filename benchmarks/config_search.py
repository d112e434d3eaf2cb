"""Predicted vs measured step time over every candidate config: is the search's cost model right?

    python benchmarks/config_search.py [--model gpt-small] [--world-size 4] [--lengths 64,256]
                                       [--micro-batch-tokens 1024] [--repeats 8] [--memory-budget-mib M]
                                       [--rules] [--json PATH]

On `--world-size` gloo processes, a Trainer compiles every config of the search space (dp x tp, sp;
pp = 1, as the Trainer runs them) at each length (`Trainer.profile`: peak memory from the
ExecGraph), then one micro-batch of each is timed: the fastest of `--repeats` forward + backward
runs after a warm-up, each the slowest rank's (the minimum, not the median: on a shared machine
noise only ever adds time). Then, as `Trainer(configs="auto")` does, only the three calibration configs
(`search.auto.calibration_configs`) calibrate the cost model, and `search_configs` predicts every
config, its communication priced by the collectives of its ExecGraph (`--rules`: by Megatron's
rules). A length's step time is its micro-batches (the same count for prediction and measurement)
times one micro-batch's seconds. Printed per length: predicted and measured seconds of every
config, the Spearman rank correlation, and whether the measured-fastest config within the budget is
the predicted-fastest (or within 10% of it); then both over all (config, length) pairs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import numpy as np


def measure(rank: int, model_name: str, lengths: list[int], micro_batch_tokens: int, repeats: int) -> dict:
    import dataclasses

    import torch
    import torch.distributed as dist

    from hotswitch.distconfig import Topology
    from hotswitch.models import build_model
    from hotswitch.search import describe_workload, enumerate_configs
    from hotswitch.train import data as D
    from hotswitch.train.trainer import Trainer

    torch.manual_seed(0)
    model = build_model(model_name)
    world = dist.get_world_size()
    space = enumerate_configs(describe_workload(model), Topology.from_env(world))
    say = (lambda m: print(m, flush=True)) if rank == 0 else (lambda m: None)
    say(f"measuring {', '.join(c.name for c in space.configs)} at lengths {lengths}")
    t0 = time.perf_counter()
    trainer = Trainer(model, list(space.configs), micro_batch_tokens=micro_batch_tokens, profile_repeats=1,
                      progress=say)
    trainer.profile(lengths)  # compiles every (config, length) and reads the ExecGraph's peak memory
    cm, probes = trainer.cm, []
    for config in space.configs:  # then times each: the fastest of `repeats` runs (slowest rank each)
        cm.switch(config.name)
        for length in lengths:
            rows = trainer.rows_per_micro_batch(config, length)
            local = cm.shard_inputs(*D.full_length_micro_batch(rows, length, seed=length))
            cm.forward_backward(*local)
            best = float("inf")
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                cm.forward_backward(*local)
                took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                best = min(best, float(took))
            cm.zero_grad()
            probes.append(dataclasses.replace(trainer.cost.probes[(config.name, length)], seconds=best))
    say(f"measured in {time.perf_counter() - t0:.0f} s")
    comm = trainer.comm_profiles(lengths[0])  # each config's ExecGraph collectives, as `configs="auto"` reads them
    return dict(probes=probes, configs=[c.spec() for c in space.configs], comm=comm)


def spearman(a, b) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(x):
        x = np.asarray(x, dtype=float)
        order = x.argsort(kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for v in np.unique(x):  # ties share their mean rank
            r[x == v] = r[x == v].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--lengths", default="64,256")
    p.add_argument("--micro-batch-tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--memory-budget-mib", type=float, default=None)
    p.add_argument("--rules", action="store_true",
                   help="price communication by Megatron's rules instead of each config's ExecGraph collectives")
    p.add_argument("--json", default="config_search.json")
    args = p.parse_args(argv)

    import torch

    from hotswitch.distconfig import DistConfig, Topology
    from hotswitch.distributed.launch import launch
    from hotswitch.models import build_model
    from hotswitch.search import Hardware, search_configs
    from hotswitch.search.auto import calibration_configs

    lengths = [int(x) for x in args.lengths.split(",")]
    out = launch(measure, args.world_size, args.model, lengths, args.micro_batch_tokens, args.repeats)
    probes = out["probes"]
    configs = [DistConfig.parse(s) for s in out["configs"]]
    calibrating = {c.name for c in calibration_configs(configs)}
    with torch.device("meta"):
        model = build_model(args.model)
    budget = None if args.memory_budget_mib is None else int(args.memory_budget_mib * 2**20)
    result = search_configs(model, world_size=args.world_size, lengths=lengths, memory_budget_bytes=budget,
                            topology=Topology(args.world_size, args.world_size),
                            micro_batch_tokens=args.micro_batch_tokens, hardware=Hardware.cpu(),
                            probes=[q for q in probes if q.config in calibrating],
                            comm_profiles=None if args.rules else out["comm"])
    measured = {(q.config, q.length): q for q in probes}
    rows, report = [], {}
    print(f"\n{args.model} on {args.world_size} gloo processes, {args.micro_batch_tokens} tokens per replica per "
          f"micro-batch; calibrated on {', '.join(sorted(calibrating))} (x{len(lengths)} lengths)")
    for length in lengths:
        print(f"\nlength {length} ({result.tokens[length]:,} tokens per step)")
        print(f"{'config':>10} {'predicted s':>12} {'measured s':>11} {'pred/meas':>10} {'peak pred':>10} "
              f"{'peak meas':>10}  calibration")
        here = []
        for e in sorted(result.estimates[length], key=lambda e: e.seconds):
            q = measured[(e.name, length)]
            assert q.rows == e.rows, (e.name, length, q.rows, e.rows)
            seconds = None if q.seconds is None else e.micro_batches * q.seconds
            fits = budget is None or q.peak_bytes <= budget
            here.append(dict(config=e.name, length=length, predicted=e.seconds, measured=seconds,
                             predicted_peak=e.peak_bytes, measured_peak=q.peak_bytes, fits=fits,
                             calibration=e.name in calibrating))
            print(f"{e.name:>10} {e.seconds:>12.3f} {seconds or float('nan'):>11.3f} "
                  f"{e.seconds / seconds if seconds else float('nan'):>10.2f} {e.peak_bytes / 2**20:>9.0f}M "
                  f"{q.peak_bytes / 2**20:>9.0f}M  {'yes' if e.name in calibrating else ''}")
        report[length] = _compare(here)
        r = report[length]
        print(f"Spearman {r['spearman']:.3f}; measured fastest {r['measured_fastest']}, predicted fastest "
              f"{r['predicted_fastest']} ({r['gap_percent']:.1f}% slower than the measured fastest): "
              f"{'OK' if r['ok'] else 'NOT within 10%'}")
        rows += here
    pooled = dict(spearman=spearman([r["predicted"] for r in rows], [r["measured"] for r in rows]))
    held_out = [r for r in rows if not r["calibration"]]
    print(f"\nall (config, length) pairs: Spearman {pooled['spearman']:.3f}; configs not measured for calibration "
          f"only: Spearman {spearman([r['predicted'] for r in held_out], [r['measured'] for r in held_out]):.3f}")
    print(f"search chose {', '.join(c.name for c in result.chosen)} ({result.assignment})")
    with open(args.json, "w") as f:
        json.dump(dict(args=vars(args), rows=rows, per_length={str(k): v for k, v in report.items()},
                       pooled=pooled, chosen=[c.name for c in result.chosen],
                       probes=[dataclasses.asdict(q) for q in probes],
                       rates={k: float(v) for k, v in dataclasses.asdict(result.rates).items()}), f, indent=1)
    print(f"wrote {args.json}")
    return 0 if all(r["ok"] for r in report.values()) else 1


def _compare(rows: list[dict]) -> dict:
    timed = [r for r in rows if r["measured"] is not None and r["fits"]]
    rho = spearman([r["predicted"] for r in timed], [r["measured"] for r in timed])
    fastest = min(timed, key=lambda r: r["measured"])
    picked = min(timed, key=lambda r: r["predicted"])
    gap = 100 * (picked["measured"] / fastest["measured"] - 1)
    return dict(spearman=rho, measured_fastest=f"{fastest['config']}@{fastest['length']}",
                predicted_fastest=f"{picked['config']}@{picked['length']}", gap_percent=gap, ok=gap <= 10)


if __name__ == "__main__":
    sys.exit(main())
