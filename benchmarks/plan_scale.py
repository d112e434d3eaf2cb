"""Switch planning at scale: GPT-3 175B, LLaMA-2 70B and GPT-3 13B over 1024 simulated GPUs.

    python benchmarks/plan_scale.py [--json plan_scale.json] [--devices-per-node 8] [--intra-bw 450] [--inter-bw 50]

For every pair of DistConfigs below (tp, dp and pp changes, both directions) the model's bf16 weights
are planned with each algorithm (greedy, fcfs, round_robin, gather) and every plan is priced by
`hotswitch.simulate` (NVLink inside a node, one NIC per GPU between nodes, per-message latency).
Prints a markdown table: simulated seconds per algorithm and its ratio to the plan's lower bound,
and the time to plan ("greedy plan s": model description + layouts + greedy plan; "slowest alg. s":
the slowest algorithm's plan_switch alone).
A second table prices reconfigurations comparable to Tenplex's published figures (full training
state: bf16 weights + fp32 gradients + fp32 master weights and Adam moments, 18 B/param).
Needs no GPU and no process group.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hotswitch.distconfig import DistConfig  # noqa: E402
from hotswitch.switch.cluster import switch_moves  # noqa: E402
from hotswitch.switch.planner import ALGORITHMS  # noqa: E402
from hotswitch.switch.simulate import compare_algorithms, gpu_cluster, report  # noqa: E402

DEVICES = 1024
PAIRS = [  # (model, from, to) at 1024 GPUs
    ("gpt3-175b", "dp=8,tp=8,pp=16", "dp=16,tp=4,pp=16"),
    ("gpt3-175b", "dp=16,tp=4,pp=16", "dp=8,tp=8,pp=16"),
    ("gpt3-175b", "dp=8,tp=8,pp=16", "dp=4,tp=16,pp=16"),
    ("gpt3-175b", "dp=4,tp=16,pp=16", "dp=8,tp=8,pp=16"),
    ("gpt3-175b", "dp=8,tp=8,pp=16", "dp=4,tp=8,pp=32"),
    ("gpt3-175b", "dp=4,tp=8,pp=32", "dp=8,tp=8,pp=16"),
    ("gpt3-175b", "dp=8,tp=8,pp=16", "dp=16,tp=8,pp=8"),
    ("gpt3-175b", "dp=16,tp=8,pp=8", "dp=8,tp=8,pp=16"),
    ("gpt3-175b", "dp=8,tp=8,pp=16", "dp=32,tp=4,pp=8"),
    ("gpt3-175b", "dp=32,tp=4,pp=8", "dp=8,tp=8,pp=16"),
    ("llama2-70b", "dp=16,tp=8,pp=8", "dp=32,tp=4,pp=8"),
    ("llama2-70b", "dp=32,tp=4,pp=8", "dp=16,tp=8,pp=8"),
    ("llama2-70b", "dp=16,tp=8,pp=8", "dp=8,tp=16,pp=8"),
    ("llama2-70b", "dp=8,tp=16,pp=8", "dp=16,tp=8,pp=8"),
    ("llama2-70b", "dp=16,tp=8,pp=8", "dp=8,tp=8,pp=16"),
    ("llama2-70b", "dp=8,tp=8,pp=16", "dp=16,tp=8,pp=8"),
    ("llama2-70b", "dp=16,tp=8,pp=8", "dp=64,tp=4,pp=4"),
    ("llama2-70b", "dp=64,tp=4,pp=4", "dp=16,tp=8,pp=8"),
    ("gpt3-13b", "dp=128,tp=8", "dp=1024"),
    ("gpt3-13b", "dp=1024", "dp=128,tp=8"),
    ("gpt3-13b", "dp=64,tp=8,pp=2", "dp=128,tp=4,pp=2"),
    ("gpt3-13b", "dp=128,tp=4,pp=2", "dp=64,tp=8,pp=2"),
    ("gpt3-13b", "dp=64,tp=4,pp=4", "dp=128,tp=4,pp=2"),
    ("gpt3-13b", "dp=128,tp=4,pp=2", "dp=64,tp=4,pp=4"),
]


def _config(spec: str, devices: tuple[int, ...] | None = None) -> DistConfig:
    c = DistConfig.parse(spec)
    return c if devices is None else DistConfig(c.name, c.dp, c.tp, c.pp, c.sp, devices)


# (label, model, from, from devices, to, to devices, job devices): the setups Tenplex reports (DESIGN.md 5)
TENPLEX = [
    ("GPT-3 XL 8 -> 16 GPUs (Tenplex 87.2 s)", "gpt3-xl", "dp=8", tuple(range(8)), "dp=16", None, 16),
    ("GPT-3 XL 16 -> 8 GPUs (Tenplex 70.2 s)", "gpt3-xl", "dp=16", None, "dp=8", tuple(range(8)), 16),
    ("GPT-3 6.7B tp 4 -> 8, 16 GPUs (Tenplex 20.2 s)", "gpt3-6.7b", "dp=4,tp=4", None, "dp=2,tp=8", None, 16),
    ("GPT-3 6.7B tp 8 -> 4, 16 GPUs", "gpt3-6.7b", "dp=2,tp=8", None, "dp=4,tp=4", None, 16),
]


def measure(model: str, src: DistConfig, dst: DistConfig, devices: int, topology, **state) -> dict:
    t = time.perf_counter()
    moves = switch_moves(model, src, dst, devices, **state)
    build = time.perf_counter() - t
    results = compare_algorithms(moves, topology)
    rows = {alg: report(plan, sim) for alg, (plan, sim) in results.items()}
    return {"model": model, "from": src.name, "to": dst.name, "devices": devices,
            "state_bytes": sum(m.itemsize * math.prod(m.shape) for m in moves),
            "build_seconds": build, "plan_seconds": build + rows["greedy"]["planning_seconds"],
            "max_algorithm_plan_seconds": max(r["planning_seconds"] for r in rows.values()), "algorithms": rows}


def markdown(results: list[dict]) -> str:
    head = ["model", "from -> to", "moved GB", "bound s"] + [f"{a} s (x bound)" for a in ALGORITHMS] + [
        "greedy plan s", "slowest alg. s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        g = r["algorithms"]["greedy"]
        cells = [r["model"], f"{r['from']} -> {r['to']}", f"{g['bytes_moved'] / 1e9:,.0f}",
                 f"{g['lower_bound_seconds']:.4f}"]
        for a in ALGORITHMS:
            x = r["algorithms"][a]
            ratio = "bound 0" if x["bound_ratio"] is None else f"{x['bound_ratio']:.2f}"
            cells.append(f"{x['estimated_seconds']:.4f} ({ratio})")
        cells += [f"{r['plan_seconds']:.2f}", f"{r['max_algorithm_plan_seconds']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tenplex_markdown(results: list[dict]) -> str:
    lines = ["| setup (published) | state GB | moved GB (greedy) | greedy s | fcfs s | gather s | bound s |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        a = r["algorithms"]
        lines.append(f"| {r['label']} | {r['state_bytes'] / 1e9:.1f} | {a['greedy']['bytes_moved'] / 1e9:.1f} | "
                     f"{a['greedy']['estimated_seconds']:.3f} | {a['fcfs']['estimated_seconds']:.3f} | "
                     f"{a['gather']['estimated_seconds']:.3f} | {a['greedy']['lower_bound_seconds']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default="plan_scale.json", help="where to write the results (default plan_scale.json)")
    p.add_argument("--devices-per-node", type=int, default=8)
    p.add_argument("--intra-bw", type=float, default=450.0, help="GB/s per GPU inside a node (default 450)")
    p.add_argument("--inter-bw", type=float, default=50.0, help="GB/s per GPU between nodes (default 50)")
    args = p.parse_args(argv)

    topology = gpu_cluster(DEVICES, args.devices_per_node, args.intra_bw * 1e9, args.inter_bw * 1e9)
    results = []
    for model, a, b in PAIRS:
        r = measure(model, _config(a), _config(b), DEVICES, topology)
        results.append(r)
        print(f"{model} {r['from']} -> {r['to']}: greedy {r['algorithms']['greedy']['estimated_seconds']:.4f} s, "
              f"planned in {r['plan_seconds']:.2f} s", file=sys.stderr, flush=True)
    tenplex = []
    for label, model, a, a_dev, b, b_dev, n in TENPLEX:
        topo = gpu_cluster(n, args.devices_per_node, args.intra_bw * 1e9, args.inter_bw * 1e9)
        r = measure(model, _config(a, a_dev), _config(b, b_dev), n, topo, with_grads=True, with_optimizer=True)
        r["label"] = label
        tenplex.append(r)
    print(f"## Switch plans at {DEVICES} GPUs ({DEVICES // args.devices_per_node} nodes x {args.devices_per_node}, "
          f"{args.intra_bw:g} GB/s NVLink, {args.inter_bw:g} GB/s NIC per GPU), bf16 weights\n")
    print(markdown(results))
    print("\n## Reconfigurations of the full training state (18 B/param), next to Tenplex's measured times\n")
    print(tenplex_markdown(tenplex))
    worst = max(r["plan_seconds"] for r in results)
    print(f"\nslowest greedy planning (model + layouts + plan): {worst:.2f} s; "
          f"slowest of any algorithm: {max(r['max_algorithm_plan_seconds'] for r in results):.2f} s")
    meta = {"devices": DEVICES, "devices_per_node": args.devices_per_node, "intra_bw_GBps": args.intra_bw,
            "inter_bw_GBps": args.inter_bw, "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count()}
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "pairs": results, "tenplex": tenplex}, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
