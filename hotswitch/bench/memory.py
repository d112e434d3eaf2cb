"""`hotswitch bench memory`: what one rank of a 7B or 70B job needs, compiled on this machine.

(a) **Compile at scale.** A Llama-2-7B-shaped model (32 layers, hidden 4096, 32 heads) as one rank
    of 8, and a Llama-3-70B-shaped one (80 layers, hidden 8192, 64 heads, 8 kv heads, a 128K
    vocabulary) as one rank of 64, are built on the meta device and compiled (`hs.compile(...,
    weights="empty")`: traced, lowered for the config, the rank's shards allocated but never
    written) in a process of their own that is rank 0 of a fake process group of the job's size
    (`hotswitch.runtime.profile`: collectives return at once). Per config and length: the seconds
    of the compile (tracing, or loading the trace from the compile cache, and lowering), the
    process's own peak resident memory against the model's fp32 bytes, and the rank's memory
    estimate by kind for AdamW training in bf16 with fp32 masters (this config its own base):
    parameters (bf16 shards), gradients (fp32 accumulators), optimizer state (fp32 master and two
    moments) and activations (`compiler.memory.estimate_peak_bytes` of the rank's ExecGraph: every
    intermediate value alive at once, the gathered fsdp units, the graph's own gradients; under
    pp, times the micro-batches 1F1B keeps in flight on the first stage), and whether it fits
    `--budget-gib` (80 GiB, an H100).
(b) **Measured against the estimate.** A Llama small enough to run here (`--measure-layers`
    layers, hidden 256) is compiled the same way with its weights initialized, and the rank's step
    runs under torch's MemTracker (`compiler._torch.allocated_peak`): the measured peak of the
    step's allocations beside the estimate of its activations, for configs with and without
    recomputation and fsdp. Printed: each config's measured peak over its plain config's (the
    ratio recomputation and fsdp buy) and measured over estimated.

JSON (`--json`) and a chart (`--plot`: memory per config, stacked by kind, the budget drawn).
"""
from __future__ import annotations

import math
import os
import resource
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

__all__ = ["MODEL_SHAPES", "MemoryBenchOptions", "RankMemory", "measure_rank", "run"]

GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """A Llama-shaped model (Hugging Face's LlamaConfig fields) and the job size it is benchmarked at."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    world_size: int

    def hf_config(self, max_positions: int):
        import transformers

        return transformers.LlamaConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            max_position_embeddings=max_positions, attn_implementation="sdpa", tie_word_embeddings=False)

    @property
    def params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.hidden // self.heads
        block = 2 * h * h + 2 * h * kv + 3 * h * self.intermediate + 2 * h
        return self.layers * block + 2 * self.vocab * h + h


MODEL_SHAPES = {
    "llama2-7b": ModelShape("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 8),
    "llama3-70b": ModelShape("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 64),
}
DEFAULT_CONFIGS = {
    "llama2-7b": ("dp8", "fsdp8", "fsdp8-full", "tp8", "tp8sp", "tp8sp-full", "fsdp2tp4sp-sel", "tp4pp2",
                  "fsdp2cp4-sel"),
    "llama3-70b": ("fsdp64", "fsdp64-full", "dp8tp8", "fsdp8tp8", "fsdp8tp8sp-full", "tp8pp8", "fsdp8cp8-full"),
}
MEASURED_CONFIGS = ("dp8", "fsdp8", "dp8-sel", "dp8-full", "fsdp8-full", "tp8sp", "tp8sp-full")


@dataclass(frozen=True)
class MemoryBenchOptions:
    models: tuple[str, ...] = ("llama2-7b", "llama3-70b")
    configs: dict | None = None  # model -> config names; None: DEFAULT_CONFIGS
    lengths: tuple[int, ...] = (4096, 32768)
    budget_bytes: int = 80 * GIB
    measure_layers: int = 4  # the measured model's layers (0: no measured part)
    measure_length: int = 512
    measure_configs: tuple[str, ...] = MEASURED_CONFIGS
    json_path: str | None = "bench_memory.json"
    png_path: str | None = "bench_memory.png"


@dataclass(frozen=True)
class RankMemory:
    """One rank of one config at one length: what compiling took and what training would hold."""

    model: str
    config: str
    world_size: int
    length: int
    trace: str  # "traced", or "loaded" from the compile cache
    compile_seconds: float  # hs.compile: tracing (or loading the trace) and lowering
    peak_rss_bytes: int  # this process's own peak resident memory, compile included
    model_fp32_bytes: int  # the whole model's parameters in fp32
    param_bytes: int  # the rank's bf16 weight shards
    grad_bytes: int  # fp32 gradient accumulators of those shards
    optimizer_bytes: int  # fp32 master and Adam's two moments of those shards
    activation_bytes: int  # the ExecGraph's peak of live intermediate values (x micro-batches in flight under pp)
    measured_bytes: int | None = None  # the step's measured peak of allocations (small models only)

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes,
                "rss_fraction": self.peak_rss_bytes / self.model_fp32_bytes}


def measure_rank(shape: ModelShape, config: str, length: int, *, run_step: bool = False) -> RankMemory:
    """Compile `config` for `shape` at `length` tokens per row as rank 0 of a fake process group of
    the job's size, in a process of its own (its peak RSS is this compile's alone)."""
    from hotswitch.distributed.launch import call_in_process

    return RankMemory(**call_in_process(_measure, shape, config, length, run_step,
                                        name=f"compiling {shape.name} under {config} at {length} tokens"))


def _measure(shape: ModelShape, name: str, length: int, run_step: bool) -> dict:
    import torch
    import transformers

    import hotswitch as hs
    from hotswitch.compiler._torch import allocated_peak
    from hotswitch.compiler.memory import estimate_peak_bytes
    from hotswitch.distconfig import DistConfig
    from hotswitch.distributed import _c10d
    from hotswitch.models import HFCausalLMLoss

    torch.set_num_threads(1)
    os.environ["HOTSWITCH_DEVICE"] = "cpu"
    config = DistConfig.parse(name)
    if config.world_size != shape.world_size:
        raise ValueError(f"{name} runs on {config.world_size} devices; {shape.name} is benchmarked on "
                         f"{shape.world_size}: give configs of {shape.world_size} devices")
    _c10d.init_fake_process_group(0, shape.world_size)
    dtype = torch.float32 if run_step else torch.bfloat16  # (a step on this CPU runs in fp32)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = HFCausalLMLoss(transformers.LlamaForCausalLM(shape.hf_config(length)).to(dtype))
    micro_batches = config.pp  # 1F1B's first stage holds pp micro-batches (of one row per replica each)
    ids = torch.randint(0, shape.vocab, (config.dp, length))
    t = time.perf_counter()
    cm = hs.compile(model, (ids, ids), [config], weights="init" if run_step else "empty")
    compile_seconds = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (Linux: KiB)
    stored = sum(p.numel() for p in cm.local_params.values())
    activations = estimate_peak_bytes(cm.exec_graph(name)) * micro_batches
    measured = None
    if run_step:
        local = cm.shard_inputs(ids, ids)
        cm.forward_backward(*local)  # warm-up: lazy code, caches, and the gradient accumulators (kept:
        _, measured = allocated_peak(lambda: cm.forward_backward(*local))  # state, not the step's)
    return dict(model=shape.name, config=name, world_size=shape.world_size, length=length,
                trace=cm.logic_source, compile_seconds=compile_seconds, peak_rss_bytes=rss,
                model_fp32_bytes=4 * shape.params, param_bytes=2 * stored, grad_bytes=4 * stored,
                optimizer_bytes=12 * stored, activation_bytes=int(activations), measured_bytes=measured)


# ------------------------------------------------------------------------------------ the run
def run(options: MemoryBenchOptions, log=print) -> dict:
    """Every model x config x length of (a), then (b); returns the JSON written."""
    from hotswitch.distconfig import DistConfig
    from hotswitch.progress import write_json

    plan = {}
    for model in options.models:  # every config checked before the first compile
        shape = MODEL_SHAPES[model]
        configs = tuple((options.configs or {}).get(model) or DEFAULT_CONFIGS[model])
        for name in configs:
            config = DistConfig.parse(name)
            if config.world_size != shape.world_size:
                raise ValueError(f"{name} runs on {config.world_size} devices, but {model} is benchmarked as one rank "
                                 f"of {shape.world_size}: give configs of {shape.world_size} devices")
        plan[model] = configs
    rows, failed = [], []
    for model, configs in plan.items():
        shape = MODEL_SHAPES[model]
        log(f"{model}: {shape.params / 1e9:.1f}B parameters ({4 * shape.params / GIB:.0f} GiB in fp32), one rank "
            f"of {shape.world_size}")
        for length in options.lengths:
            for config in configs:
                try:
                    r = measure_rank(shape, config, length)
                except RuntimeError as e:  # said in the table and the JSON: the other configs go on
                    reason = _reason(str(e))
                    failed.append({"model": model, "config": config, "length": length, "error": reason})
                    log(f"  {config:<18} {length:>6} tokens: did not compile: {reason}")
                    continue
                rows.append(r)
                log(_row(r, options.budget_bytes))
    measured = []
    if options.measure_layers:
        small = ModelShape(f"llama-{options.measure_layers}x256", options.measure_layers, 256, 8, 4, 704, 4096, 8)
        log(f"{small.name}: {small.params / 1e6:.1f}M parameters, one rank of 8, measured steps at "
            f"{options.measure_length} tokens")
        for config in options.measure_configs:
            r = measure_rank(small, config, options.measure_length, run_step=True)
            measured.append(r)
            log(_row(r, options.budget_bytes))
    out = {"budget_bytes": options.budget_bytes, "ranks": [r.to_dict() for r in rows], "failed": failed,
           "measured": [r.to_dict() for r in measured], "ratios": _ratios(measured)}
    log(table(out))
    write_json(options.json_path, out)
    if options.png_path:
        plot(out, options.png_path)
    return out


def _reason(error: str) -> str:
    """The last line of a compile's traceback, shortened: why a config did not compile."""
    last = [line for line in error.strip().splitlines() if line.strip()][-1]
    return last if len(last) <= 300 else last[:297] + "..."


def _row(r: RankMemory, budget: int) -> str:
    fits = "fits" if r.total_bytes <= budget else "does not fit"
    measured = f", measured step {r.measured_bytes / 2**20:.1f} MiB" if r.measured_bytes is not None else ""
    return (f"  {r.config:<18} {r.length:>6} tokens: compiled in {r.compile_seconds:5.1f} s ({r.trace}), peak RSS "
            f"{r.peak_rss_bytes / GIB:.2f} GiB = {r.peak_rss_bytes / r.model_fp32_bytes:.1%} of the fp32 model; "
            f"rank {_gib(r.total_bytes)} ({fits} {budget // GIB} GiB){measured}")


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def _ratios(measured: Sequence[RankMemory]) -> list[dict]:
    """Each measured config against its plain config (no fsdp, no recomputation): the measured peak
    of the whole rank (state and step) and of the step alone, and measured over estimated."""
    from hotswitch.distconfig import DistConfig
    from hotswitch.search.space import plain

    by_name = {r.config: r for r in measured}
    out = []
    for r in measured:
        base = by_name.get(plain(DistConfig.parse(r.config)).name)
        rank = r.param_bytes + r.grad_bytes + r.optimizer_bytes + r.measured_bytes
        row = {"config": r.config, "measured_step_bytes": r.measured_bytes, "estimated_step_bytes": r.activation_bytes,
               "measured_over_estimated": r.measured_bytes / r.activation_bytes, "measured_rank_bytes": rank}
        if base is not None and base is not r:
            base_rank = base.param_bytes + base.grad_bytes + base.optimizer_bytes + base.measured_bytes
            row.update(plain=base.config, step_ratio=r.measured_bytes / base.measured_bytes,
                       rank_ratio=rank / base_rank)
        out.append(row)
    return out


def table(out: dict) -> str:
    budget = out["budget_bytes"]
    lines = [f"{'model':<12}{'config':<19}{'tokens':>7}{'compile s':>10}{'RSS/fp32':>9}{'params':>10}{'grads':>10}"
             f"{'optim':>10}{'activ':>10}{'total':>10}  fits {budget // GIB} GiB"]
    for r in out["ranks"] + out["measured"]:
        lines.append(f"{r['model']:<12}{r['config']:<19}{r['length']:>7}{r['compile_seconds']:>10.1f}"
                     f"{r['rss_fraction']:>9.1%}{_gib(r['param_bytes']):>10}{_gib(r['grad_bytes']):>10}"
                     f"{_gib(r['optimizer_bytes']):>10}{_gib(r['activation_bytes']):>10}{_gib(r['total_bytes']):>10}"
                     f"  {'yes' if r['total_bytes'] <= budget else 'no'}")
    for f in out.get("failed", ()):
        lines.append(f"{f['model']:<12}{f['config']:<19}{f['length']:>7}  did not compile: {f['error'][:160]}")
    if out["ratios"]:
        lines.append("measured steps (MemTracker) against the estimate and against the plain config:")
        for r in out["ratios"]:
            against = (f"; step {r['step_ratio']:.2f}x, whole rank {r['rank_ratio']:.2f}x of {r['plain']}"
                       if "plain" in r else "")
            lines.append(f"  {r['config']:<14} measured {_gib(r['measured_step_bytes'])}, estimated "
                         f"{_gib(r['estimated_step_bytes'])} (measured/estimated {r['measured_over_estimated']:.2f})"
                         f"{against}")
    return "\n".join(lines)


def plot(out: dict, path: str) -> None:
    """Memory per rank and config, stacked by kind, one panel per model and length, the budget drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["model"], r["length"]) for r in out["ranks"]}, key=lambda p: (p[0], p[1]))
    if not panels:
        return
    cols = 2
    fig, axes = plt.subplots(math.ceil(len(panels) / cols), cols, figsize=(12, 3.6 * math.ceil(len(panels) / cols)),
                             squeeze=False)
    kinds = [("param_bytes", "weights (bf16)", "tab:blue"), ("grad_bytes", "gradients (fp32)", "tab:orange"),
             ("optimizer_bytes", "optimizer (fp32 master, Adam)", "tab:green"),
             ("activation_bytes", "activations (ExecGraph peak)", "tab:red")]
    for ax, (model, length) in zip(axes.flat, panels):
        rows = [r for r in out["ranks"] if (r["model"], r["length"]) == (model, length)]
        failed = [f for f in out.get("failed", ()) if (f["model"], f["length"]) == (model, length)]
        for f in failed:  # a slot of its own, said
            ax.text(len(rows) + failed.index(f), out["budget_bytes"] / GIB * 0.1, "did not compile", rotation=90,
                    ha="center", va="bottom", fontsize=7, color="0.3")
        bottom = [0.0] * len(rows)
        for key, label, color in kinds:
            values = [r[key] / GIB for r in rows]
            ax.bar(range(len(rows)), values, bottom=bottom, label=label, color=color)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.axhline(out["budget_bytes"] / GIB, color="black", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(rows) + len(failed)), [r["config"] for r in rows + failed], rotation=35, ha="right",
                      fontsize=8)
        ax.set_xlim(-0.6, len(rows) + len(failed) - 0.4)
        ax.set_ylabel("GiB per rank")
        ax.set_title(f"{model}, one rank of {rows[0]['world_size']}, {length} tokens per row", fontsize=9)
        top = 2.5 * out["budget_bytes"] / GIB  # a config far beyond the budget is cut, its total written
        if max(bottom) > top:
            ax.set_ylim(0, top)
            for i, total in enumerate(bottom):
                if total > top:
                    ax.text(i, top * 0.97, f"{total:,.0f}", ha="center", va="top", fontsize=7, rotation=90)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"hotswitch bench memory: per-rank memory by kind (dashed: {out['budget_bytes'] // GIB} GiB)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
