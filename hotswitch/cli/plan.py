"""`hotswitch plan`: one switch of a large model on a simulated GPU cluster (pure planning: no
processes, no GPU)."""
from __future__ import annotations

import sys
import time

from hotswitch.cli.common import HelpFormatter, add_json_argument, render_table, write_json

__all__ = ["add_parser"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="plan one switch of a large model on a simulated GPU cluster "
                              "(no GPU needed)", formatter_class=HelpFormatter,
                              description="Plan the switch of a model's state (GPT-3 / LLaMA-2, described without "
                              "weights) from one DistConfig to another on --devices GPUs with every algorithm, and "
                              "price each plan with the cluster simulator (NVLink inside a node, one NIC per GPU "
                              "between nodes, per-message latency): bytes moved, inter-node bytes, busiest sender, "
                              "lower bound, simulated seconds and planning time.")
    p.add_argument("--model", default="gpt3-175b", help="model name (hotswitch.switch.cluster.MODELS)")
    p.add_argument("--devices", type=int, default=1024, help="GPUs in the simulated job")
    p.add_argument("--devices-per-node", type=int, default=8, help="GPUs per node")
    p.add_argument("--from", dest="src", default="dp=8,tp=8,pp=16", metavar="CONFIG",
                   help="source DistConfig ('dp8tp8pp16' or 'dp=8,tp=8,pp=16')")
    p.add_argument("--to", dest="dst", default="dp=16,tp=4,pp=16", metavar="CONFIG", help="destination DistConfig")
    p.add_argument("--intra-bw", type=float, default=450.0, metavar="GBPS",
                   help="GB/s per GPU and direction inside a node (NVLink)")
    p.add_argument("--inter-bw", type=float, default=50.0, metavar="GBPS",
                   help="GB/s per GPU and direction between nodes (one 400 Gb/s NIC per GPU)")
    p.add_argument("--with-grads", action="store_true", help="also move fp32 gradients (4 B/param)")
    p.add_argument("--with-optimizer", action="store_true",
                   help="also move fp32 master weights and Adam moments (12 B/param)")
    add_json_argument(p, None, "every algorithm's plan (greedy's at the top level; no table)")
    p.add_argument("--plot", default=None, metavar="PATH", help="draw each plan's bytes sent per device as a heatmap")
    p.set_defaults(run=run_plan)


def run_plan(args) -> int:
    import math

    from hotswitch.distconfig import DistConfig
    from hotswitch.switch import cluster, simulate

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
        write_json(args.json, out)
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

