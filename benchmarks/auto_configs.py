"""`Trainer(configs="auto")` against the hand-written dp4 + tp4sp set, on `hotswitch bench train`'s setup.

    python benchmarks/auto_configs.py [--model gpt-tiny] [--steps 4] [--batch-size 64] [--json PATH]

On 4 gloo processes, the README's `hotswitch bench train` setup: gpt-tiny, 64 skewed sequences per
global batch up to 256 tokens, 1,024 tokens per replica per micro-batch, buckets from the dataset's
lengths, a budget of 0.9x pure DP's estimated peak at the longest bucket (so long rows cannot run
under pure DP). The hand-written run trains with dp4 + tp4sp; the automatic one with
`Trainer(model, "auto", memory_budget_bytes=budget, buckets=<the same>)`, which measures three
configs, searches, and trains with what it chose. Both take the same batches side by side (one
warm-up step each, then `--steps` measured): tokens/s, the configs each used, and whether their
losses agree.
"""
from __future__ import annotations

import argparse
import json
import sys


def _worker(rank: int, opts, budget_fraction: float) -> dict:

    from hotswitch.train.loop import TrainingRun, run_side_by_side

    say = (lambda m: print(m, flush=True)) if rank == 0 else (lambda m: None)
    hand = TrainingRun(opts, ["dp4", "tp4sp"], rank)
    hand.trainer.profile(hand.bounds)
    peak = next(r["peak_bytes"] for r in hand.trainer.cost.table()
                if r["config"] == "dp4" and r["length"] == hand.bounds[-1])
    budget = int(budget_fraction * peak)
    hand.trainer.memory_budget_bytes = budget
    say(f"buckets {hand.bounds}; budget {budget / 2**20:.1f} MiB per rank")
    auto = TrainingRun(opts, "auto", rank, budget=budget, bounds=hand.bounds)
    say(f"auto chose {[c.name for c in auto.trainer.configs]}: {dict(auto.trainer.search.assignment)}")
    runs = {"hand-written dp4 + tp4sp": hand, "auto": auto}
    run_side_by_side(runs, opts.warmup_steps + opts.steps)
    out = {label: run.result() for label, run in runs.items()}
    out["budget"] = budget
    out["auto_configs"] = [c.name for c in auto.trainer.configs]
    out["auto_table"] = auto.trainer.search.table()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--budget-fraction", type=float, default=0.9)
    p.add_argument("--json", default="auto_configs.json")
    args = p.parse_args(argv)

    from hotswitch.distributed.launch import launch
    from hotswitch.train.loop import TrainOptions

    opts = TrainOptions(model=args.model, world_size=4, dataset="synthetic-skewed", steps=args.steps,
                        batch_size=args.batch_size, max_length=256, configs=("dp4", "tp4sp"), static=None,
                        memory_budget=None, micro_batch_tokens=1024, buckets=None, lr=1e-3, seed=0, zero1=False,
                        save_final=None, warmup_steps=1)
    out = launch(_worker, 4, opts, args.budget_fraction)
    hand, auto = out["hand-written dp4 + tp4sp"]["summary"], out["auto"]["summary"]
    print(out["auto_table"])
    ratio = auto["tokens_per_second"] / hand["tokens_per_second"]
    print(f"\nhand-written dp4 + tp4sp: {hand['tokens_per_second']:,.0f} tokens/s; auto "
          f"({', '.join(out['auto_configs'])}): {auto['tokens_per_second']:,.0f} tokens/s: ratio {ratio:.2f}x")
    diff = max(abs(a - b) / abs(b) for a, b in zip(auto["losses"], hand["losses"]))
    print(f"losses per step: hand {['%.5f' % x for x in hand['losses']]}, auto {['%.5f' % x for x in auto['losses']]} "
          f"(largest relative difference {diff:.1e})")
    with open(args.json, "w") as f:
        json.dump({k: v for k, v in out.items() if k != "auto_table"}, f, indent=1, default=str)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
