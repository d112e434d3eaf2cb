"""`hotswitch train`: the mixed-length Trainer on spawned CPU processes.

    hotswitch train --model gpt-tiny --world-size 4 --dataset synthetic-skewed --steps 5
    hotswitch train ... --static dp=2,tp=2          # the same data under one config, for comparison
    hotswitch train --elastic 2:4 --scale 3:2       # workers may die (SIGKILL) or come and go; see below

With --elastic MIN:MAX the workers run under hotswitch's agent (`hotswitch.elastic.membership`): a worker
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

import math
import os
import sys
import time

from hotswitch.cli.common import (
    HelpFormatter,
    add_json_argument,
    add_train_arguments,
    parse_configs,
    plain,
    processes,
    write_json,
)

__all__ = ["add_parser", "options"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="mixed-length training with hot switching on CPU processes",
                              description=plain(__doc__), formatter_class=HelpFormatter)
    add_train_arguments(p)
    add_json_argument(p, None, "rank 0's result (per-step reports and the summary)")
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
    e.add_argument("--checkpoint-every", type=int, default=2, metavar="N", help="checkpoint every N steps")
    e.add_argument("--step-timeout", type=float, default=30.0, metavar="SECONDS", help="seconds a collective may wait "
                   "for a peer inside a step before the peer counts as gone; a worker whose heartbeat stops this long "
                   "(hung, stopped) is killed and counts as failed")
    e.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="several hosts: run the same command on "
                   "each, this host's agent joins the others through torch's rendezvous at HOST:PORT (serve it with "
                   "'hotswitch rendezvous --port PORT'); without it, every worker runs on this host")
    e.add_argument("--nproc-per-node", type=int, default=None, metavar="N", help="workers on this host (with "
                   "--rdzv-endpoint; the job starts once ceil(--world-size / N) hosts joined)")
    e.add_argument("--rdzv-id", default="hotswitch", metavar="ID", help="the job's id at the rendezvous")
    e.add_argument("--rdzv-backend", default="c10d", help="torch's rendezvous backend: c10d, or one whose store was "
                   "registered with hotswitch.elastic.register_rendezvous_store")
    p.set_defaults(run=run_train)


def options(args, **extra):
    from hotswitch.distconfig import DistConfig, standard_configs
    from hotswitch.models import MODEL_CONFIGS
    from hotswitch.train.loop import HF_MODELS, TrainOptions

    if args.model not in MODEL_CONFIGS and args.model not in HF_MODELS:
        raise SystemExit(
            f"hotswitch: unknown model {args.model!r}; choose from {', '.join([*MODEL_CONFIGS, *HF_MODELS])}"
        )
    if args.steps < 1 or args.batch_size < 1 or args.world_size < 1:
        raise SystemExit("hotswitch: need --steps >= 1, --batch-size >= 1 and --world-size >= 1")
    if args.configs:
        configs = parse_configs(args.configs, args.world_size, "train")
    else:  # HotSPa's two ends: pure DP for short rows, TP+SP for long ones
        configs = [c for c in standard_configs(args.world_size) if c.tp == 1 or c.sp and c.dp == 1]
    try:
        static = getattr(args, "static", None)
        if static:
            static = DistConfig.parse(static).spec()
            DistConfig.parse(static).check_world_size(args.world_size)
        buckets = tuple(int(b) for b in args.buckets.split(",")) if args.buckets else None
    except ValueError as e:
        raise SystemExit(f"hotswitch: {e}")
    if args.dataset != "synthetic-skewed" and not os.path.isfile(args.dataset):
        raise SystemExit(f"hotswitch: dataset {args.dataset!r} is neither 'synthetic-skewed' nor a JSONL file")
    max_length = args.seq_len or (MODEL_CONFIGS[args.model].max_seq_len if args.model in MODEL_CONFIGS else 256)
    budget = args.memory_budget_mib * 2**20 if args.memory_budget_mib else None
    extra.update(_elastic_options(args))
    extra.setdefault("backend", getattr(args, "backend", None))
    extra.setdefault("prefetch", getattr(args, "prefetch", True))
    extra.setdefault("cp_layout", getattr(args, "cp_layout", "contiguous"))
    extra.setdefault("compile_backend", getattr(args, "compile_backend", "eager"))
    mib = getattr(args, "grad_bucket_mib", None)
    if mib is not None and not mib > 0:
        raise SystemExit(f"hotswitch: --grad-bucket-mib must be positive, got {mib}")
    extra.setdefault("grad_bucket_bytes", None if mib is None else max(1, round(mib * 2**20)))
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
        raise SystemExit(
            f"hotswitch: --elastic {elastic} must satisfy 1 <= MIN <= --world-size ({args.world_size}) <= MAX"
        )
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
    rendezvous = None
    if getattr(args, "rdzv_endpoint", None):
        if args.checkpoint_dir is None:
            raise SystemExit("hotswitch: --rdzv-endpoint needs --checkpoint-dir, a directory every host reads and "
                             "writes (a shared filesystem): a lost host's slices are restored from it")
        from hotswitch.elastic.membership import Rendezvous

        try:
            rendezvous = Rendezvous(args.rdzv_endpoint, args.rdzv_id, args.nproc_per_node or args.world_size,
                                    args.rdzv_backend)
        except ValueError as e:
            raise SystemExit(f"hotswitch: {e}") from None
    elif getattr(args, "nproc_per_node", None):
        raise SystemExit("hotswitch: --nproc-per-node needs --rdzv-endpoint (several hosts); on one host use "
                         "--world-size")
    return dict(elastic=(low, high), events=tuple(sorted(events)), checkpoint_dir=directory,
                checkpoint_every=args.checkpoint_every, step_timeout=args.step_timeout, rendezvous=rendezvous)


def run_train(args) -> int:
    from hotswitch.distributed.launch import LaunchError, launch
    from hotswitch.train.loop import summary_line

    opts = options(args)
    if opts.elastic is not None:
        return _run_elastic_train(opts, getattr(args, "json", None))
    what = f"static {_name(opts.static)}" if opts.static else "configs " + ", ".join(_name(c) for c in opts.configs)
    if opts.memory_budget:
        what += f", memory budget {opts.memory_budget / 2**20:g} MiB per rank"
    print(f"hotswitch train: {opts.model} on {processes(opts.world_size, opts.backend)}, {what}; {opts.steps} steps of "
          f"{opts.batch_size} sequences from {opts.dataset}", flush=True)
    t0 = time.perf_counter()
    try:
        result = launch(_train_worker, opts.world_size, opts, backend=opts.backend)
    except LaunchError as e:
        print(f"hotswitch train: {e}", file=sys.stderr, flush=True)
        return 1
    print(summary_line(result), flush=True)
    write_json(getattr(args, "json", None), result)
    if opts.save_final:
        print(f"wrote {opts.save_final}", flush=True)
    print(f"total {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


def _name(spec: str) -> str:
    from hotswitch.distconfig import DistConfig

    return DistConfig.parse(spec).name


def _run_elastic_train(opts, json_path: str | None = None) -> int:
    from hotswitch.distributed.launch import patched_environ
    from hotswitch.elastic.membership import ElasticError, run_elastic

    low, high = opts.elastic
    rendezvous = opts.rendezvous
    configs = [opts.static] if opts.static else list(opts.configs)
    where = processes(opts.world_size, opts.backend, "worker processes")
    if rendezvous is not None:
        where = (f"{rendezvous.nproc_per_node} worker processes on this host, starting with {opts.world_size} across "
                 f"hosts (rendezvous {rendezvous.run_id!r} at {rendezvous.endpoint})")
    print(f"hotswitch train --elastic {low}:{high}: {opts.model} on {where}, "
          f"candidate configs {', '.join(_name(c) for c in configs)}; {opts.steps} steps of {opts.batch_size} "
          f"sequences from {opts.dataset}; checkpoints every {opts.checkpoint_every} steps in {opts.checkpoint_dir}",
          flush=True)
    for step, kind, n in opts.events:
        print(f"  planned: {kind}{'' if n is None else ' to ' + str(n) + ' workers'} before step {step}", flush=True)
    t0 = time.perf_counter()
    try:
        with patched_environ({"HOTSWITCH_BACKEND": opts.backend} if opts.backend else {}):
            result = run_elastic(_elastic_worker, opts.world_size, opts, min_size=low, max_size=high,
                                 log=lambda m: print(m, flush=True), heartbeat_timeout_s=opts.step_timeout,
                                 rendezvous=rendezvous)
    except ElasticError as e:
        print(f"hotswitch train: {e}", file=sys.stderr, flush=True)
        return 1
    if result is None:  # several hosts: the job's rank 0 ran on another one
        print(f"the job finished; its summary is on the host of its rank 0 ({time.perf_counter() - t0:.1f} s)",
              flush=True)
        return 0
    for r in result["reconfigurations"]:
        print(f"change {r['generation']} ({r['reason']}): {r['source']} -> {r['destination']} workers after step "
              f"{r['step']}, state from {r['restored_from']}, {r['bytes_moved'] / 2**20:.2f} MiB moved in "
              f"{r['move_seconds']:.2f} s, training again after {r['seconds']:.1f} s"
              + (f", {r['replayed_steps']} steps replayed" if r["replayed_steps"] else ""), flush=True)
    print(f"{result['steps']} steps on workers {', '.join(result['workers'])} under {', '.join(result['configs'])}; "
          f"final loss {result['loss']:.4f}", flush=True)
    write_json(json_path, result)
    if opts.save_final:
        print(f"wrote {opts.save_final}", flush=True)
    print(f"total {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


def _elastic_worker(membership, opts):
    """One elastic worker (also those spawned later): the same model, data and sample order everywhere."""
    import warnings

    import torch

    from hotswitch.distconfig import DistConfig
    from hotswitch.elastic import ElasticJob, Event
    from hotswitch.train import data as D
    from hotswitch.train.loop import build_model, load_dataset, trainer_options

    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"hotswitch: .* could not be sharded")
    candidates = [DistConfig.parse(c) for c in ([opts.static] if opts.static else opts.configs)]
    vocab = build_model(opts).get_input_embeddings().num_embeddings
    dataset = load_dataset(opts, vocab)
    order = D.SampleOrder(len(dataset), opts.batch_size, seed=opts.seed)
    multiple = math.lcm(16, *(c.sequence_shards for c in candidates))
    bounds = opts.buckets or D.choose_boundaries([len(s) for s in dataset], max(3, len(candidates)), multiple)

    def batch(step):
        ids = order.batch(step)
        return ids, [dataset[i] for i in ids]

    def on_step(report, replayed):
        print(report.line() + (" (replayed)" if replayed else ""), flush=True)

    options = trainer_options(opts, opts.memory_budget, bounds)
    job = ElasticJob(membership, lambda: build_model(opts), candidates, batch, trainer_options=options,
                     checkpoint_dir=opts.checkpoint_dir, checkpoint_every=opts.checkpoint_every,
                     step_timeout_s=opts.step_timeout, on_step=on_step, log=lambda m: print(m, flush=True))
    result = job.run(opts.steps, [Event(*e) for e in opts.events])
    if opts.save_final and job.trainer is not None:
        state = job.trainer.full_state_dict()  # every job worker takes part
        if result is not None:
            torch.save(state, opts.save_final)
    return result


def _train_worker(rank: int, opts) -> dict:
    from hotswitch.train.loop import TrainingRun

    run = TrainingRun(opts, [opts.static] if opts.static else list(opts.configs), rank)
    result = run.train()
    if opts.save_final:
        import torch

        state = run.trainer.full_state_dict()
        if rank == 0:
            torch.save(state, opts.save_final)
    return result

