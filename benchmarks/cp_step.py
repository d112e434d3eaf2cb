"""One training step under context parallelism against tensor + sequence parallelism (and DP).

    python benchmarks/cp_step.py [--model gpt-tiny] [--shapes 4x512,1x2048]
                                 [--configs dp4,tp4sp,cp4] [--world-size 4] [--steps 5] [--json PATH]

For each global batch shape ROWSxLENGTH, `--world-size` gloo processes compile the model once for
every config that can take it (dp needs at least one row per rank), then time `forward_backward`
(forward, backward, gradient reduction) under each config in turn: one warm-up step, then the
median of `--steps` steps, each started together after a barrier. Times are rank 0's. The ratios
are against tp + sp, the layout long rows otherwise need. The model gets no document ids, so this is
all-gather context parallelism with contiguous chunks; `benchmarks/cp_layouts.py` measures the
layouts that document ids allow (zigzag, document-aware).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def measure(rank: int, model_name: str, rows: int, length: int, configs: tuple[str, ...], steps: int) -> dict:
    import torch
    import torch.distributed as dist

    import hotswitch as hs
    from hotswitch.models import build_model

    torch.manual_seed(0)
    model = build_model(model_name, vocab_size=1001)
    ids = torch.randint(0, 1001, (rows, length), generator=torch.Generator().manual_seed(0))
    labels = ids.roll(-1, 1)
    usable = [c for c in configs if hs.DistConfig.parse(c).dp <= rows]
    cm = hs.compile(model, (ids, labels), configs=usable)
    out = {}
    for name in usable:
        cm.switch(name)
        local = cm.shard_inputs(ids, labels)
        cm.forward_backward(*local)  # warm-up
        times = []
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            cm.forward_backward(*local)
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--shapes", default="4x512,1x2048", help="global batches ROWSxLENGTH (default 4x512,1x2048)")
    p.add_argument("--configs", default="dp4,tp4sp,cp4")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    from hotswitch.distributed.launch import launch

    configs = tuple(args.configs.split(","))
    results = []
    print(f"{args.model}, {args.world_size} gloo processes, median of {args.steps} steps (rank 0)")
    print(f"{'batch':>10} " + " ".join(f"{c:>9}" for c in configs) + "   ratios to tp+sp")
    for shape in args.shapes.split(","):
        rows, length = (int(x) for x in shape.lower().split("x"))
        seconds = launch(measure, args.world_size, args.model, rows, length, configs, args.steps)
        results.append({"rows": rows, "length": length, "seconds": seconds})
        base = next((seconds[c] for c in seconds if "sp" in c), None)
        cells = " ".join(f"{seconds[c]:>8.3f}s" if c in seconds else f"{'-':>9}" for c in configs)
        ratios = ", ".join(f"{c} {seconds[c] / base:.2f}" for c in seconds if base and "sp" not in c)
        print(f"{shape:>10} {cells}   {ratios}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "world_size": args.world_size, "results": results}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
