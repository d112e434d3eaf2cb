"""A compiled training step on skewed packed batches under every context-parallel layout.

    python benchmarks/cp_layouts.py [--model gpt-tiny] [--shapes 1x2048,4x1024] [--steps 5]
                                    [--world-size 4] [--json PATH]

The batches are `hotswitch bench cp`'s (synthetic-skewed lengths packed into rows, the first ROWS
rows). For each, `--world-size` gloo processes compile the model (as `PackedCausalLMLoss`) and time
`forward_backward` (forward, backward, gradient reduction), one warm-up step then the median of
--steps, slowest rank:

- **cp all-gather**: no document ids; attention is SDPA with the document mask built in the graph
  from the positions, and DTensor's strategies all-gather K and V over cp (what cp configs did first);
- **cp contiguous / zigzag / document**: with document ids; attention is `document_attention`, which
  fetches only the keys its queries attend to; tokens laid out by `cp_layout`;
- **tp+sp** and **dp** with document ids (the same attention kernel), as the layouts a job would
  otherwise switch to.

Every step's loss is checked equal across layouts (they compute the same batch). Ratios are against
cp zigzag, the static causal-balanced layout.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

LAYOUTS = ("cp all-gather", "cp contiguous", "cp zigzag", "cp document", "tp+sp", "dp")


def measure(rank: int, model_name: str, rows: int, length: int, steps: int, cp: int) -> dict:
    import torch
    import torch.distributed as dist

    import hotswitch as hs
    from hotswitch.bench.cp import skewed_batch
    from hotswitch.models import PackedCausalLMLoss, build_model, document_ids_of

    docs = skewed_batch(length, rows)
    positions = torch.tensor(docs.positions())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 1001, positions.shape, generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[positions.roll(-1, dims=1) == 0] = -100
    torch.manual_seed(0)
    model = PackedCausalLMLoss(build_model(model_name, vocab_size=1001, max_seq_len=max(length, 256)))
    plain, with_ids = (ids, positions, labels), (ids, positions, labels, document_ids_of(positions))
    cp_name, tp_name, dp_name = f"cp{cp}", f"tp{cp}sp", f"dp{cp}"
    runs = {"cp all-gather": (plain, cp_name, "contiguous"), "cp contiguous": (with_ids, cp_name, "contiguous"),
            "cp zigzag": (with_ids, cp_name, "zigzag"), "cp document": (with_ids, cp_name, "document"),
            "tp+sp": (with_ids, tp_name, "contiguous")}
    if rows >= cp:
        runs["dp"] = (with_ids, dp_name, "contiguous")
    with_ids_configs = [cp_name, tp_name, *([dp_name] if rows >= cp else [])]
    compiled = {False: hs.compile(model, plain, configs=[cp_name]),
                True: hs.compile(model, with_ids, configs=with_ids_configs)}
    out = {}
    for name, (inputs, config, layout) in runs.items():
        cm = compiled[len(inputs) == 4]
        cm.switch(config)
        cm.cp_layout = layout
        local = cm.shard_inputs(*inputs)
        loss = cm.forward_backward(*local).item()  # warm-up
        times = []
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            cm.forward_backward(*local)
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times.append(t.item())
        out[name] = {"seconds": statistics.median(times), "loss": loss}
    return {"documents": len(docs.lengths), "longest": max(docs.lengths), "layouts": out}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--shapes", default="1x2048,4x1024", help="ROWSxLENGTH batches (default 1x2048,4x1024)")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    from hotswitch.distributed.launch import launch

    results = []
    print(f"{args.model}, {args.world_size} gloo processes, median of {args.steps} steps (slowest rank); "
          "ratios to cp zigzag")
    print(f"{'batch':>8} " + " ".join(f"{name:>15}" for name in LAYOUTS))
    for shape in args.shapes.split(","):
        rows, length = (int(x) for x in shape.lower().split("x"))
        r = launch(measure, args.world_size, args.model, rows, length, args.steps, args.world_size)
        losses = {round(m["loss"], 4) for m in r["layouts"].values()}
        if len(losses) != 1:
            print(f"{shape}: layouts disagree on the loss: {r['layouts']}")
            return 1
        base = r["layouts"]["cp zigzag"]["seconds"]
        cells = " ".join(f"{r['layouts'][n]['seconds']:>7.3f}s ({r['layouts'][n]['seconds'] / base:.2f})"
                         if n in r["layouts"] else f"{'-':>15}" for n in LAYOUTS)
        print(f"{shape:>8} {cells}   ({r['documents']} documents, longest {r['longest']})", flush=True)
        results.append({"rows": rows, "length": length, **r})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "world_size": args.world_size, "results": results}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
