"""`hotswitch demo`: train a small GPT on CPU processes under several DistConfigs, switching
between them, and check every loss and every switch against a single-device run."""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

from hotswitch.cli.common import (
    HelpFormatter,
    add_backend_argument,
    add_configs_argument,
    add_json_argument,
    format_counts,
    parse_configs,
    plural,
    processes,
    progress,
    render_table,
    write_json,
)
from hotswitch.progress import Progress

__all__ = ["add_parser"]

LOSS_TOLERANCE = 1e-4  # |loss - single-device loss|: fp32 sums in another order differ by ~1e-6


@dataclass(frozen=True)
class DemoOptions:
    model: str
    layers: int | None
    configs: tuple[str, ...]
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    seed: int
    backend: str | None = None  # nccl | gloo; None: nccl when every process gets a GPU


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="train a small GPT on CPU processes, hot-switching between DistConfigs",
                              formatter_class=HelpFormatter,
                              description="Spawn --world-size CPU processes (gloo), compile one model for several "
                              "DistConfigs, train a few SGD steps under each on a fixed synthetic batch, switch "
                              "between them, and check the state and loss against a single-device run.")
    p.add_argument("--world-size", type=int, default=None,
                   help="processes to spawn (default: 4; under torchrun: its WORLD_SIZE)")
    p.add_argument("--model", default="gpt-tiny", help="built-in model (hotswitch.models.MODEL_CONFIGS)")
    p.add_argument("--layers", type=int, default=None, help="override the model's number of layers")
    add_backend_argument(p)
    add_configs_argument(p, "dp<W>, dp<W/2>tp2, tp<W>sp for W processes")
    p.add_argument("--steps", type=int, default=3, help="SGD steps per config")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per global batch")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=0.5, help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the batch")
    add_json_argument(p, None, "the losses, switch times and checks")
    p.set_defaults(run=run_demo)


def default_configs(world_size: int) -> list[str]:
    """dp<W>, dp<W/2>tp2 (when W >= 4 is even), tp<W>sp: pure DP, 2-D, and TP with SP."""
    from hotswitch.distconfig import standard_configs

    return [c.name for c in standard_configs(world_size) if c.tp == 1 or c.sp or c.dp > 1]


def run_demo(args) -> int:
    from hotswitch.distconfig import DistConfig
    from hotswitch.distributed.launch import LaunchError, launch
    from hotswitch.models import MODEL_CONFIGS

    if args.model not in MODEL_CONFIGS:
        raise SystemExit(f"hotswitch demo: unknown model {args.model!r}; choose from {', '.join(MODEL_CONFIGS)}")
    world_size = args.world_size or int(os.environ.get("WORLD_SIZE", 4))
    if args.configs:
        names = [c.spec() for c in parse_configs(args.configs, world_size, "demo")]
    else:
        names = [DistConfig.parse(n).spec() for n in default_configs(world_size)]
    if args.steps < 1 or args.batch_size < 1 or args.seq_len < 2 or (args.layers is not None and args.layers < 1):
        raise SystemExit("hotswitch demo: need --steps >= 1, --batch-size >= 1, --seq-len >= 2 and --layers >= 1")
    opts = DemoOptions(args.model, args.layers, tuple(names), args.steps, args.batch_size, args.seq_len, args.lr,
                       args.seed, args.backend)
    model = args.model + (f" ({plural(args.layers, 'layer')})" if args.layers else "")
    rank0 = int(os.environ.get("RANK", "0")) == 0  # under torchrun every rank runs this
    say = progress if rank0 else (lambda message: None)
    shown = ", ".join(DistConfig.parse(n).name for n in names)
    say(f"hotswitch demo: {model} on {processes(world_size, args.backend)}, configs {shown}; "
        f"{plural(args.steps, 'SGD step')} each, batch of {args.batch_size} sequences x {args.seq_len} tokens, "
        f"lr {args.lr}")
    t0 = time.perf_counter()
    try:
        result = launch(_demo_worker, world_size, opts, backend=opts.backend)
    except LaunchError as e:  # the failing rank's traceback, without launch's own frames
        print(f"hotswitch demo: {e}", file=sys.stderr, flush=True)
        return 1
    if not rank0:
        return 0
    _print_demo(result, opts)
    write_json(args.json, result)
    progress(f"demo finished in {time.perf_counter() - t0:.1f} s (start of {world_size} processes, the single-device "
             "reference, hs.compile, training, switching, checks)")
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
    from hotswitch.compiler.lower import count_collectives
    from hotswitch.distconfig import DistConfig
    from hotswitch.models import build_model

    say = progress if rank == 0 else (lambda message: None)
    # torch.export's pytree pickling warns about its own deprecated LeafSpec on every rank: noise here.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    torch.manual_seed(opts.seed)
    model = build_model(opts.model, **({"n_layers": opts.layers} if opts.layers else {}))
    ids, labels = synthetic_batch(model.cfg.vocab_size, opts.batch_size, opts.seq_len, opts.seed + 1)
    configs = [DistConfig.parse(n) for n in opts.configs]
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
    say(f"tracing {opts.model} ({n_params / 1e6:.2f}M parameters) and compiling "
        f"{', '.join(c.name for c in configs)} ...")
    t = time.perf_counter()
    cm = hs.compile(model, (ids, labels), configs=configs, progress=Progress() if rank == 0 else None)
    compile_total = time.perf_counter() - t
    lowering = {c.name: cm.compile_seconds(c.name) for c in configs}
    each, lowered = ", ".join(f"{name} {s:.2f}" for name, s in lowering.items()), sum(lowering.values())
    say(f"hs.compile: {compile_total:.2f} s = tracing {cm.trace_seconds:.2f} s + lowering {lowered:.2f} s ({each}) "
        f"+ meshes and layouts {compile_total - cm.trace_seconds - lowered:.2f} s")

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
            loss = loss.item()  # waits for the device's queued work, before the clock is read
            seconds = time.perf_counter() - t
            rows[config.name].append({"step": step, "loss": loss, "seconds": seconds,
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
        render_table(f"{name}: dp={dp} tp={tp} sp={'on' if sp else 'off'}, lowered in "
                     f"{result['lowering'][name]:.2f} s", columns, table)
    print()
    for s in result["switches"]:
        print(f"switch {s['from']} -> {s['to']}: {s['seconds']:.4f} s (max |Δw| = {s['max_dw']:.1e})")
    yes = {True: "yes", False: "NO"}
    print(f"state preserved across switches: {yes[result['state_preserved']]} (max |Δw| = {result['max_dw']:.1e})")
    print(f"losses follow the single-device trajectory: {yes[result['loss_matches']]} "
          f"(max |Δloss| = {result['max_dloss']:.1e})", flush=True)
