"""`hotswitch bench cp`: one attention layer on skewed packed batches, three layouts of the same degree
side by side on CPU processes (gloo):

- **zigzag CP**, static with causal balance (Megatron, torch's `context_parallel`): every row cut
  into 2*cp chunks, rank i holds chunks i and 2cp-1-i and fetches the row's keys/values before its
  queries;
- **document CP** (DCP): documents kept whole on one rank where the balance allows, long ones cut
  zigzag into as few pieces as needed; a rank fetches only the keys/values its queries attend to;
- **TP+SP** (Megatron's sequence parallelism): the layer's input all-gathered along the sequence,
  heads split over the ranks, the output reduce-scattered back onto the sequence.

The layer is q/k/v/o projections around document-causal attention (grouped-query, computed per
group of whole documents in every layout, so no layout attends across documents), forward and
backward in fp32. Batches: synthetic-skewed lengths (log-normal, median row/16, as
`--dataset synthetic-skewed`) packed first-fit-decreasing into rows of 1K, 2K and 4K tokens; a
batch is the first 1 or 4 rows (--rows), which hold the longest documents.

Reported per batch and layout: the slowest rank's forward + backward (median of --repeats); the
bytes a rank receives per step (keys/values forward and their gradients backward for CP; the
layer's input and output, both ways, for TP+SP; weight gradients are left out: the job's gradient
all-reduce over dp x cp carries them whatever the attention does); the busiest rank's attention
work over the mean; the planning time (placement and index tensors); the largest relative error
against one device. Ratios are against zigzag CP.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from hotswitch.bench.common import launch_and_report, max_over_ranks
from hotswitch.distconfig.tokens import Documents, document_placement, zigzag_placement
from hotswitch.runtime.cp_attention import CPAttentionPlan, cp_attention
from hotswitch.train.data import pack_rows, synthetic_skewed

__all__ = ["CpBenchOptions", "format_table", "run", "skewed_batch"]

LAYOUTS = ("zigzag CP", "document CP", "TP+SP")


@dataclass(frozen=True)
class CpBenchOptions:
    world_size: int = 4
    row_lengths: tuple[int, ...] = (1024, 2048, 4096)
    rows: tuple[int, ...] = (1, 4)  # packed rows per batch (a micro-batch)
    dim: int = 256
    heads: int = 8
    kv_heads: int = 4
    repeats: int = 3
    seed: int = 0
    balance: float = 0.1
    json_path: str | None = "bench_cp.json"
    png_path: str | None = "bench_cp.png"


def skewed_batch(row_length: int, rows: int, seed: int = 0):
    """`rows` packed rows of `row_length` tokens: synthetic-skewed lengths (log-normal, median
    row_length/16), packed first-fit-decreasing, the first `rows` rows (the longest documents)."""
    lengths = [len(s) for s in synthetic_skewed(16 * rows, 100, row_length, seed=seed)]
    packed = pack_rows(lengths, list(range(len(lengths))), row_length)
    if len(packed) < rows:
        raise ValueError(f"{len(lengths)} sequences fill only {len(packed)} rows of {row_length} tokens")
    return Documents.from_rows([[lengths[i] for i in row] for row in packed[:rows]], row_length)


def run(options: CpBenchOptions = CpBenchOptions()) -> int:
    """Measure every batch and layout on `options.world_size` processes, print, write JSON and PNG."""
    o = options
    if o.heads % o.world_size or o.kv_heads % o.world_size or o.heads % o.kv_heads:
        print(f"hotswitch bench cp: {o.heads} heads and {o.kv_heads} key/value heads must both divide over "
              f"{o.world_size} ranks (TP+SP splits heads), heads a multiple of kv heads", file=sys.stderr)
        return 2
    print(f"hotswitch bench cp: one attention layer (dim {o.dim}, {o.heads} heads, {o.kv_heads} kv heads, fp32) "
          f"on {' or '.join(map(str, o.rows))} skewed packed rows of {', '.join(map(str, o.row_lengths))} tokens, "
          f"{o.world_size} CPU processes (gloo), median of {o.repeats}", flush=True)
    return launch_and_report("hotswitch bench cp", _worker, o,
                             lambda batches: {"options": asdict(o), "batches": batches}, format_table, plot)


def format_table(result: dict) -> str:
    lines = [f"{'batch':>9} {'layout':<12} {'fwd+bwd ms':>10} {'x zigzag':>8} {'MiB/rank':>9} {'x zigzag':>8} "
             f"{'imbalance':>9} {'plan ms':>8} {'rel err':>8}"]
    for batch in result["batches"]:
        base = batch["layouts"]["zigzag CP"]
        for name, m in batch["layouts"].items():
            lines.append(f"{batch['rows']:>3} x {batch['row_length']:<4} {name:<12} {m['seconds'] * 1e3:>10.1f} "
                         f"{m['seconds'] / base['seconds']:>8.2f} {m['bytes_per_rank'] / 2**20:>9.2f} "
                         f"{m['bytes_per_rank'] / base['bytes_per_rank']:>8.2f} {m['imbalance']:>9.2f} "
                         f"{m['plan_seconds'] * 1e3:>8.1f} {m['max_error']:>8.1e}")
        lines.append(f"{'':>9} ({batch['documents']} documents, longest {batch['longest']} tokens)")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Step time and bytes per rank, grouped by row length, one bar per layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = result["batches"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(LAYOUTS)
    for i, name in enumerate(LAYOUTS):
        xs = [b + (i - 1) * width for b in range(len(batches))]
        axes[0].bar(xs, [b["layouts"][name]["seconds"] * 1e3 for b in batches], width, label=name)
        axes[1].bar(xs, [b["layouts"][name]["bytes_per_rank"] / 2**20 for b in batches], width, label=name)
    for ax, label in zip(axes, ("forward + backward, slowest rank (ms)", "received per rank per step (MiB)")):
        ax.set_xticks(range(len(batches)), [f"{b['rows']} x\n{b['row_length']}" for b in batches])
        ax.set_xlabel("packed rows x tokens")
        ax.set_ylabel(label)
        ax.legend()
    o = result["options"]
    fig.suptitle(f"attention layer on skewed packed batches, {o['world_size']} ranks (gloo, CPU)")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


# ------------------------------------------------------------------------------ on every rank
def _worker(rank: int, o: CpBenchOptions) -> list[dict]:
    torch.manual_seed(0)
    out = []
    for rows, row_length in ((r, n) for r in o.rows for n in o.row_lengths):
        docs = skewed_batch(row_length, rows, o.seed)
        layer = _Layer(o, docs)
        out.append(dict(row_length=row_length, rows=rows, documents=len(docs.lengths), longest=max(docs.lengths),
                        layouts={name: layer.measure(name, o.repeats) for name in LAYOUTS}))
    return out


class _Layer:
    """The attention layer's weights and batch (the same on every rank), its one-device result, and
    the three layouts' steps."""

    def __init__(self, o: CpBenchOptions, docs):
        self.o, self.docs = o, docs
        g = torch.Generator().manual_seed(o.seed)
        d, hd = o.dim, o.dim // o.heads
        self.x = torch.randn(docs.num_rows * docs.row_length, d, generator=g)  # flat [rows x row_length] tokens
        self.weight = torch.randn(docs.num_rows * docs.row_length, d, generator=g)  # the loss is sum(y * weight)
        self.w = {n: torch.randn(d, k * hd, generator=g) / d**0.5 for n, k in
                  (("q", o.heads), ("k", o.kv_heads), ("v", o.kv_heads))}
        self.w["o"] = torch.randn(o.heads * hd, d, generator=g) / d**0.5
        self.one_device = CPAttentionPlan.build(document_placement(docs, 1), 0)  # every document, in batch order
        assert self.one_device.local_index.equal(torch.arange(self.x.shape[0]))
        x, w = self._leaves(self.x)
        y = self._forward(x, w, self.one_device, o.heads, o.kv_heads)
        (y * self.weight).sum().backward()
        self.expected = dict(y=y.detach(), x=x.grad, **{n: t.grad for n, t in w.items()})

    def _leaves(self, x, weights=None):
        return x.clone().requires_grad_(), {n: t.clone().requires_grad_() for n, t in (weights or self.w).items()}

    @staticmethod
    def _forward(x, w, plan, heads, kv_heads, group=None):
        n = x.shape[0]
        q, k, v = ((x @ w[name]).view(n, h, -1) for name, h in (("q", heads), ("k", kv_heads), ("v", kv_heads)))
        return cp_attention(q, k, v, plan, group).reshape(n, -1) @ w["o"]

    def measure(self, layout: str, repeats: int) -> dict:
        t0 = time.perf_counter()
        step, error, received, imbalance = self._tp_sp() if layout == "TP+SP" else self._cp(layout)
        plan_seconds = time.perf_counter() - t0
        max_error = error(step())  # the warm-up step, checked against one device
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            times.append(max_over_ranks(time.perf_counter() - t0))
        return dict(seconds=statistics.median(times), bytes_per_rank=max_over_ranks(received), imbalance=imbalance,
                    plan_seconds=max_over_ranks(plan_seconds), max_error=max_over_ranks(max_error))

    def _cp(self, layout: str):
        """Replicated weights, tokens where the placement puts them, keys/values fetched per plan."""
        o, rank = self.o, dist.get_rank()
        placement = zigzag_placement(self.docs, o.world_size) if layout == "zigzag CP" else \
            document_placement(self.docs, o.world_size, o.balance)
        plan = CPAttentionPlan.build(placement, rank)
        x_local, weight_local = self.x[plan.local_index], self.weight[plan.local_index]

        def step():
            x, w = self._leaves(x_local)
            y = self._forward(x, w, plan, o.heads, o.kv_heads)
            (y * weight_local).sum().backward()
            return y.detach(), x.grad, {n: t.grad for n, t in w.items()}

        def error(result) -> float:
            y, dx, dw = result
            for t in dw.values():  # replicated weights: their gradient is the sum over ranks
                dist.all_reduce(t)
            e = self.expected
            mine = plan.local_index
            return _relative_error([(y, e["y"][mine]), (dx, e["x"][mine]), *((dw[n], e[n]) for n in dw)])

        row_bytes = 2 * o.kv_heads * (o.dim // o.heads) * 4  # a token's key and value, fp32
        return step, error, 2 * placement.fetched_tokens(rank) * row_bytes, placement.imbalance

    def _tp_sp(self):
        """The sequence split evenly, gathered before the projections; heads split; the output
        reduce-scattered back onto the sequence."""
        o, rank, tp = self.o, dist.get_rank(), self.o.world_size
        tokens, hd = self.x.shape[0], o.dim // o.heads
        if tokens % tp:
            raise ValueError(f"{tokens} tokens do not split evenly over {tp} ranks")
        rows = slice(rank * tokens // tp, (rank + 1) * tokens // tp)
        heads, kv_heads = o.heads // tp, o.kv_heads // tp
        plan = CPAttentionPlan.build(document_placement(self.docs, 1), 0)  # every rank attends over all tokens
        cols = {"q": slice(rank * heads * hd, (rank + 1) * heads * hd),
                "k": slice(rank * kv_heads * hd, (rank + 1) * kv_heads * hd)}
        cols["v"] = cols["k"]
        w_local = {n: self.w[n][:, cols[n]] for n in "qkv"}
        w_local["o"] = self.w["o"][cols["q"], :]
        x_local, weight_local = self.x[rows], self.weight[rows]

        def step():
            x, w = self._leaves(x_local, w_local)
            y = _ScatterSequence.apply(self._forward(_GatherSequence.apply(x), w, plan, heads, kv_heads))
            (y * weight_local).sum().backward()
            return y.detach(), x.grad, {n: t.grad for n, t in w.items()}

        def error(result) -> float:
            y, dx, dw = result
            e = self.expected
            return _relative_error([(y, e["y"][rows]), (dx, e["x"][rows]), *((dw[n], e[n][:, cols[n]]) for n in "qkv"),
                                    (dw["o"], e["o"][cols["q"], :])])

        # forward: all-gather the input, reduce-scatter the output; backward: the reverse of each
        received = 4 * (tp - 1) * (tokens // tp) * o.dim * 4
        return step, error, received, 1.0


def _relative_error(pairs) -> float:
    """The largest |got - expected| over max |expected|, tensor by tensor."""
    return max((got - want).abs().max().item() / max(want.abs().max().item(), 1e-30) for got, want in pairs)


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence; the backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x):
        out = x.new_empty(x.shape[0] * dist.get_world_size(), *x.shape[1:])
        dist.all_gather_single(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        return _ScatterSequence.forward(ctx, grad)


class _ScatterSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence; the backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x):
        out = x.new_empty(x.shape[0] // dist.get_world_size(), *x.shape[1:])
        dist.reduce_scatter_single(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        return _GatherSequence.forward(ctx, grad)
