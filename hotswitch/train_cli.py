"""`hotswitch train` and `hotswitch bench train`: the mixed-length Trainer on spawned CPU processes.

    hotswitch train --model gpt-tiny --world-size 4 --dataset synthetic-skewed --steps 5
    hotswitch train ... --static dp=2,tp=2          # the same data under one config, for comparison
    hotswitch bench train                           # hot switching vs the best static config that fits

Every rank builds the same model (seeded), reads the same global batches (a seeded sample order
over the dataset) and runs `Trainer.step`; rank 0 prints one line per step and a progress bar.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

__all__ = ["add_train", "add_bench_train"]

HF_MODELS = {"llama-tiny": "llama"}  # Hugging Face models built from a small config, random weights


@dataclass(frozen=True)
class TrainOptions:
    model: str
    world_size: int
    dataset: str
    steps: int
    batch_size: int
    max_length: int
    configs: tuple[str, ...]
    static: str | None
    memory_budget: float | None  # bytes
    micro_batch_tokens: int
    buckets: tuple[int, ...] | None
    lr: float
    seed: int
    zero1: bool
    save_final: str | None
    warmup_steps: int = 0  # steps run first and left out of the summary (compilation, profiling)
    quiet: bool = False


def add_train(subparsers) -> None:
    p = subparsers.add_parser("train", help="mixed-length training with hot switching on CPU processes",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _train_arguments(p)
    p.add_argument("--static", default=None, metavar="CONFIG",
                   help="run the same data under this one config (e.g. 'dp=4' or 'tp=4,sp'), without switching")
    p.add_argument("--save-final", default=None, metavar="PATH", help="write the final full state dict (torch.save)")
    p.set_defaults(run=run_train)


def _train_arguments(p) -> None:
    p.add_argument("--model", default="gpt-tiny", help="built-in model (hotswitch.models.MODEL_CONFIGS) or "
                   f"{', '.join(HF_MODELS)} (a Hugging Face model from a small config); default gpt-tiny")
    p.add_argument("--world-size", type=int, default=4, help="processes to spawn (default 4)")
    p.add_argument("--dataset", default="synthetic-skewed", help="'synthetic-skewed' (seeded long-tailed lengths) "
                   "or a JSONL file of token ids (one list, or {\"input_ids\": [...]}, per line)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    p.add_argument("--batch-size", type=int, default=64, help="sequences per global batch (default 64)")
    p.add_argument("--max-length", type=int, default=None, help="longest synthetic sequence (default: the model's limit)")
    p.add_argument("--configs", default=None, help="semicolon-separated DistConfigs, e.g. 'dp=4;dp=2,tp=2;tp=4,sp' "
                   "(default: dp<W>, dp<W/2>tp2, tp<W>sp)")
    p.add_argument("--memory-budget-mib", type=float, default=None, help="per-rank memory budget in MiB (default: none)")
    p.add_argument("--micro-batch-tokens", type=int, default=1024, help="tokens per data-parallel replica per "
                   "micro-batch (default 1024)")
    p.add_argument("--buckets", default=None, help="comma-separated bucket bounds, e.g. 32,64,256 (default: from the "
                   "first batch's length distribution)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zero1", action="store_true", help="shard AdamW states over the base config's dp ranks")


def _options(args, **extra) -> TrainOptions:
    from hotswitch.cli import default_configs, parse_config
    from hotswitch.models import MODEL_CONFIGS

    from distconfig import DistConfig

    if args.model not in MODEL_CONFIGS and args.model not in HF_MODELS:
        raise SystemExit(f"hotswitch: unknown model {args.model!r}; choose from {', '.join([*MODEL_CONFIGS, *HF_MODELS])}")
    if args.steps < 1 or args.batch_size < 1 or args.world_size < 1:
        raise SystemExit("hotswitch: need --steps >= 1, --batch-size >= 1 and --world-size >= 1")
    try:
        if args.configs:
            configs = [DistConfig.parse(s) for s in args.configs.split(";")]
        else:
            configs = [parse_config(n) for n in default_configs(args.world_size)]
        static = getattr(args, "static", None)
        if static:
            static = DistConfig.parse(static).spec()
            DistConfig.parse(static).check_world_size(args.world_size)
        for c in configs:
            c.check_world_size(args.world_size)
        buckets = tuple(int(b) for b in args.buckets.split(",")) if args.buckets else None
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise SystemExit(f"hotswitch: {e}")
    if args.dataset != "synthetic-skewed" and not os.path.isfile(args.dataset):
        raise SystemExit(f"hotswitch: dataset {args.dataset!r} is neither 'synthetic-skewed' nor a JSONL file")
    max_length = args.max_length or (MODEL_CONFIGS[args.model].max_seq_len if args.model in MODEL_CONFIGS else 256)
    budget = args.memory_budget_mib * 2**20 if args.memory_budget_mib else None
    return TrainOptions(args.model, args.world_size, args.dataset, args.steps, args.batch_size, max_length,
                        tuple(c.spec() for c in configs), static, budget, args.micro_batch_tokens, buckets, args.lr,
                        args.seed, args.zero1, getattr(args, "save_final", None), **extra)


def run_train(args) -> int:
    from hotswitch.launch import LaunchError, launch

    opts = _options(args)
    what = f"static {opts.static}" if opts.static else "configs " + " | ".join(opts.configs)
    print(f"hotswitch train: {opts.model} on {opts.world_size} CPU processes (gloo), {what}; {opts.steps} steps of "
          f"{opts.batch_size} sequences from {opts.dataset}", flush=True)
    t0 = time.perf_counter()
    try:
        result = launch(_train_worker, opts.world_size, opts)
    except LaunchError as e:
        print(f"hotswitch train: {e}", file=sys.stderr, flush=True)
        return 1
    print(_summary_line(result), flush=True)
    if opts.save_final:
        print(f"wrote {opts.save_final}", flush=True)
    print(f"total {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


def _summary_line(result: dict) -> str:
    s = result["summary"]
    return (f"{s['steps']} steps: {s['tokens_per_second']:,.0f} tokens/s, switching {s['switch_seconds']:.2f} s = "
            f"{100 * s['switch_share']:.1f}% of step time, final loss {s['final_loss']:.4f}")


def _model(opts: TrainOptions):
    import torch

    from hotswitch.models import build_hf_model, build_model

    torch.manual_seed(opts.seed)  # identical weights on every rank
    if opts.model in HF_MODELS:
        return build_hf_model(HF_MODELS[opts.model]).model
    return build_model(opts.model)


def _dataset(opts: TrainOptions, vocab_size: int):
    from hotswitch import data as D

    if opts.dataset == "synthetic-skewed":
        return D.synthetic_skewed(max(opts.batch_size * opts.steps, 4 * opts.batch_size), vocab_size, opts.max_length,
                                  seed=opts.seed)
    return D.load_jsonl(opts.dataset, vocab_size)


def _train_worker(rank: int, opts: TrainOptions) -> dict:
    import warnings

    import torch
    from tqdm import tqdm

    from hotswitch import data as D
    from hotswitch.trainer import Trainer

    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"hotswitch: .* could not be sharded")  # replicated fallback, exact
    show = rank == 0 and not opts.quiet
    model = _model(opts)
    dataset = _dataset(opts, model.get_input_embeddings().num_embeddings)
    order = D.SampleOrder(len(dataset), opts.batch_size, seed=opts.seed)
    configs = [opts.static] if opts.static else list(opts.configs)
    # a static run keeps the hot run's number of buckets: short rows are cheaper under any config
    trainer = Trainer(model, configs, dict(name="adamw", lr=opts.lr), opts.memory_budget, buckets=opts.buckets,
                      num_buckets=len(opts.configs), micro_batch_tokens=opts.micro_batch_tokens, zero1=opts.zero1,
                      progress=(lambda m: print(m, flush=True)) if show else None)
    if opts.buckets is None:
        trainer.choose_buckets([len(s) for s in dataset])  # from the dataset's length distribution
    reports = []
    total = opts.warmup_steps + opts.steps
    bar = tqdm(total=total, desc="training", unit="step", disable=not show or None, leave=False, file=sys.stderr)
    for step in range(total):
        report = trainer.step([dataset[i] for i in order.batch(step)])
        if step >= opts.warmup_steps:
            reports.append(report)
        if show:
            extra = f" (profile {report.profile_seconds:.1f}s, compile {report.compile_seconds:.1f}s)" \
                if report.profile_seconds or report.compile_seconds > 0.05 else ""
            tqdm.write(report.line() + extra, file=sys.stdout)
        bar.update()
    bar.close()
    if opts.save_final:
        state = trainer.full_state_dict()
        if rank == 0:
            torch.save(state, opts.save_final)
    seconds = sum(r.seconds for r in reports)
    switch = sum(r.switch_seconds for r in reports)
    summary = dict(steps=len(reports), tokens=sum(r.tokens for r in reports), seconds=seconds, switch_seconds=switch,
                   tokens_per_second=sum(r.tokens for r in reports) / seconds, switch_share=switch / seconds,
                   final_loss=reports[-1].loss, losses=[r.loss for r in reports])
    return dict(summary=summary, reports=[_report_dict(r) for r in reports], profile=trainer.cost.table(),
                base=trainer.base, budget=trainer.memory_budget_bytes)


def _report_dict(report) -> dict:
    d = asdict(report)
    d.update(switch_seconds=report.switch_seconds, tokens_per_second=report.tokens_per_second)
    return d


# ------------------------------------------------------------------------------------ bench train
def add_bench_train(sub) -> None:
    q = sub.add_parser("train", help="tokens/s of hot-switched mixed-length training vs the best static config "
                       "that fits the same memory budget", description=run_bench_train.__doc__)
    _train_arguments(q)
    q.set_defaults(steps=4, batch_size=64, memory_budget_mib=None)
    q.add_argument("--budget-fraction", type=float, default=0.9, help="without --memory-budget-mib: the budget is "
                   "this fraction of pure DP's estimated peak at the longest bucket, so long rows do not fit pure DP")
    q.add_argument("--json", default="bench_train.json", help="where to write the results (default bench_train.json)")
    q.set_defaults(run=run_bench_train)


def run_bench_train(args) -> int:
    """Hot switching against every static config that fits the budget, on the same batches, in one run.

    1. A profiling run (one warm-up step) of the hot-switching trainer measures each config at each
       bucket length; unless --memory-budget-mib is given the budget is set so that pure DP cannot
       hold the longest bucket (--budget-fraction of its estimated peak there).
    2. Hot switching trains --steps steps after that warm-up step; so does each static config that
       fits every bucket within the budget, from the same initial weights on the same batches.
    3. Prints tokens/s of each, the ratio hot / best static, and the share of step time switching.
    """
    from distconfig import DistConfig
    from hotswitch.launch import LaunchError, launch

    opts = _options(args, warmup_steps=1, quiet=False)
    t0 = time.perf_counter()
    try:
        budget = opts.memory_budget
        if budget is None:
            probe = launch(_probe_worker, opts.world_size, replace(opts, steps=1, warmup_steps=0, quiet=True))
            budget = int(args.budget_fraction * probe["dp_peak_at_longest"])
            print(f"budget: {budget / 2**20:.1f} MiB per rank = {args.budget_fraction:g} x pure DP "
                  f"({probe['dp_config']})'s estimated peak at the longest bucket ({probe['longest']} tokens)", flush=True)
            fitting = [spec for spec in opts.configs if all(r["peak_bytes"] <= budget for r in probe["profile"]
                                                            if r["config"] == DistConfig.parse(spec).name)]
        else:
            fitting = list(opts.configs)
        opts = replace(opts, memory_budget=budget)
        print(f"hot switching over {' | '.join(opts.configs)} ...", flush=True)
        hot = launch(_train_worker, opts.world_size, opts)
        print(_summary_line(hot), flush=True)
        statics = {}
        for config in fitting:
            print(f"static {config} ...", flush=True)
            statics[config] = launch(_train_worker, opts.world_size, replace(opts, static=config, quiet=True))
            print(_summary_line(statics[config]), flush=True)
    except LaunchError as e:
        print(f"hotswitch bench train: {e}", file=sys.stderr, flush=True)
        return 1
    if not statics:
        print("no static config fits every bucket within the budget: hot switching is the only way to run this data")
        return 0
    best = max(statics, key=lambda c: statics[c]["summary"]["tokens_per_second"])
    h, b = hot["summary"], statics[best]["summary"]
    print(f"\nhot switching {h['tokens_per_second']:,.0f} tokens/s vs best static that fits ({best}) "
          f"{b['tokens_per_second']:,.0f} tokens/s: ratio {h['tokens_per_second'] / b['tokens_per_second']:.2f}x; "
          f"switching {100 * h['switch_share']:.1f}% of hot step time")
    out = dict(options=asdict(opts), budget_bytes=budget, hot=hot, static=statics, best_static=best,
               ratio=h["tokens_per_second"] / b["tokens_per_second"], switch_share=h["switch_share"],
               seconds=time.perf_counter() - t0)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"wrote {args.json} (total {out['seconds']:.0f} s)")
    return 0


def _probe_worker(rank: int, opts: TrainOptions) -> dict:
    """Profile every config at the first batch's bucket lengths; report pure DP's peak at the longest."""
    import warnings

    from hotswitch import data as D
    from hotswitch.trainer import Trainer

    warnings.filterwarnings("ignore", message=r"hotswitch: .* could not be sharded")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    model = _model(opts)
    dataset = _dataset(opts, model.get_input_embeddings().num_embeddings)
    batch = [dataset[i] for i in D.SampleOrder(len(dataset), opts.batch_size, seed=opts.seed).batch(0)]
    trainer = Trainer(model, list(opts.configs), dict(name="adamw", lr=opts.lr), buckets=opts.buckets,
                      num_buckets=len(opts.configs), micro_batch_tokens=opts.micro_batch_tokens, zero1=opts.zero1)
    bounds = trainer.bucket_bounds([len(s) for s in batch]) if opts.buckets else trainer.choose_buckets([len(s) for s in dataset])
    trainer.profile(bounds)
    dp = max(trainer.configs, key=lambda c: c.dp)
    table = trainer.cost.table()
    peak = next(r["peak_bytes"] for r in table if r["config"] == dp.name and r["length"] == bounds[-1])
    return dict(profile=table, dp_config=dp.name, longest=bounds[-1], dp_peak_at_longest=peak)
