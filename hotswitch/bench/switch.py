"""`hotswitch bench switch`: what every switch between configs costs, against baselines.

For every ordered pair of configs, on `world_size` gloo processes posing as nodes of
`devices_per_node`: each planner algorithm through the same executor (bytes moved, inter-node
bytes, max per-device send, lower bound, estimated and measured seconds, median of `repeats`),
and two outside baselines measured the same way: DTensor `redistribute` (pairs on one mesh) and a
torch.distributed.checkpoint save + load that reshards on load (to /dev/shm when it exists).

Between two pp = 1 configs a switch is also measured as a training step meets it, after one
forward + backward of the source config (`compute`): weights and accumulated gradients switched
plainly ("greedy+grads"), and with the weights prefetched while that forward + backward ran and
the gradients handed off bucket by bucket as its backward made them final ("greedy+grads
prefetched": its time is the exposed part, the wait for both and the unpacking; `overlapped_seconds`
is the weights' move behind the compute).

Pipeline configs (pp > 1) are among the defaults: a switch across pipeline degrees moves whole layers
between devices (their parameters live only on their stage's devices) through the same planner and
executor. DTensor cannot redistribute across meshes, so it has no row for pairs with a pp > 1 side;
DCP saves and loads each rank's own stage's parameters.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from hotswitch.bench.common import max_over_ranks
from hotswitch.distconfig import standard_configs
from hotswitch.progress import write_json

ALGORITHMS = ("greedy", "fcfs", "round_robin", "gather")


def default_configs(world_size: int) -> list[str]:
    """Pure DP, DP x TP, TP, TP + SP and, with pp = 2, the tensor- and data-parallel halves (where
    the world size allows): `distconfig.standard_configs(world_size, pipeline=True)`."""
    return [c.name for c in standard_configs(world_size, pipeline=True)]


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker(rank: int, model_name: str, config_specs, repeats: int, batch: int, seq: int,
           compute: bool = True) -> dict | None:
    import hotswitch as hs
    from hotswitch.distconfig import DistConfig
    from hotswitch.models import build_model

    configs = [DistConfig.parse(s) for s in config_specs]
    torch.manual_seed(0)
    model = build_model(model_name)
    ids = torch.randint(0, model.cfg.vocab_size, (batch, seq))
    t0 = time.perf_counter()
    cm = hs.compile(model, (ids, ids), configs=configs, lazy=True)
    setup = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    rows = []
    names = [c.name for c in configs]
    for a in names:
        for b in names:
            if a == b:
                continue

            def go(algorithm: str) -> float:
                cm.switch(a, algorithm="greedy")
                dist.barrier()
                t = time.perf_counter()
                cm.switch(b, algorithm=algorithm)
                return time.perf_counter() - t

            for algorithm in ALGORITHMS:  # warm-up: plans cached, buffers allocated once
                cm.switch(a)
                cm.switch(b, algorithm=algorithm)
            # the algorithms take turns, so whatever drifts during the run (the machine's load, the
            # allocator) reaches them alike: identical plans measured one after the other differed by 30%
            times: dict[str, list[float]] = {algorithm: [] for algorithm in ALGORITHMS}
            for _ in range(repeats):
                for algorithm in ALGORITHMS:
                    times[algorithm].append(max_over_ranks(go(algorithm)))
            for algorithm in ALGORITHMS:
                rows.append({"from": a, "to": b, "method": algorithm,
                             "measured_seconds": statistics.median(times[algorithm]),
                             **_plan_numbers(cm.plan_switch(a, b, algorithm=algorithm))})
            if compute and all(c.pp == 1 for c in configs if c.name in (a, b)):
                rows += _behind_compute(cm, a, b, (ids, ids), repeats)
            rows += _baselines(cm, a, b, repeats)
    if rank == 0:
        return {
            "model": model_name,
            "parameters": n_params,
            "world_size": dist.get_world_size(),
            "devices_per_node": cm.topology.devices_per_node,
            "setup_seconds": setup,
            "repeats": repeats,
            "rows": rows,
        }
    return None


def _behind_compute(cm, a: str, b: str, batch: tuple, repeats: int) -> list[dict]:
    """A step's switch from `a` to `b` after a forward + backward under `a`: plain, and with the
    weights prefetched during that forward + backward and the gradients handed off as its backward
    makes them final (exposed and overlapped seconds, slowest rank)."""
    out = []
    for prefetch in (False, True):
        exposed, overlapped, computing = [], [], []
        for i in range(repeats + 1):  # the first compiles a's ExecGraph and warms the plans up
            cm.switch(a)
            cm.zero_grad()
            local = cm.shard_inputs(*batch)
            dist.barrier()
            if prefetch:
                cm.prefetch(b)
                cm.hand_off_grads(b)
            t0 = time.perf_counter()
            cm.forward_backward(*local)
            t1 = time.perf_counter()
            stats = cm.switch(b)
            t2 = time.perf_counter()
            if i:
                computing.append(max_over_ranks(t1 - t0))
                exposed.append(max_over_ranks(t2 - t1))
                overlapped.append(max_over_ranks(stats.overlapped_seconds))
        cm.zero_grad()
        out.append({"from": a, "to": b, "method": "greedy+grads prefetched" if prefetch else "greedy+grads",
                    "measured_seconds": statistics.median(exposed),
                    "overlapped_seconds": statistics.median(overlapped),
                    "compute_seconds": statistics.median(computing)})
    return out


def _plan_numbers(plan) -> dict:
    s = plan.summary()
    return {k: s[k] for k in ("bytes_moved", "inter_node_bytes", "max_send_bytes", "lower_bound_bytes",
                              "estimated_seconds", "lower_bound_seconds", "planning_seconds")}


def _baselines(cm, a: str, b: str, repeats: int) -> list[dict]:
    import torch.distributed.checkpoint as dcp

    rows = []
    ca, cb = (next(c for c in cm.configs if c.name == n) for n in (a, b))
    mesh_a, mesh_b = cm.device_mesh(a), cm.device_mesh(b)
    same_mesh = ca.pp == cb.pp == 1 and mesh_a.mesh.shape == mesh_b.mesh.shape
    if same_mesh and torch.equal(mesh_a.mesh, mesh_b.mesh):
        cm.switch(a)
        src = cm.as_dtensors(cm.local_params, a, mesh=mesh_b)
        placements_b = cm.placements(b)

        def redistribute():
            for n, d in src.items():
                d.redistribute(mesh_b, placements_b[n]).to_local()

        rows.append(
            {"from": a, "to": b, "method": "dtensor_redistribute", "measured_seconds": _timed(redistribute, repeats)}
        )
    elif ca.pp == cb.pp == 1:
        # DTensor redistributes within one mesh only: across meshes a DTensor user gathers each
        # parameter on the source mesh (`full_tensor`) and keeps this rank's destination piece
        cm.switch(a)
        src = cm.as_dtensors(cm.local_params, a)
        rank = dist.get_rank()
        pieces = {n: tuple(slice(lo, hi) for lo, hi in layout.box(rank)) for n, layout in cm.layouts(b).items()}

        def gather_then_slice():
            for n, d in src.items():
                d.full_tensor()[pieces[n]].clone()

        rows.append(
            {"from": a, "to": b, "method": "dtensor_gather", "measured_seconds": _timed(gather_then_slice, repeats)}
        )
    cm.switch(a)
    src = cm.as_dtensors(cm.local_params)
    shapes_b = cm.local_shapes(b)
    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        tmp_list = [tmp]
        dist.broadcast_object_list(tmp_list, src=0)
        runs = iter(range(10**6))

        def save_and_load():
            path = os.path.join(tmp_list[0], f"{a}-{b}-{next(runs)}")  # a fresh checkpoint each time
            dcp.save(src, checkpoint_id=path)
            dst = cm.as_dtensors({n: torch.empty(shape) for n, shape in shapes_b.items()}, b)
            dcp.load(dst, checkpoint_id=path)

        rows.append({"from": a, "to": b, "method": "dcp_save_load", "measured_seconds": _timed(save_and_load, repeats)})
        dist.barrier()
    return rows


def summarize(result: dict) -> dict:
    """Per method, over the pairs it covers: the median switch and the summed time, each with
    greedy's over the method's on the same pairs (below 1: greedy is faster)."""
    by_method: dict[str, dict] = {}
    for r in result["rows"]:
        by_method.setdefault(r["method"], {})[(r["from"], r["to"])] = r["measured_seconds"]
    greedy = by_method["greedy"]
    out = {}
    for method, times in by_method.items():
        if method.startswith("greedy+grads"):  # compared with the plain switch of gradients below
            continue
        pairs = list(times)
        g = [greedy[p] for p in pairs]
        m = [times[p] for p in pairs]
        out[method] = {"pairs": len(pairs), "median_seconds": statistics.median(m), "total_seconds": sum(m),
                       "greedy_over_method_median": statistics.median(g) / statistics.median(m),
                       "greedy_over_method_total": sum(g) / sum(m)}
    return out


def format_table(result: dict) -> str:
    lines = [
        f"model {result['model']} ({result['parameters'] / 1e6:.1f}M parameters), {result['world_size']} processes, "
        f"{result['devices_per_node']} per node, median of {result['repeats']}; network {result.get('network', '?')}",
        f"{'from':>7} {'to':>7} {'method':>20} {'MB moved':>9} {'inter MB':>9} {'max send':>9} {'bound MB':>9} "
        f"{'est ms':>8} {'meas ms':>8} {'behind compute ms':>18}",
    ]
    mb = lambda x: f"{x / 1e6:9.2f}" if x is not None else f"{'-':>9}"  # noqa: E731
    for r in result["rows"]:
        est = f"{r['estimated_seconds'] * 1e3:8.2f}" if "estimated_seconds" in r else f"{'-':>8}"
        lines.append(
            f"{r['from']:>7} {r['to']:>7} {r['method']:>20} {mb(r.get('bytes_moved'))} {mb(r.get('inter_node_bytes'))} "
            f"{mb(r.get('max_send_bytes'))} {mb(r.get('lower_bound_bytes'))} {est} {r['measured_seconds'] * 1e3:8.2f}"
            + (f" {r['overlapped_seconds'] * 1e3:18.2f}" if "overlapped_seconds" in r else "")
        )
    lines.append("")
    lines.append("over the pairs each method covers, greedy / method (below 1: greedy is faster):")
    lines.append(f"  {'method':>20}  pairs  median switch ms  greedy/method (median)  summed ms  greedy/method (sum)")
    for method, s in summarize(result).items():
        lines.append(
            f"  {method:>20}  {s['pairs']:5d}  {s['median_seconds'] * 1e3:16.1f}"
            f"  {s['greedy_over_method_median']:22.2f}"
            f"  {s['total_seconds'] * 1e3:9.1f}  {s['greedy_over_method_total']:19.2f}"
        )
    plain = {(r["from"], r["to"]): r for r in result["rows"] if r["method"] == "greedy+grads"}
    behind = {(r["from"], r["to"]): r for r in result["rows"] if r["method"] == "greedy+grads prefetched"}
    if behind:
        ratio = statistics.median(behind[p]["measured_seconds"] / plain[p]["measured_seconds"] for p in behind)
        lines.append("")
        lines.append(f"a step's switch (weights + gradients) after a forward + backward, over {len(behind)} pairs: "
                     f"exposed with the weights prefetched and the gradients handed off / plain {ratio:.2f} (median); "
                     f"{sum(r['overlapped_seconds'] for r in behind.values()) * 1e3:.1f} ms moved behind compute "
                     f"in all, against {sum(r['measured_seconds'] for r in plain.values()) * 1e3:.1f} ms of plain "
                     "switches")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = sorted({(r["from"], r["to"]) for r in result["rows"]})
    methods = list(dict.fromkeys(r["method"] for r in result["rows"]))
    value = {(r["from"], r["to"], r["method"]): r["measured_seconds"] * 1e3 for r in result["rows"]}
    fig, ax = plt.subplots(figsize=(max(8, len(pairs) * 0.9), 4.5))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        xs = [j + i * width for j, p in enumerate(pairs) if (*p, m) in value]
        ys = [value[(*p, m)] for p in pairs if (*p, m) in value]
        ax.bar(xs, ys, width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(pairs))], [f"{a}\n→{b}" for a, b in pairs], fontsize=8)
    ax.set_ylabel("switch time, ms (median)")
    ax.set_title(f"hot switch of {result['model']} ({result['parameters'] / 1e6:.0f}M params), "
                 f"{result['world_size']} gloo processes, {result['devices_per_node']} per node\n"
                 f"network {result.get('network', '?')}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(world_size=4, devices_per_node=2, model="gpt2-23m", configs=None, repeats=5, batch=4, seq=64,
        json_path=None, png_path=None, emulate_nodes=False, inter_node_gbit=1.0, compute=True) -> dict:
    """With `emulate_nodes`, each node's ranks run in their own network namespace and inter-node
    traffic crosses links shaped to `inter_node_gbit` (hotswitch.netns); else all is loopback."""
    from hotswitch.distributed.launch import launch

    configs = default_configs(world_size) if configs is None else configs
    args = (worker, world_size, model, list(configs), repeats, batch, seq, compute)
    if emulate_nodes:
        from hotswitch.distributed.netns import EmulatedNodes

        # what the planner's estimates assume: the shaped link shared by a node's devices
        os.environ["HOTSWITCH_INTER_NODE_BW"] = str(inter_node_gbit * 1.25e8 / devices_per_node)
        with EmulatedNodes(world_size // devices_per_node, inter_node_gbit) as nodes:
            result = launch(*args, devices_per_node=devices_per_node, nodes=nodes, backend="gloo")
        result["network"] = (
            f"emulated: {world_size // devices_per_node} nodes, {inter_node_gbit:g} Gbit/s links between nodes"
        )
    else:
        from hotswitch.distributed.launch import patched_environ

        # what the plans should assume on loopback: the posed node link is as fast as the rest (so
        # no relay is planned that only the posed link would pay for)
        same = {"HOTSWITCH_INTER_NODE_BW": os.environ.get("HOTSWITCH_INTER_NODE_BW",
                                                          os.environ.get("HOTSWITCH_INTRA_NODE_BW", "100e9"))}
        with patched_environ(same):
            result = launch(*args, devices_per_node=devices_per_node, backend="gloo")
        result["network"] = "loopback: every byte costs the same, inter-node or not"
    write_json(json_path, result)
    if png_path:
        plot(result, png_path)
    return result
