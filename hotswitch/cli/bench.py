"""`hotswitch bench switch|train|elastic|gpu|cp|step|memory`: the benchmarks' command lines (the measurements live in
`hotswitch.bench`)."""
from __future__ import annotations

import sys

from hotswitch.cli.common import (
    HelpFormatter,
    add_configs_argument,
    add_json_argument,
    add_train_arguments,
    parse_configs,
    plain,
)

__all__ = ["add_parser"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks: switch, train, elastic, gpu, cp, step, memory",
                              formatter_class=HelpFormatter,
                              description="Measure what hot switching costs and gains; 'hotswitch bench BENCH --help' "
                              "describes each.")
    sub = p.add_subparsers(title="benchmarks", metavar="BENCH")
    q = sub.add_parser(
        "switch",
        help="measure every ordered pair of configs: planner algorithms, DTensor redistribute, "
        "torch.distributed.checkpoint save + load",
        description=_docstring("hotswitch.bench.switch"),
        formatter_class=HelpFormatter,
    )
    q.add_argument("--world-size", type=int, default=4, help="processes to spawn")
    q.add_argument("--devices-per-node", type=int, default=2, help="processes per simulated node")
    q.add_argument("--model", default="gpt2-23m", help="built-in model (gpt2-23m has 23M parameters)")
    add_configs_argument(q, "dp4;dp2tp2;tp4;tp4sp;tp2pp2;dp2pp2, scaled to --world-size")
    q.add_argument("--repeats", type=int, default=5, help="timed runs per switch; the median is reported")
    q.add_argument(
        "--emulate-nodes",
        action="store_true",
        help="run each node's processes in its own network namespace, "
        "nodes joined by rate-limited links (needs root and iproute2), so inter-node bytes cost what they would",
    )
    q.add_argument("--inter-node-gbit", type=float, default=1.0, help="inter-node link rate in Gbit/s with "
                   "--emulate-nodes")
    q.add_argument("--no-compute", dest="compute", action="store_false", help="skip the switches measured after a "
                   "forward + backward (plain, and with the weights prefetched behind it)")
    add_json_argument(q, "bench_switch.json", "the results")
    q.add_argument("--plot", default="bench_switch.png", metavar="PATH", help="where to draw the chart")
    q.set_defaults(run=run_bench_switch)

    q = sub.add_parser("train", help="tokens/s of hot-switched mixed-length training vs the best static config "
                       "that fits the same memory budget", description=_docstring("hotswitch.bench.train"),
                       formatter_class=HelpFormatter)
    # below the longest rows (256 tokens for gpt-tiny): a long row is then a micro-batch of its own, which
    # pure DP cannot hold within the budget (attention is fused: memory grows with tokens, not T^2)
    add_train_arguments(q, micro_batch_tokens=128)
    q.set_defaults(steps=4)
    q.add_argument("--budget-fraction", type=float, default=0.9, help="without --memory-budget-mib: the budget is "
                   "this fraction of pure DP's estimated peak at the longest bucket, so long rows do not fit pure DP")
    add_json_argument(q, "bench_train.json", "the results")
    q.set_defaults(run=run_bench_train)

    q = sub.add_parser("elastic", help="a change of devices: hotswitch's planned move vs gathering on one rank vs "
                       "checkpoint + restart + load", description=_docstring("hotswitch.bench.elastic"),
                       formatter_class=HelpFormatter)
    q.add_argument("--model", default="gpt-small", help="built-in model")
    q.add_argument("--repeats", type=int, default=3, help="timed runs per method; the median is reported")
    add_json_argument(q, "bench_elastic.json", "the results")
    q.set_defaults(run=run_bench_elastic)

    q = sub.add_parser("gpu", help="one GPU: pack/unpack bandwidth vs copy, one rank's bf16 step of a ~1B Llama "
                       "(fake process group) vs Hugging Face eager, peak memory vs the estimate",
                       description=_docstring("hotswitch.bench.gpu"), formatter_class=HelpFormatter)
    add_configs_argument(q, "dp8;tp8;dp2tp4")
    q.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    q.add_argument("--micro-batch", type=int, default=1, help="sequences per data-parallel replica")
    q.add_argument("--layers", type=int, default=16, help="Llama layers (16: ~1.1B parameters)")
    q.add_argument("--repeats", type=int, default=10, help="timed runs per measurement; the median is reported")
    q.add_argument("--no-inductor", action="store_true", help="skip the ExecGraphs compiled by Inductor")
    q.add_argument("--dry-run", action="store_true", help="check the configuration and exit (no GPU needed)")
    add_json_argument(q, "bench_gpu.json", "the results")
    q.set_defaults(run=run_bench_gpu)

    q = sub.add_parser("memory", help="one rank of a 7B- and a 70B-shaped Llama compiled here on the meta device: "
                       "compile seconds, peak RSS, per-rank memory by kind per config (fsdp, recomputation, tp, cp, "
                       "pp), which fit the budget; measured steps of a small Llama against the estimate",
                       description=_docstring("hotswitch.bench.memory"), formatter_class=HelpFormatter)
    q.add_argument("--models", default="llama2-7b,llama3-70b", help="comma-separated: llama2-7b (one rank of 8), "
                   "llama3-70b (one rank of 64)")
    q.add_argument("--configs", default=None, metavar="CONFIGS", help="configs for every model, comma-separated "
                   "compact names of the model's job size (default: a dp/fsdp/tp/sp/cp/pp mix per model, with and "
                   "without recomputation)")
    q.add_argument("--lengths", default="4096,32768", help="tokens per row, comma-separated")
    q.add_argument("--budget-gib", type=float, default=80.0, help="memory per rank a config must fit")
    q.add_argument("--measure-layers", type=int, default=4, help="layers of the small Llama whose steps are "
                   "measured against the estimate (0: skip that part)")
    add_json_argument(q, "bench_memory.json", "the results")
    q.add_argument("--plot", default="bench_memory.png", metavar="PATH", help="where to draw the chart")
    q.set_defaults(run=run_bench_memory)

    q = sub.add_parser("cp", help="context parallelism on skewed packed batches: static zigzag CP vs "
                       "document-aware CP vs TP+SP, attention time and bytes exchanged",
                       description=_docstring("hotswitch.bench.cp"), formatter_class=HelpFormatter)
    q.add_argument("--world-size", type=int, default=4, help="processes to spawn (the cp and tp degree)")
    q.add_argument("--row-lengths", default="1024,2048,4096", help="tokens per packed row, one batch each")
    q.add_argument("--rows", default="1,4", help="packed rows per batch, one batch each")
    q.add_argument("--dim", type=int, default=256, help="model width")
    q.add_argument("--heads", type=int, default=8, help="attention heads")
    q.add_argument("--kv-heads", type=int, default=4, help="key/value heads (grouped-query attention when fewer)")
    q.add_argument("--balance", type=float, default=0.1, help="document CP keeps the busiest rank's attention work "
                   "within (1 + BALANCE) x the mean")
    q.add_argument("--repeats", type=int, default=3, help="timed steps per layout; the median is reported")
    q.add_argument("--seed", type=int, default=0, help="seed of the sequence lengths and the weights")
    add_json_argument(q, "bench_cp.json", "the results")
    q.add_argument("--plot", default="bench_cp.png", metavar="PATH", help="where to draw the chart")
    q.set_defaults(run=run_bench_cp)

    q = sub.add_parser("step", help="one training step: hotswitch (eager and Inductor) vs DDP and DTensor tensor "
                       "parallelism (eager and torch.compile), our GPT and an HF Llama",
                       description=_docstring("hotswitch.bench.step"), formatter_class=HelpFormatter)
    q.add_argument("--world-size", type=int, default=4, help="processes to spawn (the dp and tp degree)")
    q.add_argument("--models", default="gpt,llama", help="comma-separated: gpt (ours), llama (Hugging Face)")
    q.add_argument("--layers", type=int, default=2, help="transformer blocks")
    q.add_argument("--dim", type=int, default=256, help="model width")
    q.add_argument("--heads", type=int, default=8, help="attention heads (as many key/value heads)")
    q.add_argument("--rows", type=int, default=8, help="global batch rows")
    q.add_argument("--length", type=int, default=128, help="tokens per row")
    q.add_argument("--repeats", type=int, default=6, help="timed steps per method; the median is reported")
    q.add_argument("--warmup", type=int, default=1, help="untimed steps first (the first one compiles)")
    q.add_argument("--eager-only", action="store_true", help="skip Inductor and torch.compile (minutes of "
                   "compiling on a small CPU)")
    add_json_argument(q, "bench_step.json", "the results")
    q.add_argument("--plot", default="bench_step.png", metavar="PATH", help="where to draw the chart")
    q.set_defaults(run=run_bench_step)
    p.set_defaults(run=lambda args: p.print_help() or 2)


def _docstring(module: str) -> str:
    """A benchmark module's docstring, read from its source without importing it (that imports torch)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec(module)
    with open(spec.origin) as f:
        return plain(ast.get_docstring(ast.parse(f.read())) or "")


def run_bench_train(args) -> int:
    from hotswitch.bench import train as bench_train
    from hotswitch.cli.train import options

    return bench_train.run(options(args, warmup_steps=1), args.budget_fraction, args.json)


def run_bench_elastic(args) -> int:
    from hotswitch.bench import elastic as bench_elastic

    return bench_elastic.run(args.model, args.repeats, args.json)


def run_bench_cp(args) -> int:
    from hotswitch.bench import cp

    try:
        row_lengths, rows = (tuple(int(n) for n in text.split(",") if n.strip()) for text in (args.row_lengths,
                                                                                              args.rows))
    except ValueError:
        print(f"hotswitch bench cp: --row-lengths and --rows take integers separated by commas, got "
              f"{args.row_lengths!r} and {args.rows!r}", file=sys.stderr)
        return 2
    return cp.run(cp.CpBenchOptions(world_size=args.world_size, row_lengths=row_lengths, rows=rows, dim=args.dim,
                                    heads=args.heads, kv_heads=args.kv_heads, repeats=args.repeats, seed=args.seed,
                                    balance=args.balance, json_path=args.json, png_path=args.plot))


def run_bench_memory(args) -> int:
    from hotswitch.bench import memory

    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    unknown = [m for m in models if m not in memory.MODEL_SHAPES]
    try:
        lengths = tuple(int(n) for n in args.lengths.split(",") if n.strip())
    except ValueError:
        lengths = ()
    if unknown or not models or not lengths or min(lengths) < 1:
        print(f"hotswitch bench memory: --models takes {', '.join(memory.MODEL_SHAPES)} and --lengths positive "
              f"integers, comma-separated; got {args.models!r} and {args.lengths!r}", file=sys.stderr)
        return 2
    configs = None
    if args.configs:
        names = tuple(c.strip() for c in args.configs.split(",") if c.strip())
        configs = {m: names for m in models}
    options = memory.MemoryBenchOptions(models=models, configs=configs, lengths=lengths,
                                        budget_bytes=int(args.budget_gib * 2**30), measure_layers=args.measure_layers,
                                        json_path=args.json, png_path=args.plot)
    try:
        memory.run(options)
    except (ValueError, RuntimeError) as e:
        print(f"hotswitch bench memory: {e}", file=sys.stderr)
        return 1
    print(f"wrote {', '.join(p for p in (args.json, args.plot) if p)}")
    return 0


def run_bench_step(args) -> int:
    from hotswitch.bench import step

    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    return step.run(step.StepBenchOptions(world_size=args.world_size, models=models, layers=args.layers, dim=args.dim,
                                          heads=args.heads, rows=args.rows, length=args.length, repeats=args.repeats,
                                          warmup=max(1, args.warmup), compiled=not args.eager_only,
                                          json_path=args.json, png_path=args.plot))


def run_bench_gpu(args) -> int:
    from hotswitch.bench import gpu

    defaults = gpu.GpuBenchOptions()
    configs = tuple(c.strip() for c in args.configs.replace(";", ",").split(",") if c.strip()) if args.configs \
        else defaults.configs
    options = gpu.GpuBenchOptions(configs=configs, seq_len=args.seq_len, micro_batch=args.micro_batch,
                                  model=dict(defaults.model, num_hidden_layers=args.layers), repeats=args.repeats,
                                  inductor=not args.no_inductor, json_path=args.json)
    try:
        return gpu.run(options, dry_run=args.dry_run)
    except ValueError as e:
        print(f"hotswitch bench gpu: {e}", file=sys.stderr)
        return 2


def run_bench_switch(args) -> int:
    from hotswitch.bench import switch as bench_switch
    from hotswitch.distconfig import DistConfig
    from hotswitch.models import MODEL_CONFIGS

    if args.model not in MODEL_CONFIGS:
        print(f"unknown model {args.model!r}; built-in models: {', '.join(MODEL_CONFIGS)}", file=sys.stderr)
        return 2
    w = args.world_size
    configs = [c.spec() for c in parse_configs(args.configs, w, "bench switch")] if args.configs \
        else bench_switch.default_configs(w)
    names = [DistConfig.parse(c).name for c in configs]
    print(
        f"benchmarking switches of {args.model} between {', '.join(names)} on {w} processes, "
        f"{args.devices_per_node} per node ...",
        flush=True,
    )
    result = bench_switch.run(world_size=w, devices_per_node=args.devices_per_node, model=args.model, configs=configs,
                              repeats=args.repeats, json_path=args.json, png_path=args.plot,
                              emulate_nodes=args.emulate_nodes, inter_node_gbit=args.inter_node_gbit,
                              compute=args.compute)
    print(bench_switch.format_table(result))
    print(f"wrote {args.json} and {args.plot}")
    return 0

