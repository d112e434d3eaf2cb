"""The `hotswitch` command line. One function per subcommand: `add_<name>(subparsers)` registers its
parser and sets `run=<function taking the parsed args>`; list it in COMMANDS.

    hotswitch demo           train a small GPT on 4 CPU processes under dp4, dp2tp2 and tp4sp, switching between them
    hotswitch train          mixed-length training: a config per length bucket, hot-switched within each step
    hotswitch bench switch   what every switch between configs costs: planner algorithms and outside baselines
    hotswitch bench train    tokens/s of hot-switched training vs the best static config within a memory budget
    hotswitch plan           plan one switch of a large model on a simulated cluster (pure, no processes)
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass

from hotswitch.train_cli import add_bench_train, add_train

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hotswitch", description="Compile a model once for several parallel "
                                     "layouts (DistConfigs) and hot-switch between them while training.")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add in COMMANDS:
        add(subparsers)
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    return args.run(args) or 0


# ----------------------------------------------------------------------------------------- shared
_CONFIG_NAME = re.compile(r"(?:dp(\d+))?(?:tp(\d+))?(?:pp(\d+))?(sp)?")


def parse_config(name: str):
    """'dp2tp2' -> DistConfig('dp2tp2', dp=2, tp=2); 'tp4sp' -> tp=4, sp=True; 'tp2pp2' -> tp=2, pp=2."""
    import hotswitch as hs

    m = _CONFIG_NAME.fullmatch(name)
    if not name or not m:
        raise argparse.ArgumentTypeError(f"config {name!r} is not of the form dp<N>tp<M>pp<K>[sp] (degrees of 1 "
                                         "may be left out), e.g. dp4, dp2tp2, tp4sp, tp2pp2")
    return hs.DistConfig(name, dp=int(m[1] or 1), tp=int(m[2] or 1), pp=int(m[3] or 1), sp=bool(m[4]))


def default_configs(world_size: int) -> list[str]:
    """dp<W>, dp<W/2>tp2 (when W >= 4 is even), tp<W>sp."""
    names = [f"dp{world_size}"]
    if world_size >= 4 and world_size % 2 == 0:
        names.append(f"dp{world_size // 2}tp2")
    if world_size > 1:
        names.append(f"tp{world_size}sp")
    return names


def count_collectives(gm, phase: str | None = None) -> Counter:
    """Collective nodes of an ExecGraph by kind ('all_reduce', 'all_gather', 'reduce_scatter', ...)."""
    from compiler.lower import collectives

    kinds = Counter()
    for node in collectives(gm, phase):
        op = str(node.target).split(".")[1]  # "_c10d_functional.all_reduce.default" -> "all_reduce"
        kinds[op.removesuffix("_into_tensor").removesuffix("_tensor")] += 1
    return kinds


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


# ------------------------------------------------------------------------------------------- demo
LOSS_TOLERANCE = 1e-4  # |loss - single-device loss|: fp32 sums in another order differ by ~1e-6


@dataclass(frozen=True)
class DemoOptions:
    model: str
    layers: int | None
    configs: tuple[str, ...]
    steps: int
    batch: int
    seq: int
    lr: float
    seed: int


def add_demo(subparsers) -> None:
    p = subparsers.add_parser("demo", help="train a small GPT on CPU processes, hot-switching between DistConfigs",
                              description="Spawn --world-size CPU processes (gloo), compile one model for several "
                              "DistConfigs, train a few SGD steps under each on a fixed synthetic batch, switch "
                              "between them, and check the state and loss against a single-device run.")
    p.add_argument("--world-size", type=int, default=None,
                   help="processes to spawn (default 4; under torchrun: its WORLD_SIZE)")
    p.add_argument("--model", default="gpt-tiny", help="built-in model (hotswitch.models.MODEL_CONFIGS; default gpt-tiny)")
    p.add_argument("--layers", type=int, default=None, help="override the model's number of layers")
    p.add_argument("--configs", default=None, help="comma-separated DistConfig names like dp4,dp2tp2,tp4sp "
                   "(default: dp<W>, dp<W/2>tp2, tp<W>sp)")
    p.add_argument("--steps", type=int, default=3, help="SGD steps per config (default 3)")
    p.add_argument("--batch", type=int, default=8, help="global batch size (default 8)")
    p.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    p.add_argument("--lr", type=float, default=0.5, help="SGD learning rate (default 0.5)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run_demo)


def run_demo(args) -> int:
    from hotswitch.launch import LaunchError, launch
    from hotswitch.models import MODEL_CONFIGS

    if args.model not in MODEL_CONFIGS:
        raise SystemExit(f"hotswitch demo: unknown model {args.model!r}; choose from {', '.join(MODEL_CONFIGS)}")
    world_size = args.world_size or int(os.environ.get("WORLD_SIZE", 4))
    names = args.configs.split(",") if args.configs else default_configs(world_size)
    try:
        for name in names:
            parse_config(name).check_world_size(world_size)
    except (argparse.ArgumentTypeError, ValueError) as e:
        raise SystemExit(f"hotswitch demo: {e}")
    if args.steps < 1 or args.batch < 1 or args.seq < 2 or (args.layers is not None and args.layers < 1):
        raise SystemExit("hotswitch demo: need --steps >= 1, --batch >= 1, --seq >= 2 and --layers >= 1")
    opts = DemoOptions(args.model, args.layers, tuple(names), args.steps, args.batch, args.seq, args.lr, args.seed)
    model = args.model + (f" ({plural(args.layers, 'layer')})" if args.layers else "")
    rank0 = int(os.environ.get("RANK", "0")) == 0  # under torchrun every rank runs this
    say = progress if rank0 else (lambda message: None)
    say(f"hotswitch demo: {model} on {world_size} CPU processes (gloo), configs {', '.join(names)}; "
        f"{plural(args.steps, 'SGD step')} each, batch {args.batch} x seq {args.seq}, lr {args.lr}")
    t0 = time.perf_counter()
    try:
        result = launch(_demo_worker, world_size, opts)
    except LaunchError as e:  # the failing rank's traceback, without launch's own frames
        print(f"hotswitch demo: {e}", file=sys.stderr, flush=True)
        return 1
    if not rank0:
        return 0
    _print_demo(result, opts)
    progress(f"total {time.perf_counter() - t0:.1f} s")
    return 0 if result["ok"] else 1


def synthetic_batch(vocab_size: int, batch: int, seq: int, seed: int):
    """Fixed random token ids and their next-token labels (last position ignored: -100)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((batch, 1), -100)], dim=1)
    return ids, labels


def _demo_worker(rank: int, opts: DemoOptions) -> dict | None:
    import copy
    import warnings

    import torch
    import torch.distributed as dist

    import hotswitch as hs
    from hotswitch.models import build_model

    say = progress if rank == 0 else (lambda message: None)
    # torch.export's pytree pickling warns about its own deprecated LeafSpec on every rank: noise here.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    torch.manual_seed(opts.seed)
    model = build_model(opts.model, **({"n_layers": opts.layers} if opts.layers else {}))
    ids, labels = synthetic_batch(model.cfg.vocab_size, opts.batch, opts.seq, opts.seed + 1)
    configs = [parse_config(n) for n in opts.configs]
    total_steps = opts.steps * len(configs)

    ref_losses = []
    if rank == 0:  # the single-device trajectory the hot-switched run must follow
        say(f"single-device reference: {plural(total_steps, 'step')} ...")
        ref = copy.deepcopy(model)
        for _ in range(total_steps):
            loss = ref(ids, labels)
            ref.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in ref.parameters():
                    p -= opts.lr * p.grad
            ref_losses.append(loss.item())
        del ref

    n_params = sum(p.numel() for p in model.parameters())
    say(f"tracing {opts.model} ({n_params / 1e6:.2f}M parameters) and compiling {', '.join(opts.configs)} ...")
    t = time.perf_counter()
    cm = hs.compile(model, (ids, labels), configs=configs)
    compile_total = time.perf_counter() - t
    lowering = {c.name: cm.compile_seconds(c.name) for c in configs}
    for name, s in lowering.items():
        say(f"  compiled {name:<10} {s:6.2f} s")
    say(f"  trace + setup     {compile_total - sum(lowering.values()):6.2f} s  (total {compile_total:.2f} s)")

    rows: dict[str, list[dict]] = {}
    switches = []
    step = 0
    for i, config in enumerate(configs):
        if i > 0:
            switches.append(_timed_switch(cm, configs[i - 1].name, config.name))
            say(f"switched {switches[-1]['from']} -> {switches[-1]['to']} in {switches[-1]['seconds'] * 1e3:.1f} ms")
        say(f"training {config.name}: {plural(opts.steps, 'step')} ...")
        rows[config.name] = []
        for _ in range(opts.steps):
            dist.barrier()
            t = time.perf_counter()
            local = cm.shard_inputs(ids, labels)
            loss = cm.forward_backward(*local)
            grads = cm.local_grads
            with torch.no_grad():
                for name, p in cm.local_params.items():  # live shards of the active config
                    p -= opts.lr * grads[name]
            cm.zero_grad()
            seconds = time.perf_counter() - t
            rows[config.name].append({"step": step, "loss": loss.item(), "seconds": seconds,
                                      "ref": ref_losses[step] if ref_losses else None})
            step += 1
    if len(configs) > 1:  # close the cycle: back to the first config
        switches.append(_timed_switch(cm, configs[-1].name, configs[0].name))
        say(f"switched {switches[-1]['from']} -> {switches[-1]['to']} in {switches[-1]['seconds'] * 1e3:.1f} ms")

    collectives = {}
    for c in configs:
        gm = cm.exec_graph(c.name)
        collectives[c.name] = {phase: count_collectives(gm, phase) for phase in ("forward", "backward", "reduce")}
    if rank != 0:
        return None
    max_dw = max((s["max_dw"] for s in switches), default=0.0)
    max_dloss = max(abs(r["loss"] - r["ref"]) for rs in rows.values() for r in rs)
    finite = all(torch.isfinite(torch.tensor(r["loss"])) for rs in rows.values() for r in rs)
    return {"compile_total": compile_total, "lowering": lowering, "rows": rows, "switches": switches,
            "collectives": collectives, "max_dw": max_dw, "max_dloss": max_dloss,
            "state_preserved": max_dw == 0.0, "loss_matches": finite and max_dloss < LOSS_TOLERANCE,
            "ok": finite and max_dw == 0.0 and max_dloss < LOSS_TOLERANCE,
            "configs": {c.name: (c.dp, c.tp, c.sp) for c in configs}}


def _timed_switch(cm, old: str, new: str) -> dict:
    """Switch `old` -> `new` (all ranks), timed from a barrier to a barrier; compare full weights before/after."""
    import torch.distributed as dist

    before = cm.full_state_dict()
    dist.barrier()
    t = time.perf_counter()
    cm.switch(new)
    dist.barrier()
    seconds = time.perf_counter() - t
    after = cm.full_state_dict()
    max_dw = max(((after[k] - before[k]).abs().max().item() for k in before), default=0.0)
    if before.keys() != after.keys():
        max_dw = float("inf")
    return {"from": old, "to": new, "seconds": seconds, "max_dw": max_dw}


def _print_demo(result: dict, opts: DemoOptions) -> None:
    columns = ["step", "loss", "Δ vs 1-device", "step ms", "fwd coll.", "bwd coll.", "grad reduce"]
    for name, rows in result["rows"].items():
        dp, tp, sp = result["configs"][name]
        coll = result["collectives"][name]
        table = [[str(r["step"]), f"{r['loss']:.6f}", f"{abs(r['loss'] - r['ref']):.1e}", f"{r['seconds'] * 1e3:.1f}",
                  format_counts(coll["forward"]), format_counts(coll["backward"]), format_counts(coll["reduce"])]
                 for r in rows]
        render_table(f"{name}: dp={dp} tp={tp} sp={'on' if sp else 'off'}, compiled in "
                     f"{result['lowering'][name]:.2f} s", columns, table)
    print()
    for s in result["switches"]:
        print(f"switch {s['from']} -> {s['to']}: {s['seconds']:.4f} s (max |Δw| = {s['max_dw']:.1e})")
    yes = {True: "yes", False: "NO"}
    print(f"state preserved across switches: {yes[result['state_preserved']]} (max |Δw| = {result['max_dw']:.1e})")
    print(f"losses follow the single-device trajectory: {yes[result['loss_matches']]} "
          f"(max |Δloss| = {result['max_dloss']:.1e})", flush=True)


def add_bench(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks")
    sub = p.add_subparsers(title="benchmarks", metavar="BENCH")
    q = sub.add_parser("switch", help="measure every ordered pair of configs: planner algorithms, DTensor redistribute, "
                       "torch.distributed.checkpoint save + load", description=__import__("hotswitch.bench_switch",
                       fromlist=["x"]).__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("--world-size", type=int, default=4)
    q.add_argument("--devices-per-node", type=int, default=2, help="processes per simulated node (default 2)")
    q.add_argument("--model", default="gpt2-23m", help="built-in model (default gpt2-23m, 23M parameters)")
    q.add_argument("--configs", default=None, help="semicolon-separated DistConfig specs (default: "
                   "'dp=4;dp=2,tp=2;tp=4;tp=4,sp;dp=1,tp=2,pp=2;dp=2,pp=2' scaled to --world-size)")
    q.add_argument("--repeats", type=int, default=5, help="timed runs per switch; the median is reported")
    q.add_argument("--emulate-nodes", action="store_true", help="run each node's processes in its own network namespace, "
                   "nodes joined by rate-limited links (needs root and iproute2), so inter-node bytes cost what they would")
    q.add_argument("--inter-node-gbit", type=float, default=1.0, help="inter-node link rate with --emulate-nodes (default 1)")
    q.add_argument("--json", default="bench_switch.json", help="where to write the results (default bench_switch.json)")
    q.add_argument("--plot", default="bench_switch.png", help="where to draw the chart (default bench_switch.png)")
    q.set_defaults(run=run_bench_switch)
    add_bench_train(sub)
    from hotswitch.bench_elastic import add_bench_elastic

    add_bench_elastic(sub)
    p.set_defaults(run=lambda args: p.print_help() or 2)


def run_bench_switch(args) -> int:
    from hotswitch import bench_switch
    from hotswitch.models import MODEL_CONFIGS

    if args.model not in MODEL_CONFIGS:
        print(f"unknown model {args.model!r}; built-in models: {', '.join(MODEL_CONFIGS)}", file=sys.stderr)
        return 2
    w = args.world_size
    configs = args.configs.split(";") if args.configs else bench_switch.default_configs(w)
    print(f"benchmarking switches of {args.model} between {configs} on {w} processes, {args.devices_per_node} per node ...",
          flush=True)
    result = bench_switch.run(world_size=w, devices_per_node=args.devices_per_node, model=args.model, configs=configs,
                              repeats=args.repeats, json_path=args.json, png_path=args.plot,
                              emulate_nodes=args.emulate_nodes, inter_node_gbit=args.inter_node_gbit)
    print(bench_switch.format_table(result))
    print(f"wrote {args.json} and {args.plot}")
    return 0


def add_plan(subparsers) -> None:
    p = subparsers.add_parser("plan", help="plan one switch of a large model on a simulated GPU cluster "
                              "(no GPU needed)",
                              description="Plan the switch of a model's state (GPT-3 / LLaMA-2, described without "
                              "weights) from one DistConfig to another on --devices GPUs with every algorithm, and "
                              "price each plan with the cluster simulator (NVLink inside a node, one NIC per GPU "
                              "between nodes, per-message latency): bytes moved, inter-node bytes, busiest sender, "
                              "lower bound, simulated seconds and planning time.")
    p.add_argument("--model", default="gpt3-175b", help="model name (hotswitch.cluster.MODELS; default gpt3-175b)")
    p.add_argument("--devices", type=int, default=1024, help="GPUs in the job (default 1024)")
    p.add_argument("--devices-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--from", dest="src", default="dp=8,tp=8,pp=16", metavar="SPEC",
                   help="source DistConfig spec (default 'dp=8,tp=8,pp=16')")
    p.add_argument("--to", dest="dst", default="dp=16,tp=4,pp=16", metavar="SPEC",
                   help="destination DistConfig spec (default 'dp=16,tp=4,pp=16')")
    p.add_argument("--intra-bw", type=float, default=450.0, metavar="GBPS",
                   help="GB/s per GPU and direction inside a node (default 450, NVLink)")
    p.add_argument("--inter-bw", type=float, default=50.0, metavar="GBPS",
                   help="GB/s per GPU and direction between nodes (default 50, one 400 Gb/s NIC per GPU)")
    p.add_argument("--with-grads", action="store_true", help="also move fp32 gradients (4 B/param)")
    p.add_argument("--with-optimizer", action="store_true",
                   help="also move fp32 master weights and Adam moments (12 B/param)")
    p.add_argument("--json", action="store_true", help="print JSON (greedy plan at the top level) instead of a table")
    p.add_argument("--plot", default=None, metavar="PATH", help="draw each plan's bytes sent per device as a heatmap")
    p.set_defaults(run=run_plan)


def run_plan(args) -> int:
    import json
    import math

    from distconfig import DistConfig
    from hotswitch import cluster, simulate

    t0 = time.perf_counter()
    try:
        src, dst = DistConfig.parse(args.src), DistConfig.parse(args.dst)
        topology = simulate.gpu_cluster(args.devices, args.devices_per_node, args.intra_bw * 1e9, args.inter_bw * 1e9)
        spec = cluster.describe_model(args.model)
        moves = cluster.switch_moves(spec, src, dst, args.devices, with_grads=args.with_grads,
                                     with_optimizer=args.with_optimizer)
    except ValueError as e:
        raise SystemExit(f"hotswitch plan: {e}")
    build_seconds = time.perf_counter() - t0
    results = simulate.compare_algorithms(moves, topology)
    rows = {alg: simulate.report(plan, sim) for alg, (plan, sim) in results.items()}
    greedy = rows["greedy"]
    plan_seconds = build_seconds + greedy["planning_seconds"]  # configs -> layouts -> greedy plan
    state = "weights" + (" + grads" if args.with_grads else "") + (" + Adam" if args.with_optimizer else "")
    total = sum(m.itemsize * math.prod(m.shape) for m in moves)
    title = (f"{spec.name} {src.name} -> {dst.name}: {spec.num_params / 1e9:.1f}B params, {state} "
             f"{total / 1e9:,.0f} GB, on {args.devices} GPUs = {topology.num_nodes} nodes x {args.devices_per_node} "
             f"({args.intra_bw:g} GB/s NVLink, {args.inter_bw:g} GB/s NIC per GPU)")
    if args.plot:
        simulate.plot_send_volume({alg: plan for alg, (plan, _) in results.items()}, args.plot, title)
    if args.json:
        out = {"model": spec.name, "num_params": spec.num_params, "devices": args.devices,
               "devices_per_node": args.devices_per_node, "from": src.spec(), "to": dst.spec(),
               "intra_node_bandwidth": topology.intra_node_bandwidth,
               "inter_node_bandwidth": topology.inter_node_bandwidth, "state": state,
               "plan_seconds": plan_seconds, "build_seconds": build_seconds,
               **{k: greedy[k] for k in ("bytes_moved", "inter_node_bytes", "max_send_bytes", "lower_bound_bytes",
                                         "lower_bound_seconds", "estimated_seconds")},
               "algorithms": rows}
        print(json.dumps(out, indent=2))
        return 0
    gb = lambda b: f"{b / 1e9:,.1f}"  # noqa: E731
    columns = ["algorithm", "moved GB", "inter GB", "max send GB", "bound GB", "bound s", "simulated s", "x bound",
               "bottleneck", "plan s"]
    table = [[alg, gb(r["bytes_moved"]), gb(r["inter_node_bytes"]), gb(r["max_send_bytes"]), gb(r["lower_bound_bytes"]),
              f"{r['lower_bound_seconds']:.4f}", f"{r['estimated_seconds']:.4f}",
              "-" if r["bound_ratio"] is None else f"{r['bound_ratio']:.2f}",
              r["bottleneck"], f"{r['planning_seconds']:.3f}"] for alg, r in rows.items()]
    try:  # wider than render_table's default when piped: ten columns
        from rich.console import Console
        console = Console(width=None if sys.stdout.isatty() else 150)
    except ImportError:
        console = None
    print(title)  # on its own line: a table title would wrap at the table's width
    render_table("", columns, table, console)
    print(f"planned in {plan_seconds:.2f} s (model + layouts {build_seconds:.2f} s, greedy plan "
          f"{greedy['planning_seconds']:.2f} s); all algorithms + simulation {time.perf_counter() - t0:.2f} s")
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


COMMANDS = [add_demo, add_train, add_bench, add_plan]


if __name__ == "__main__":
    sys.exit(main())
