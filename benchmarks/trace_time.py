"""Tracing time against `torch.export` of the same model, by regions and as one graph, on one process.

    python benchmarks/trace_time.py [--layers 2,8,32] [--repeats 2]

The model is the compile-time benchmark's HF Llama (hidden 256, 8 heads, packed rows of 4 x 64).
For each depth: `torch.export` alone, hotswitch's trace with the joint graph stitched from its
regions (`compiler.regions`, the default), and the same trace with the joint traced as one graph
(what it was before). Best of `--repeats` runs each, after one warm-up trace of a 1-layer model.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="2,8,32", help="comma-separated depths (default 2,8,32)")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    sys.path.insert(0, os.path.dirname(__file__))
    import torch
    from compile_time import _model

    from hotswitch.compiler import trace as T
    from hotswitch.train.data import full_length_micro_batch

    inputs = full_length_micro_batch(4, 64)
    T.trace(_model(1), inputs)  # imports and first-use costs

    def best(f) -> float:
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        return min(times)

    def export(model):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            dims = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
            torch.export.export(model, inputs, dynamic_shapes=tuple(dims for _ in inputs), strict=False)

    def whole(model):
        stitched = T.stitched_joint
        T.stitched_joint = lambda *a, **k: None  # no region reused: the joint traced as one graph
        try:
            T.trace(model, inputs)
        finally:
            T.stitched_joint = stitched

    print("layers  torch.export  trace by regions  trace as one graph")
    for layers in (int(x) for x in args.layers.split(",")):
        model = _model(layers)
        e = best(lambda: export(model))  # noqa: B023 - called at once
        s = best(lambda: T.trace(model, inputs))  # noqa: B023
        w = best(lambda: whole(model))  # noqa: B023
        print(f"{layers:>6}  {e:>10.2f} s  {s:>8.2f} s ({s / e:.2f}x)  {w:>8.2f} s ({w / e:.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
