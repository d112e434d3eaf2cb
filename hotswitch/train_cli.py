"""`hotswitch train` and `hotswitch bench train`: the mixed-length Trainer on spawned CPU processes.

    hotswitch train --model gpt-tiny --world-size 4 --dataset synthetic-skewed --steps 5
    hotswitch train ... --static dp=2,tp=2          # the same data under one config, for comparison
    hotswitch train --elastic 2:4 --scale 3:2       # workers may die (SIGKILL) or come and go; see below
    hotswitch bench train                           # hot switching vs the best static config that fits

With --elastic MIN:MAX the workers run under hotswitch's agent (`hotswitch.membership`): a worker
that dies is dropped and the job goes on with the others (at least MIN) under configs re-derived for
the new count; --scale STEP:N and --redeploy STEP plan changes before global batch STEP. State moves
between workers by the switch planner; slices no survivor holds come from the latest asynchronous
torch.distributed.checkpoint (--checkpoint-every N steps, in --checkpoint-dir) and the steps since
it are replayed. A line "step N ..." is printed when step N completes (again, marked "replayed",
when it is replayed).

Every rank builds the same model (seeded), reads the same global batches (a seeded sample order
over the dataset) and runs `Trainer.step`; rank 0 prints one line per step and a progress bar.
"""
from __future__ import annotations

import argparse
import json
import math
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
    elastic: tuple[int, int] | None = None  # (MIN, MAX) workers
    events: tuple = ()  # (step, "scale", n) | (step, "redeploy", None)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 2
    step_timeout: float = 30.0


def add_train(subparsers) -> None:
    p = subparsers.add_parser("train", help="mixed-length training with hot switching on CPU processes",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _train_arguments(p)
    p.add_argument("--static", default=None, metavar="CONFIG",
                   help="run the same data under this one config (e.g. 'dp=4' or 'tp=4,sp'), without switching")
    p.add_argument("--save-final", default=None, metavar="PATH", help="write the final full state dict (torch.save)")
    e = p.add_argument_group("elastic training (workers may die, join or leave)")
    e.add_argument("--elastic", default=None, metavar="MIN:MAX", help="run under the elastic agent with between MIN "
                   "and MAX workers (--world-size at the start); a killed worker is dropped and the job goes on")
    e.add_argument("--scale", action="append", default=[], metavar="STEP:N", help="planned scale-out/in to N workers "
                   "before global batch STEP (repeatable; needs --elastic)")
    e.add_argument("--redeploy", action="append", default=[], type=int, metavar="STEP", help="move the job to as many "
                   "new workers before global batch STEP (repeatable; needs --elastic)")
    e.add_argument("--checkpoint-dir", default=None, help="asynchronous DCP checkpoints (default: a new temporary "
                   "directory, printed)")
    e.add_argument("--checkpoint-every", type=int, default=2, help="checkpoint every N steps (default 2)")
    e.add_argument("--step-timeout", type=float, default=30.0, help="seconds a collective may wait for a peer "
                   "inside a step before the peer counts as gone (default 30)")
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
                   "(default: dp<W>;tp<W>,sp)")
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
            # HotSPa's two ends: pure DP for short rows, TP+SP for long ones
            configs = [parse_config(n) for n in default_configs(args.world_size) if "tp" not in n or "sp" in n]
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
    extra.update(_elastic_options(args))
    return TrainOptions(args.model, args.world_size, args.dataset, args.steps, args.batch_size, max_length,
                        tuple(c.spec() for c in configs), static, budget, args.micro_batch_tokens, buckets, args.lr,
                        args.seed, args.zero1, getattr(args, "save_final", None), **extra)


def _elastic_options(args) -> dict:
    """--elastic MIN:MAX, --scale STEP:N, --redeploy STEP, --checkpoint-* checked and parsed."""
    elastic = getattr(args, "elastic", None)
    if elastic is None:
        if getattr(args, "scale", None) or getattr(args, "redeploy", None):
            raise SystemExit("hotswitch: --scale and --redeploy need --elastic MIN:MAX")
        return {}
    try:
        low, high = (int(x) for x in elastic.split(":"))
    except ValueError:
        raise SystemExit(f"hotswitch: --elastic takes MIN:MAX worker counts, e.g. 2:4; got {elastic!r}") from None
    if not 1 <= low <= args.world_size <= high:
        raise SystemExit(f"hotswitch: --elastic {elastic} must satisfy 1 <= MIN <= --world-size ({args.world_size}) <= MAX")
    events = []
    for spec in args.scale:
        try:
            step, n = (int(x) for x in spec.split(":"))
        except ValueError:
            raise SystemExit(f"hotswitch: --scale takes STEP:N, e.g. 3:2; got {spec!r}") from None
        if not low <= n <= high or step < 0:
            raise SystemExit(f"hotswitch: --scale {spec}: N must lie in --elastic {elastic} and STEP be >= 0")
        events.append((step, "scale", n))
    events += [(step, "redeploy", None) for step in args.redeploy]
    if args.checkpoint_every < 1 or args.step_timeout <= 0:
        raise SystemExit("hotswitch: need --checkpoint-every >= 1 and --step-timeout > 0")
    directory = args.checkpoint_dir
    if directory is None:
        import tempfile

        directory = tempfile.mkdtemp(prefix="hotswitch-checkpoints-")
    return dict(elastic=(low, high), events=tuple(sorted(events)), checkpoint_dir=directory,
                checkpoint_every=args.checkpoint_every, step_timeout=args.step_timeout)


def run_train(args) -> int:
    from hotswitch.launch import LaunchError, launch

    opts = _options(args)
    if opts.elastic is not None:
        return _run_elastic_train(opts)
    what = f"static {_name(opts.static)}" if opts.static else "configs " + ", ".join(_name(c) for c in opts.configs)
    if opts.memory_budget:
        what += f", memory budget {opts.memory_budget / 2**20:g} MiB per rank"
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


def _name(spec: str) -> str:
    from distconfig import DistConfig

    return DistConfig.parse(spec).name


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


def _run_elastic_train(opts: TrainOptions) -> int:
    from hotswitch.membership import ElasticError, run_elastic

    low, high = opts.elastic
    configs = [opts.static] if opts.static else list(opts.configs)
    print(f"hotswitch train --elastic {low}:{high}: {opts.model} on {opts.world_size} CPU worker processes (gloo), "
          f"candidate configs {', '.join(_name(c) for c in configs)}; {opts.steps} steps of {opts.batch_size} "
          f"sequences from {opts.dataset}; checkpoints every {opts.checkpoint_every} steps in {opts.checkpoint_dir}",
          flush=True)
    for step, kind, n in opts.events:
        print(f"  planned: {kind}{'' if n is None else ' to ' + str(n) + ' workers'} before step {step}", flush=True)
    t0 = time.perf_counter()
    try:
        result = run_elastic(_elastic_worker, opts.world_size, opts, min_size=low, max_size=high,
                             log=lambda m: print(m, flush=True))
    except ElasticError as e:
        print(f"hotswitch train: {e}", file=sys.stderr, flush=True)
        return 1
    for r in result["reconfigurations"]:
        print(f"change {r['generation']} ({r['reason']}): {r['source']} -> {r['destination']} workers after step "
              f"{r['step']}, state from {r['restored_from']}, {r['bytes_moved'] / 2**20:.2f} MiB moved in "
              f"{r['move_seconds']:.2f} s, training again after {r['seconds']:.1f} s"
              + (f", {r['replayed_steps']} steps replayed" if r["replayed_steps"] else ""), flush=True)
    print(f"{result['steps']} steps on workers {', '.join(result['workers'])} under {', '.join(result['configs'])}; "
          f"final loss {result['loss']:.4f}", flush=True)
    if opts.save_final:
        print(f"wrote {opts.save_final}", flush=True)
    print(f"total {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


def _elastic_worker(membership, opts: TrainOptions):
    """One elastic worker (also those spawned later): the same model, data and sample order everywhere."""
    import warnings

    import torch

    from distconfig import DistConfig
    from hotswitch import data as D
    from hotswitch.elastic import ElasticJob, Event

    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"hotswitch: .* could not be sharded")
    candidates = [DistConfig.parse(c) for c in ([opts.static] if opts.static else opts.configs)]
    vocab = _model(opts).get_input_embeddings().num_embeddings
    dataset = _dataset(opts, vocab)
    order = D.SampleOrder(len(dataset), opts.batch_size, seed=opts.seed)
    multiple = math.lcm(16, *[c.tp for c in candidates if c.sp])
    bounds = opts.buckets or D.choose_boundaries([len(s) for s in dataset], max(3, len(candidates)), multiple)

    def batch(step):
        ids = order.batch(step)
        return ids, [dataset[i] for i in ids]

    def on_step(report, replayed):
        print(report.line() + (" (replayed)" if replayed else ""), flush=True)

    options = dict(optimizer=dict(name="adamw", lr=opts.lr), memory_budget_bytes=opts.memory_budget, buckets=bounds,
                   micro_batch_tokens=opts.micro_batch_tokens)
    job = ElasticJob(membership, lambda: _model(opts), candidates, batch, trainer_options=options,
                     checkpoint_dir=opts.checkpoint_dir, checkpoint_every=opts.checkpoint_every,
                     step_timeout_s=opts.step_timeout, on_step=on_step, log=lambda m: print(m, flush=True))
    result = job.run(opts.steps, [Event(*e) for e in opts.events])
    if opts.save_final and job.trainer is not None:
        state = job.trainer.full_state_dict()  # every job worker takes part
        if result is not None:
            torch.save(state, opts.save_final)
    return result


def _train_worker(rank: int, opts: TrainOptions) -> dict:
    run = _Run(opts, [opts.static] if opts.static else list(opts.configs), rank)
    result = run.train()
    if opts.save_final:
        import torch

        state = run.trainer.full_state_dict()
        if rank == 0:
            torch.save(state, opts.save_final)
    return result


class _Run:
    """One Trainer on this rank over the dataset's seeded global batches."""

    def __init__(self, opts: TrainOptions, configs: list, rank: int, budget: float | None = None,
                 bounds: tuple[int, ...] | None = None):
        import warnings

        from hotswitch import data as D
        from hotswitch.trainer import Trainer

        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        warnings.filterwarnings("ignore", message=r"hotswitch: .* could not be sharded")  # replicated fallback, exact
        self.opts, self.show = opts, rank == 0 and not opts.quiet
        model = _model(opts)
        self.dataset = _dataset(opts, model.get_input_embeddings().num_embeddings)
        self.order = D.SampleOrder(len(self.dataset), opts.batch_size, seed=opts.seed)
        # a static run keeps the hot run's buckets: short rows are cheaper under any config
        self.trainer = Trainer(model, configs, dict(name="adamw", lr=opts.lr), budget or opts.memory_budget,
                               buckets=bounds or opts.buckets,
                               micro_batch_tokens=opts.micro_batch_tokens, zero1=opts.zero1,
                               progress=(lambda m: print(m, flush=True)) if self.show else None)
        if bounds is None and opts.buckets is None:
            self.trainer.choose_buckets([len(s) for s in self.dataset])  # from the dataset's length distribution
        self.bounds = self.trainer.bucket_bounds([len(s) for s in self.dataset])
        self.reports = []

    def train(self) -> dict:
        """Warm-up steps, then the measured ones, with a progress bar; returns `result()`."""
        from tqdm import tqdm

        total = self.opts.warmup_steps + self.opts.steps
        bar = tqdm(total=total, desc="training", unit="step", disable=not self.show or None, leave=False, file=sys.stderr)
        for step in range(total):
            self.step(step, write=tqdm.write)
            bar.update()
        bar.close()
        return self.result()

    def step(self, step: int, write=None) -> None:
        report = self.trainer.step([self.dataset[i] for i in self.order.batch(step)])
        warm = step < self.opts.warmup_steps
        if not warm:
            self.reports.append(report)
        if self.show:
            extra = f" (profile {report.profile_seconds:.1f}s, compile {report.compile_seconds:.1f}s)" \
                if report.profile_seconds + report.compile_seconds > 0.05 else ""
            (write or print)(report.line() + extra + (" [warm-up, not counted]" if warm else ""), file=sys.stdout)

    def result(self) -> dict:
        reports = self.reports
        seconds = sum(r.seconds for r in reports)
        switch = sum(r.switch_seconds for r in reports)
        summary = dict(steps=len(reports), tokens=sum(r.tokens for r in reports), seconds=seconds, switch_seconds=switch,
                       tokens_per_second=sum(r.tokens for r in reports) / seconds, switch_share=switch / seconds,
                       final_loss=reports[-1].loss, losses=[r.loss for r in reports])
        return dict(summary=summary, reports=[_report_dict(r) for r in reports], profile=self.trainer.cost.table(),
                    base=self.trainer.base, budget=self.trainer.memory_budget_bytes)


def _report_dict(report) -> dict:
    d = asdict(report)
    d.update(switch_seconds=report.switch_seconds, tokens_per_second=report.tokens_per_second)
    return d


# ------------------------------------------------------------------------------------ bench train
def add_bench_train(sub) -> None:
    q = sub.add_parser("train", help="tokens/s of hot-switched mixed-length training vs the best static config "
                       "that fits the same memory budget", description=run_bench_train.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _train_arguments(q)
    q.set_defaults(steps=4, configs="dp=4;tp=4,sp")
    q.add_argument("--budget-fraction", type=float, default=0.9, help="without --memory-budget-mib: the budget is "
                   "this fraction of pure DP's estimated peak at the longest bucket, so long rows do not fit pure DP")
    q.add_argument("--json", default="bench_train.json", help="where to write the results (default bench_train.json)")
    q.set_defaults(run=run_bench_train)


def run_bench_train(args) -> int:
    """Hot switching against every static config that fits the budget, on the same batches, in one run.

    In one set of processes: the hot-switching trainer profiles each config at each bucket length
    (buckets from the dataset's lengths); unless --memory-budget-mib is given, the budget is set so
    that pure DP cannot hold the longest bucket (--budget-fraction of its estimated peak there).
    After one warm-up step, hot switching trains --steps steps; then each static config that fits
    every bucket within the budget trains the same batches (warm-up step, then --steps). Prints
    tokens/s of each (step time: compilation and profiling excluded), the ratio hot / best static,
    and the share of the hot step time spent switching. Default configs: dp=W and tp=W,sp.
    """
    from hotswitch.launch import LaunchError, launch

    opts = _options(args, warmup_steps=1)
    print(f"hotswitch bench train: {opts.model} on {opts.world_size} CPU processes, configs "
          f"{', '.join(_name(c) for c in opts.configs)}, "
          f"{opts.steps} steps of {opts.batch_size} sequences (+1 warm-up) from {opts.dataset}", flush=True)
    t0 = time.perf_counter()
    try:
        out = launch(_bench_worker, opts.world_size, opts, args.budget_fraction)
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
              f"switching takes {100 * h['switch_share']:.1f}% of the hot step time")
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"wrote {args.json} (total {out['seconds']:.0f} s)")
    return 0


def _bench_worker(rank: int, opts: TrainOptions, budget_fraction: float) -> dict:
    import torch.distributed as dist

    say = (lambda m: print(m, flush=True)) if rank == 0 else (lambda m: None)
    hot = _Run(opts, list(opts.configs), rank)
    budget = opts.memory_budget
    if budget is None:
        hot.trainer.profile(hot.bounds)
        dp = max(hot.trainer.configs, key=lambda c: c.dp)
        peak = next(r["peak_bytes"] for r in hot.trainer.cost.table() if r["config"] == dp.name and r["length"] == hot.bounds[-1])
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
    statics = {c.name: _Run(opts, [c], rank, budget=budget, bounds=hot.bounds) for c in fitting}
    runs = {"hot switching": hot, **{f"static {n}": r for n, r in statics.items()}}
    # side by side: every run takes global batch k before any takes k + 1, so all see the same machine
    for step in range(opts.warmup_steps + opts.steps):
        for label, run in runs.items():
            if run.show:
                print(f"{label}: ", end="", flush=True)
            run.step(step)
            dist.barrier()
    result = dict(budget_bytes=budget, profile=table, hot=hot.result(),
                  static={n: r.result() for n, r in statics.items()})
    say(f"hot switching: {_summary_line(result['hot'])}")
    for n, r in result["static"].items():
        say(f"static {n}: {_summary_line(r)}")
    speeds = {n: r["summary"]["tokens_per_second"] for n, r in result["static"].items()}
    best = max(speeds, key=speeds.get) if speeds else None
    result.update(best_static=best, ratio=result["hot"]["summary"]["tokens_per_second"] / speeds[best] if best else None,
                  switch_share=result["hot"]["summary"]["switch_share"], options=asdict(opts))
    return result
