"""`hotswitch bench step`: one training step of hotswitch's ExecGraphs against what users would run
otherwise, side by side on CPU processes (gloo), the same model and global batch:

- **data parallelism**: hotswitch dp<W> (ExecGraph eager, and compiled by Inductor) against
  torch's `DistributedDataParallel` (eager, and `torch.compile`d);
- **tensor parallelism**: hotswitch tp<W> against DTensor's `parallelize_module` with torchtitan's
  plan without sequence parallelism (q/k/v and gate/up column-parallel, o and down row-parallel,
  the embedding row-parallel, the LM head column-parallel with replicated logits), eager and
  `torch.compile`d;
- **one device**: the model alone on rank 0 with the whole global batch, for scale.

A step is forward, backward and the data-parallel gradient reduction (no optimizer), in fp32, for
our GPT and a Hugging Face Llama of the same shape (random weights). Reported per model and method:
the median over --repeats steps of the slowest rank's step, after --warmup steps (the first step
compiles; its time is reported apart), the global loss (every method must agree: a peer that
computes something else would be no baseline) and the ratios hotswitch / peer. A method that fails
is reported with its error, not left out. Writes JSON and a PNG bar chart.
"""
from __future__ import annotations

import copy
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from hotswitch.bench.common import launch_and_report, max_over_ranks

__all__ = ["StepBenchOptions", "format_table", "run"]

MODELS = ("gpt", "llama")


@dataclass(frozen=True)
class StepBenchOptions:
    world_size: int = 4
    models: tuple[str, ...] = MODELS
    layers: int = 2
    dim: int = 256
    heads: int = 8
    vocab: int = 1024
    rows: int = 8  # global batch: rows x length tokens
    length: int = 128
    repeats: int = 6
    warmup: int = 1
    compiled: bool = True  # also hotswitch under Inductor and the peers under torch.compile
    json_path: str | None = "bench_step.json"
    png_path: str | None = "bench_step.png"


def run(options: StepBenchOptions = StepBenchOptions()) -> int:
    """Measure every model and method on `options.world_size` processes; print, write JSON and PNG."""
    o = options
    if o.heads % o.world_size or o.rows % o.world_size or o.dim % o.heads:
        print(f"hotswitch bench step: {o.heads} heads and {o.rows} rows must divide over {o.world_size} ranks "
              f"(tensor and data parallelism), and the width {o.dim} over the heads", file=sys.stderr)
        return 2
    unknown = [m for m in o.models if m not in MODELS]
    if unknown:
        print(f"hotswitch bench step: unknown models {unknown}; choose from {', '.join(MODELS)}", file=sys.stderr)
        return 2
    print(f"hotswitch bench step: {', '.join(o.models)} ({o.layers} layers, width {o.dim}, {o.heads} heads, "
          f"vocab {o.vocab}, fp32), global batch {o.rows} x {o.length}, {o.world_size} CPU processes (gloo), "
          f"median of {o.repeats} steps after {o.warmup}", flush=True)
    return launch_and_report("hotswitch bench step", _worker, o,
                             lambda models: {"options": asdict(o), "models": models}, format_table, plot)


# (parallelism, hotswitch method, peer method) pairs the ratios compare
PAIRS = (("dp", "hotswitch dp eager", "DDP eager"), ("dp", "hotswitch dp inductor", "DDP eager"),
         ("dp", "hotswitch dp inductor", "DDP compiled"), ("tp", "hotswitch tp eager", "DTensor TP eager"),
         ("tp", "hotswitch tp inductor", "DTensor TP eager"), ("tp", "hotswitch tp inductor", "DTensor TP compiled"))


def ratios(measured: dict) -> list[tuple[str, str, float | None]]:
    """(hotswitch method, peer, hotswitch step / peer step) for each pair both sides measured."""
    out = []
    for _, mine, peer in PAIRS:
        a, b = measured.get(mine, {}), measured.get(peer, {})
        if "seconds" in a and "seconds" in b:
            out.append((mine, peer, a["seconds"] / b["seconds"]))
    return out


def format_table(result: dict) -> str:
    lines = []
    for entry in result["models"]:
        lines.append(f"{entry['model']} ({entry['parameters'] / 1e6:.1f}M parameters)")
        lines.append(f"  {'method':<24} {'step ms':>9} {'first step s':>12} {'loss':>9}")
        for name, m in entry["methods"].items():
            if "error" in m:
                lines.append(f"  {name:<24} failed: {m['error']}")
            else:
                lines.append(f"  {name:<24} {m['seconds'] * 1e3:>9.1f} {m['first_seconds']:>12.2f} {m['loss']:>9.5f}")
        for mine, peer, ratio in ratios(entry["methods"]):
            lines.append(f"  {mine} / {peer}: {ratio:.2f}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Step time per method: data parallelism and tensor parallelism side by side, one group of bars
    per model, one device in both for scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = result["models"]
    panels = (("data parallelism", ("hotswitch dp eager", "hotswitch dp inductor", "DDP eager", "DDP compiled")),
              ("tensor parallelism", ("hotswitch tp eager", "hotswitch tp inductor", "DTensor TP eager",
                                      "DTensor TP compiled")))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, (title, names) in zip(axes, panels):
        names = [n for n in (*names, "one device") if any(n in e["methods"] for e in entries)]
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            xs = [k + (i - (len(names) - 1) / 2) * width for k in range(len(entries))]
            ys = [e["methods"].get(name, {}).get("seconds", float("nan")) * 1e3 for e in entries]
            ax.bar(xs, ys, width, label=name)
        ax.set_xticks(range(len(entries)), [e["model"] for e in entries])
        ax.set_title(title)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    axes[0].set_ylabel("training step, slowest rank (ms)")
    o = result["options"]
    fig.suptitle(f"one step, global batch {o['rows']} x {o['length']}, {o['world_size']} ranks (gloo, CPU)")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


# ------------------------------------------------------------------------------ on every rank
def _worker(rank: int, o: StepBenchOptions) -> list[dict] | None:
    warnings.filterwarnings("ignore")
    out = []
    for kind in o.models:
        model = _model(kind, o)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, o.vocab, (o.rows, o.length), generator=g)
        labels = torch.randint(0, o.vocab, (o.rows, o.length), generator=g)
        methods: dict[str, dict] = {}
        for backend in ("eager", "inductor") if o.compiled else ("eager",):
            for par in ("dp", "tp"):
                methods[f"hotswitch {par} {backend}"] = _measure(
                    lambda: _hotswitch(model, ids, labels, par, backend, o), o)  # noqa: B023 - called at once
        for compiled in (False, True) if o.compiled else (False,):
            suffix = "compiled" if compiled else "eager"
            methods[f"DDP {suffix}"] = _measure(lambda: _ddp(model, ids, labels, compiled, o), o)  # noqa: B023
            methods[f"DTensor TP {suffix}"] = _measure(
                lambda: _dtensor_tp(model, kind, ids, labels, compiled, o), o)  # noqa: B023
        methods["one device"] = _one_device(model, ids, labels, o)
        out.append(dict(model=kind, parameters=sum(p.numel() for p in model.parameters()), methods=methods))
    return out if rank == 0 else None


def _model(kind: str, o: StepBenchOptions) -> torch.nn.Module:
    torch.manual_seed(0)  # identical weights on every rank
    if kind == "gpt":
        from hotswitch.models import build_model

        return build_model("gpt-tiny", vocab_size=o.vocab, dim=o.dim, n_layers=o.layers, n_heads=o.heads,
                           n_kv_heads=o.heads, max_seq_len=max(256, o.length))
    from hotswitch.models import build_hf_model

    return build_hf_model("llama", vocab_size=o.vocab, hidden_size=o.dim, intermediate_size=2 * o.dim,
                          num_hidden_layers=o.layers, num_attention_heads=o.heads, num_key_value_heads=o.heads,
                          max_position_embeddings=max(256, o.length))


def _hotswitch(model, ids, labels, par: str, backend: str, o: StepBenchOptions):
    import hotswitch as hs

    cm = hs.compile(model, (ids, labels), configs=[f"{par}{o.world_size}"], backend=backend)
    local = cm.shard_inputs(ids, labels)

    def step() -> torch.Tensor:
        cm.zero_grad()
        return cm.forward_backward(*local)
    return step


def _ddp(model, ids, labels, compiled: bool, o: StepBenchOptions):
    from torch.nn.parallel import DistributedDataParallel

    rank, per = dist.get_rank(), o.rows // o.world_size
    ddp = DistributedDataParallel(copy.deepcopy(model))
    run = torch.compile(ddp) if compiled else ddp
    local_ids, local_labels = ids[rank * per:(rank + 1) * per], labels[rank * per:(rank + 1) * per]

    def step() -> torch.Tensor:
        ddp.zero_grad(set_to_none=True)
        loss = run(local_ids, local_labels)
        loss.backward()
        loss = loss.detach().clone()
        dist.all_reduce(loss)  # equal tokens per rank: the mean of the ranks' means is the global mean
        return loss / o.world_size
    return step


def _dtensor_tp(model, kind: str, ids, labels, compiled: bool, o: StepBenchOptions):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp_model = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (o.world_size,))
    if kind == "gpt":
        root, blocks, attn, mlp, embed, head = tp_model, tp_model.layers, "attn", "mlp", "embed", "lm_head"
    else:
        root = tp_model.model  # HFCausalLMLoss -> LlamaForCausalLM
        blocks, attn, mlp, embed, head = root.model.layers, "self_attn", "mlp", "model.embed_tokens", "lm_head"
    plan = {embed: RowwiseParallel(input_layouts=Replicate()), head: ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(blocks)):
        prefix = f"layers.{i}" if kind == "gpt" else f"model.layers.{i}"
        plan.update({f"{prefix}.{attn}.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")})
        plan[f"{prefix}.{attn}.o_proj"] = RowwiseParallel()
        plan.update({f"{prefix}.{mlp}.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")})
        plan[f"{prefix}.{mlp}.down_proj"] = RowwiseParallel()
    parallelize_module(root, mesh, plan)
    if kind == "gpt":  # our attention views its heads by count: each rank holds 1/W of them (as torchtitan does)
        for block in blocks:
            block.attn.n_heads //= o.world_size
            block.attn.n_kv_heads //= o.world_size
    run = torch.compile(tp_model) if compiled else tp_model

    def step() -> torch.Tensor:
        tp_model.zero_grad(set_to_none=True)
        loss = run(ids, labels)
        loss.backward()
        return loss.detach()
    return step


def _measure(make_step, o: StepBenchOptions) -> dict:
    """The slowest rank's step: setting up (hs.compile's trace and lowering, wrapping a peer) apart,
    then `_time_steps`."""
    try:
        dist.barrier()
        t = time.perf_counter()
        step = make_step()
        setup = max_over_ranks(time.perf_counter() - t)
        return {**_time_steps(step, o, max_over_ranks, dist.barrier), "setup_seconds": setup}
    except Exception as e:  # noqa: BLE001 - reported in the table (every rank fails alike: same model, same code)
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]}


def _time_steps(step, o: StepBenchOptions, slowest, sync) -> dict:
    """The first step (Inductor and torch.compile compile there) apart, then the median of `repeats`
    after `warmup` steps; `slowest(seconds)` makes a rank's time the job's, `sync()` lines ranks up."""
    t = time.perf_counter()
    loss = step()
    first = slowest(time.perf_counter() - t)
    for _ in range(o.warmup - 1):
        step()
    times = []
    for _ in range(o.repeats):
        sync()
        t = time.perf_counter()
        loss = step()
        times.append(slowest(time.perf_counter() - t))
    return {"seconds": statistics.median(times), "first_seconds": first, "loss": float(loss)}


def _one_device(model, ids, labels, o: StepBenchOptions) -> dict:
    """Rank 0 alone (the others wait): the unsharded model on the whole global batch."""
    result = {}
    if dist.get_rank() == 0:
        alone = copy.deepcopy(model)

        def step():
            alone.zero_grad(set_to_none=True)
            loss = alone(ids, labels)
            loss.backward()
            return loss.detach()
        result = _time_steps(step, o, lambda seconds: seconds, lambda: None)
    dist.barrier()
    return result
