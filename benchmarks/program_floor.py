"""What a lowering costs per layer, against what the flat ExecGraph alone costs per layer.

    python benchmarks/program_floor.py [--layers 2,8,32] [--configs dp2tp2,tp4sp] [--world-size 4]

The target: a lowering at 8 layers within 1.5x the one at 2. This prints, per config and depth,
in one process (rank 0 of a fake process group of `--world-size`, the compile cache off):

- **cold**: the config's first lowering in a fresh process (what `benchmarks/compile_time.py` times
  per rank), and the depth ratio against the first depth;
- **warm process**: the same lowering in a process that has lowered the smaller depths first
  (DTensor's strategy caches, the meta-kernel memo and the traced redistributions warm): how much
  of a cold lowering is the process warming up rather than this model's work;
- **floor**: what the finished program itself costs to make, with no sharding work at all: a copy of
  its fx graph (node creation), its Python code written and compiled (a GraphModule of the copy), and
  its encoding for the compile cache (`dumps_program`). Any flat ExecGraph of this many nodes pays it.

The per-layer columns are the growth from the first depth over the added layers: when the floor is
most of the per-layer cost, a faster search or cache lowers the fixed part only, and the depth ratio
rises.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _floor(gm, repeat: int = 3) -> float:
    """The fastest of `repeat` makings of `gm` with no sharding work (the garbage collector paused)."""
    import torch.fx as fx

    from hotswitch.compiler.garbage import collector_paused
    from hotswitch.compiler.logic_io import dumps_program

    groups = sorted({n.args[-1] for n in gm.graph.nodes
                     if str(n.target).startswith("_c10d_functional.") and n.args and isinstance(n.args[-1], str)})
    best = float("inf")
    for _ in range(repeat):
        with collector_paused():
            started = time.perf_counter()
            graph = fx.Graph()
            graph.graph_copy(gm.graph, {})
            fx.GraphModule(gm, graph)  # the code written and compiled
            encoded = dumps_program(gm, {name: i for i, name in enumerate(groups)})
            best = min(best, time.perf_counter() - started)
    assert encoded is not None, "a collective named a group the floor did not list: its encoding was not timed"
    return best


def _measure(layers: list[int], configs: list[str], world_size: int) -> dict:
    """Lower every config at each depth of `layers`, in order, in this process: each lowering's
    seconds, its program's floor and its number of nodes."""
    os.environ["HOTSWITCH_CACHE"] = "0"
    warnings.filterwarnings("ignore")
    from compile_time import _model

    import hotswitch as hs
    from hotswitch.distributed._c10d import init_fake_process_group
    from hotswitch.train.data import full_length_micro_batch

    init_fake_process_group(0, world_size)
    out = {}
    for depth in layers:
        compiled = hs.compile(_model(depth), full_length_micro_batch(4, 64), configs=configs, lazy=True)
        for config in configs:
            started = time.perf_counter()
            program = compiled.exec_graph(config, ((4, 64),) * 3)
            lowering = time.perf_counter() - started
            out[(config, depth)] = dict(lowering=lowering, floor=_floor(program), nodes=len(program.graph.nodes))
    return out


def _in_fresh_process(layers, configs, world_size) -> dict:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_measure, layers, configs, world_size).result()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="2,8,32", help="comma-separated depths, the first the reference")
    p.add_argument("--configs", default="dp2tp2,tp4sp")
    p.add_argument("--world-size", type=int, default=4)
    args = p.parse_args(argv)
    layers = [int(x) for x in args.layers.split(",")]
    configs = args.configs.split(",")
    cold = {}
    for depth in layers:
        print(f"cold lowering, {depth} layers (a fresh process) ...", flush=True)
        cold.update(_in_fresh_process([depth], configs, args.world_size))
    print("every depth in one process ...", flush=True)
    warm = _in_fresh_process(layers, configs, args.world_size)
    first = layers[0]
    print(f"\none process, rank 0 of {args.world_size}; seconds; per layer = growth from {first} layers / added layers")
    print("| config | layers | nodes | cold | cold / first | warm process | floor | per layer: cold | floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for config in configs:
        base_cold, base_floor = cold[(config, first)]["lowering"], cold[(config, first)]["floor"]
        for depth in layers:
            c, w = cold[(config, depth)], warm[(config, depth)]
            added = depth - first
            per = (lambda now, then: f"{1000 * (now - then) / added:.1f} ms" if added else "")  # noqa: E731
            print(f"| {config} | {depth} | {c['nodes']} | {c['lowering']:.3f} | {c['lowering'] / base_cold:.2f} "
                  f"| {w['lowering']:.3f} | {c['floor']:.3f} | {per(c['lowering'], base_cold)} "
                  f"| {per(c['floor'], base_floor)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
