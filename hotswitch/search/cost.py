"""What a config costs at a sequence length, without running it: time and memory per rank.

**Work per micro-batch.** One rank's share of one micro-batch (b rows of L tokens per data-parallel
replica; `train.data.rows_per_micro_batch`), counted from the transformer's shape:

- *FLOPs* of the matmuls and attention, forward + backward (3x forward), the formulas
  `torch.utils.flop_counter` applies to the traced graph (which `compiler.stages` cuts pipelines
  by): per token and layer 2h(2h + 2·kv·d) for q, k, v, o, 2h·f·(3 gated | 2) for the MLP, 4·L·h for
  attention (full L x L scores: the math kernel the compiler traces computes them all), and 2h·V for
  the LM head. Tensor parallelism divides all of it by tp except what stays whole on every rank:
  k/v projections when tp exceeds the kv heads (`heads_sharded`) and the LM head where the compiler
  replicates it (`Workload.head_sharded`).
- *Bytes* read and written by the memory-bound ops (norms, residual adds, rotary embedding, the
  softmax over L x L scores, the MLP activation, the loss over the vocabulary): a few passes over
  each tensor, divided by tp inside blocks and by tp outside them only under sequence parallelism.
- *Collectives*: Megatron's, which the compiler reproduces: per layer 2 all-reduces of the activation
  forward and 2 backward under TP (with SP: 4 all-gathers and 4 reduce-scatters), one for the
  vocab-parallel embedding; the gradient all-reduce over dp (inside every micro-batch's graph for
  pp = 1, as the runtime does; once per step for pp > 1); pipeline sends of the activation. Each is
  priced by the ring formula over the Topology's bandwidth of the link its group spans (inside a node
  or not), and counted, since each call has a fixed latency.

**Time** of one micro-batch = flops·a + bytes·b + comm_seconds·c + collectives·d + e: the `Rates`.
Their defaults come from a `Hardware` description; `calibrate` fits them to a few measured
micro-batches (`train.cost_model.Probe`, what `Trainer.profile` measures) by non-negative least
squares, so a CPU with gloo (where a collective costs milliseconds) and a GPU with NCCL are both
priced by their own numbers. A pipeline runs its slowest stage (`cluster.split_stages`) for
micro-batches + pp - 1 slots (1F1B and GPipe alike).

**A step's other costs.** A switch between configs costs `per_switch` + `switch_scale` x the
planner's estimate of its transfers on the Topology's links (`Rates.switch_seconds`; fitted to
measured switches by `calibrate_switches`: on gloo the fixed cost dominates, on NCCL the bytes). The
optimizer runs once per step in the base config: AdamW's passes over the base's parameters per rank
(1/dp of them under ZeRO-1, plus an all-gather of the updated masters), priced by `per_byte`
(`optimizer_seconds`).

**Recomputation and FSDP** (`DistConfig.recompute`, `DistConfig.fsdp`; `compiler.recompute`,
`compiler.fsdp`). Full recomputation keeps a block's input and runs its forward again in the backward
(4x the forward's FLOPs instead of 3x, the forward's tensor-parallel collectives again), so a block
keeps one residual-stream tensor and the block being recomputed holds its activations once more;
selective keeps the matmul and attention outputs and recomputes the norms and activations between
them (their memory traffic again). FSDP divides the stored weights, gradients and optimizer state
by dp, adds two gathered units (FSDP2's prefetch) and one unit's unreduced gradients to the peak,
and trades the gradient all-reduce for an all-gather before each unit's forward and backward and a
reduce-scatter of its gradients: 3 x (dp-1)/dp of the parameters' bytes in every micro-batch.

**Memory** per rank = resident state + activations. State: compute weights, fp32 gradient
accumulators and the graph's own gradients (`Trainer.state_bytes` plus what `compiler.memory` counts
of the graph's outputs); the base config additionally holds fp32 masters (unless compute is fp32)
and Adam's two moments (`optimizer_bytes`, split over dp under ZeRO-1). Activations: what backward
keeps (Korthikanti et al. 2022's accounting: the residual-stream tensors sharded only by SP, the
rest by tp, L x L scores per head, the logits), times the micro-batches in flight on the first
pipeline stage. `calibrate` also fits the activation and graph-gradient terms to measured peaks (the
Trainer's probes report `compiler.memory.estimate_peak_bytes` of the real ExecGraph).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from hotswitch.compiler.reduce import BUCKET_BYTES  # the compiler's gradient bucket: one all-reduce each
from hotswitch.compiler.tp_rules import heads_sharded
from hotswitch.distconfig import DistConfig, Topology
from hotswitch.switch.cluster import describe_model, split_stages

from .comm import CommProfile, link_bandwidth
from .space import plain
from .workload import Workload

__all__ = ["Estimate", "Hardware", "Rates", "Work", "calibrate", "calibrate_switches", "estimate", "micro_batch_work",
           "optimizer_seconds", "rows_per_replica", "stored_params"]

GRAD_ACCUMULATOR_BYTES = 4  # fp32 gradient accumulators (Trainer: cm.grad_dtype = float32)
ADAM_BYTES = 8  # two fp32 moments per parameter
MASTER_BYTES = 4  # fp32 master weights, when compute is not fp32


@dataclass(frozen=True, slots=True)
class Hardware:
    """A device's rates before calibration. Defaults: an H100 in bf16 at a realistic share of peak
    (40% of 989 TFLOP/s dense, 60% of 3.35 TB/s HBM), NCCL's per-call latency."""

    flops_per_second: float = 0.4 * 989e12
    bytes_per_second: float = 0.6 * 3.35e12
    collective_latency: float = 20e-6
    switch_latency: float = 2e-3  # a switch's fixed cost: the plan's agreement, packing, one call per slice

    @classmethod
    def cpu(cls) -> Hardware:
        """One CPU core per rank with gloo (about a millisecond per collective call, tens per switch)."""
        return cls(flops_per_second=30e9, bytes_per_second=5e9, collective_latency=1e-3, switch_latency=20e-3)


@dataclass(frozen=True, slots=True)
class Rates:
    """Seconds per unit of each kind of work (see the module doc), and the memory model's scales."""

    per_flop: float
    per_byte: float
    per_comm_second: float = 1.0  # measured / Topology-priced collective time
    per_collective: float = 20e-6
    per_micro_batch: float = 0.0  # fixed cost of running one graph (dispatch, Python)
    activation_scale: float = 1.0  # measured / modelled activation bytes of the blocks
    head_activation_scale: float = 1.0  # measured / modelled activation bytes of the LM head and loss
    graph_grad_scale: float = 1.0  # graph-held gradients, in units of one gradient per parameter
    per_switch: float = 2e-3  # fixed seconds of one switch between configs
    switch_scale: float = 1.0  # measured / planner-estimated seconds of a switch's transfers
    calibrated_on: int = 0  # measured micro-batches the rates were fitted to (0: Hardware defaults)
    switches_calibrated_on: int = 0  # measured switches `per_switch` and `switch_scale` were fitted to

    @classmethod
    def from_hardware(cls, hardware: Hardware) -> Rates:
        return cls(1 / hardware.flops_per_second, 1 / hardware.bytes_per_second,
                   per_collective=hardware.collective_latency, per_switch=hardware.switch_latency)

    def switch_seconds(self, planned_seconds: float) -> float:
        """A switch whose plan the planner estimates at `planned_seconds` (its transfers on the
        Topology's links): that scaled, plus the fixed cost every switch pays."""
        return self.per_switch + self.switch_scale * planned_seconds

    def seconds(self, work: Work) -> float:
        return (work.flops * self.per_flop + work.traffic_bytes * self.per_byte
                + work.comm_seconds * self.per_comm_second + work.collectives * self.per_collective
                + self.per_micro_batch)


@dataclass(frozen=True, slots=True)
class Work:
    """One rank's share of one micro-batch (the slowest pipeline stage's, for pp > 1)."""

    flops: float
    traffic_bytes: float
    comm_seconds: float  # collectives priced by the Topology's bandwidths (ring formulas)
    collectives: int
    activation_bytes: float  # kept for backward, this micro-batch: the blocks' ...
    head_activation_bytes: float = 0.0  # ... and the LM head's and loss's (logits over the vocabulary)

    def features(self, latency: float) -> tuple[float, ...]:
        """What `calibrate` fits a rate to: FLOPs, bytes, collective seconds with `latency` per call
        (one scale for both: they cannot be told apart from a few configs), and one per micro-batch."""
        return (self.flops, self.traffic_bytes, self.comm_seconds + latency * self.collectives, 1.0)


@dataclass(frozen=True, slots=True)
class Estimate:
    """A config at one length: the predicted time of that length's share of a step and the peak
    bytes per rank. `peak_bytes` is the config as a member of a hot-switched set (its weights,
    gradients and activations); the config holding the optimizer (the base) needs `optimizer_bytes`
    more (whole: ZeRO-1 divides it by the base's dp), and every config runs while the base's
    optimizer state stays resident."""

    config: DistConfig
    length: int
    rows: int  # rows of one micro-batch, all data-parallel replicas together
    micro_batches: int  # of this length in a step
    seconds: float
    peak_bytes: int
    optimizer_bytes: int
    compute_seconds: float  # of `seconds`: FLOPs, memory traffic and fixed costs
    comm_seconds: float  # of `seconds`: collectives and pipeline sends
    bubble_seconds: float = 0.0  # of `seconds`: pipeline fill and drain

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def standalone_bytes(self) -> int:
        """Peak per rank when this config alone trains (it is its own base)."""
        return self.peak_bytes + self.optimizer_bytes


def rows_per_replica(length: int, micro_batch_tokens: int) -> int:
    """Rows of `length` tokens per data-parallel replica in one micro-batch: the Trainer's rule
    (`train.data.rows_per_micro_batch` / dp), at least one."""
    return max(1, micro_batch_tokens // length)


# ---------------------------------------------------------------- parameters per rank


@lru_cache(maxsize=4096)
def params_per_rank(workload: Workload, tp: int, pp: int) -> int:
    """Parameters held by the busiest rank under tp x pp: the compiler's tp roles (sharded roles
    divided by tp), stages from `cluster.split_stages` (a tied embedding in the first and last)."""
    spec = describe_model(workload.model)
    c = spec.config
    kv_sharded = tp == 1 or heads_sharded(c.kv_heads, tp, (c.n_heads,))
    tied = c.tied_embeddings
    stage_of = {layer: s for s, (a, b) in enumerate(split_stages(spec, pp)) for layer in range(a, b)}
    per_stage = [0] * pp
    for p in spec.params:
        role = p.role
        if role in ("column", "row") or (role == "kv_column" and kv_sharded):
            n = p.numel // tp
        elif role == "embedding":  # vocab-parallel unless the compiler replicates it with the tied head
            n = p.numel // tp if workload.head_sharded or not tied else p.numel
        elif role == "head":
            n = p.numel // tp if workload.head_sharded else p.numel
        else:
            n = p.numel
        if p.layer is not None:
            stages = (stage_of[p.layer],)
        elif role in ("embedding", "position"):
            stages = (0, pp - 1) if role == "embedding" and tied and pp > 1 else (0,)
        else:
            stages = (pp - 1,)
        for s in set(stages):
            per_stage[s] += n
    return max(per_stage)


def stored_params(workload: Workload, config: DistConfig) -> int:
    """Parameters whose weights, gradients and optimizer state the busiest rank keeps: under fsdp
    the dp ranks share them (`distconfig.fsdp_dim`; the few a dp rank cannot split are ignored)."""
    params = params_per_rank(workload, config.tp, config.pp)
    return math.ceil(params / config.dp) if config.fsdp else params


def fsdp_unit_params(workload: Workload, config: DistConfig) -> int:
    """Under fsdp, the parameters one rank gathers for its largest unit (a block, or the embedding or
    head): what FSDP2 holds whole at once, twice while it prefetches the next unit."""
    spec = describe_model(workload.model)
    per_layer = int(spec.layer_params().max()) // config.tp
    outside = max((p.numel // (config.tp if p.role in ("embedding", "head") and workload.head_sharded else 1)
                   for p in spec.params if p.layer is None), default=0)
    return max(per_layer, outside)


# ---------------------------------------------------------------- work per micro-batch


def micro_batch_work(workload: Workload, config: DistConfig, length: int, rows: int, topology: Topology,
                     *, in_flight: int = 1, comm: CommProfile | None = None) -> Work:
    """One rank's work for a micro-batch of `rows` rows (per replica) of `length` tokens: the slowest
    stage's under pp > 1, and its activations with `in_flight` micro-batches held (pp > 1: 1F1B).
    `comm`: the collectives of the config's compiled ExecGraph (pp = 1), priced instead of the rules;
    or of its plain config (`space.plain`), priced with what fsdp and recomputation change by the rules."""
    c = workload.model
    h, a, kv, d, f, v = c.hidden, c.n_heads, c.kv_heads, c.head_dim, c.ffn_hidden, c.vocab_size
    e = workload.compute_bytes
    t, dp, pp, sp = config.tp, config.dp, config.pp, config.sp
    n = rows * length  # tokens per replica
    kv_div = t if t == 1 or heads_sharded(kv, t, (a,)) else 1
    head_div = t if workload.head_sharded else 1
    stream_div = t if sp else 1  # residual stream (norms, adds): sharded by sequence parallelism only
    mlp_mats = 3 if workload.gated_mlp else 2

    # per layer, forward + backward (3x forward for matmuls)
    scores = rows * a * length * length  # L x L attention scores of all heads
    flash = workload.flash_attention
    fused = flash or workload.fused_attention  # no L x L tensor written or kept
    forward_flops = (2 * n * h * 2 * h / t + 2 * n * h * 2 * kv * d / kv_div + 2 * n * h * f * mlp_mats / t
                     + 4 * scores * d / t / (2 if flash else 1))
    layer_traffic = e * (36 * n * h / stream_div + 10 * n * h / t + 12 * n * f / t + (0 if fused else 10 * scores / t))
    layer_act = e * (6 * n * h / stream_div + (6 * n * h + (mlp_mats + 1) * n * f) / t
                     + (0 if fused else 2 * scores / t))
    # activation recomputation (`compiler.recompute`): what a block keeps for its backward, and the
    # work of computing the rest again there
    recompute = config.recompute
    if recompute == "full":  # the block's input kept; its whole forward again, collectives included
        layer_flops = 4 * forward_flops
        layer_traffic *= 4 / 3
        kept = e * n * h / stream_div
        recomputed = layer_act  # one block's activations live again while its backward runs
    elif recompute == "selective":  # matmul and attention outputs kept; norms, activations recomputed
        layer_flops = 3 * forward_flops
        layer_traffic += e * (12 * n * h / stream_div + 4 * n * f / t)
        kept = e * (4 * n * h / stream_div + (4 * n * h + mlp_mats * n * f) / t)
        recomputed = layer_act - kept
    else:
        layer_flops = 3 * forward_flops
        kept, recomputed = layer_act, 0.0
    head_flops = 3 * 2 * n * h * v / head_div
    head_traffic = 10 * n * v * max(e, 4) / head_div  # the loss runs in fp32
    head_act = n * v * (e + 8) / head_div  # logits, their fp32 copy and log-softmax

    # the slowest stage: its layers, and the head when it is the last
    stages = split_stages(describe_model(c), pp)
    stage_cost = [(b - s) * layer_flops + (head_flops if i == pp - 1 else 0) for i, (s, b) in enumerate(stages)]
    slow = max(range(pp), key=stage_cost.__getitem__)
    layers = stages[slow][1] - stages[slow][0]
    last = slow == pp - 1
    flops = layers * layer_flops + (head_flops if last else 0)
    traffic = layers * layer_traffic + (head_traffic if last else 0)
    # activations of the first stage (it holds the most micro-batches in flight under 1F1B)
    first_layers = stages[0][1] - stages[0][0]
    act, act_head = in_flight * first_layers * kept + recomputed, head_act if pp == 1 else 0.0
    if pp > 1 and (stages[-1][1] - stages[-1][0]) * kept + recomputed + head_act > act:  # the last stage holds more
        act, act_head = (stages[-1][1] - stages[-1][0]) * kept + recomputed, head_act

    if comm is not None and pp == 1:
        seconds, count = comm.seconds(n, topology), len(comm.collectives)
        if comm.config != config.name:  # the plain config's collectives, and what the variant changes by the rules
            variant = micro_batch_work(workload, config, length, rows, topology, in_flight=in_flight)
            base = micro_batch_work(workload, plain(config), length, rows, topology, in_flight=in_flight)
            seconds = max(0.0, seconds + variant.comm_seconds - base.comm_seconds)
            count = max(0, count + variant.collectives - base.collectives)
        return Work(flops, traffic, seconds, count, act, act_head)
    comm_seconds, count = 0.0, 0
    message = n * h * e  # one activation of the residual stream, whole
    if t > 1:
        bw = link_bandwidth(topology, t)
        # per layer 2 all-reduces forward and 2 backward; SP replaces each by an all-gather and a
        # reduce-scatter: the same bytes (ring all-reduce = reduce-scatter + all-gather), twice the calls
        passes = 6 if recompute == "full" else 4  # full recomputation runs the forward's collectives again
        comm_seconds += layers * passes * 2 * (t - 1) / t * message / bw
        count += layers * passes * (2 if sp else 1)
        if stages[slow][0] == 0:  # the vocab-parallel embedding's partial output
            comm_seconds += 2 * (t - 1) / t * message / bw
            count += 1
    if config.fsdp:  # per unit: an all-gather before its forward and its backward, a reduce-scatter
        params = params_per_rank(workload, t, pp)
        bw = link_bandwidth(topology, dp * t)
        comm_seconds += 3 * (dp - 1) / dp * params * e / bw
        count += 3 * (c.n_layers + 3)  # the blocks, the embedding, the final norm and the head
    elif dp > 1 and pp == 1 and workload.reduce_every_micro_batch:  # inside every micro-batch's graph
        params = params_per_rank(workload, t, pp)
        grad_bytes = params * e
        comm_seconds += 2 * (dp - 1) / dp * grad_bytes / link_bandwidth(topology, dp * t)
        count += max(1, math.ceil(grad_bytes / BUCKET_BYTES))
    if pp > 1:  # the stage's activation received and sent, forward and backward
        bw = link_bandwidth(topology, dp * t * pp)
        comm_seconds += 2 * message / (t if sp else 1) / bw  # (sequence-sharded under SP)
        count += 2
    return Work(flops, traffic, comm_seconds, count, act, act_head)


# ---------------------------------------------------------------- estimates


def estimate(workload: Workload, config: DistConfig, length: int, tokens: int, topology: Topology, rates: Rates,
             *, micro_batch_tokens: int, comm: CommProfile | None = None) -> Estimate:
    """`config` training `tokens` tokens of `length`-token rows (one length's share of a step);
    `comm`: the config's ExecGraph collectives, when it has been compiled."""
    b = rows_per_replica(length, micro_batch_tokens)
    rows = config.dp * b
    micro_batches = max(1, math.ceil(math.ceil(tokens / length) / rows))
    in_flight = min(config.pp, micro_batches) if config.pp > 1 else 1
    work = micro_batch_work(workload, config, length, b, topology, in_flight=in_flight, comm=comm)
    per_micro = rates.seconds(work)
    comm = work.comm_seconds * rates.per_comm_second + work.collectives * rates.per_collective
    comm *= micro_batches
    bubble = 0.0
    if config.pp == 1:
        seconds = micro_batches * per_micro
    else:  # slots of the slowest stage
        bubble = (config.pp - 1) * per_micro
        seconds = (micro_batches + config.pp - 1) * per_micro
    params = stored_params(workload, config)
    e = workload.compute_bytes
    if config.dp > 1 and not config.fsdp and (config.pp > 1 or not workload.reduce_every_micro_batch):
        grad = 2 * (config.dp - 1) / config.dp * params * e  # one all-reduce per step
        reduce = grad / link_bandwidth(topology, config.world_size) * rates.per_comm_second + rates.per_collective
        seconds += reduce
        comm += reduce
    state = params * (e + GRAD_ACCUMULATOR_BYTES) + rates.graph_grad_scale * params * e
    if config.fsdp:  # two units gathered at once (FSDP2's prefetch), and one unit's gradients before their scatter
        state += 3 * fsdp_unit_params(workload, config) * e
    peak = state + rates.activation_scale * work.activation_bytes \
        + rates.head_activation_scale * work.head_activation_bytes
    optimizer = params * (ADAM_BYTES + (MASTER_BYTES if e != 4 else 0))
    return Estimate(config, length, rows, micro_batches, seconds, int(peak), int(optimizer),
                    compute_seconds=seconds - comm - bubble, comm_seconds=comm, bubble_seconds=bubble)


# AdamW per parameter per step: reads the gradient, the fp32 master and both moments, writes the master
# and both moments (7 fp32 passes); then every master is read again and cast to a compute weight
ADAMW_BYTES_PER_PARAM = 7 * 4
CAST_BYTES_PER_PARAM = 4  # + the compute weight's own bytes


def optimizer_seconds(workload: Workload, base: DistConfig, topology: Topology, rates: Rates, *,
                      zero1: bool = False) -> float:
    """The step's optimizer in the base config (the Trainer's `_optimizer_step`): AdamW over the
    base's parameters per rank, or 1/dp of them under ZeRO-1, which then all-gathers the updated fp32
    masters over the base's dp ranks; then the compute weights are cast from the masters. Memory-bound:
    priced by the calibrated `per_byte`. A base with dp = 1 has nothing for ZeRO-1 to split, and an
    fsdp base holds its share of every state already."""
    params = stored_params(workload, base)
    zero1 = zero1 and not base.fsdp
    split = base.dp if zero1 else 1
    seconds = params * (ADAMW_BYTES_PER_PARAM / split + CAST_BYTES_PER_PARAM + workload.compute_bytes) * rates.per_byte
    if zero1 and base.dp > 1:
        gathered = (base.dp - 1) / base.dp * params * 4
        seconds += gathered / link_bandwidth(topology, base.world_size) * rates.per_comm_second + rates.per_collective
    return seconds


# ---------------------------------------------------------------- calibration


def calibrate(workload: Workload, topology: Topology, probes: Sequence, configs: dict[str, DistConfig],
              base_rates: Rates, comm: Mapping[str, CommProfile] | None = None) -> Rates:
    """Rates fitted to measured micro-batches (`train.cost_model.Probe`s of pp = 1 configs: seconds of
    one micro-batch of `rows` rows, peak and state bytes per rank) by non-negative least squares.

    The time terms fitted are FLOPs, bytes, collectives and a constant per micro-batch; a collective is
    priced as its bytes over the link plus the defaults' latency per call, scaled together (at one
    micro-batch size the configs measured cannot tell bandwidth from latency apart). With at least as
    many timed probes as terms (4), all are fitted; with fewer, the defaults' prediction is scaled.
    Memory: the graph-held gradients, the blocks' and the
    head's activations are fitted to (peak - state) the same way (from three probes). Probes of
    configs not in `configs` are ignored. `comm`: config name -> its ExecGraph's collectives, priced
    instead of the rules for those configs (as `estimate` then prices them). A probe with
    `collectives_free` (a rank profiled in a fake process group, `runtime.profile`) timed compute
    only; when every probe is such, the collective rates are kept as given."""
    timed, sized = [], []
    for p in probes:
        config = configs.get(p.config)
        if config is None or config.pp != 1:
            continue
        work = micro_batch_work(workload, config, p.length, p.rows // config.dp, topology,
                                comm=(comm or {}).get(p.config))
        params = stored_params(workload, config)
        sized.append(((params * workload.compute_bytes, work.activation_bytes, work.head_activation_bytes),
                      p.peak_bytes - p.state_bytes))
        if p.seconds is not None:
            free = getattr(p, "collectives_free", False)
            timed.append((replace(work, comm_seconds=0.0, collectives=0) if free else work, p.seconds))
    rates = base_rates
    if timed:
        latency = rates.per_collective / rates.per_comm_second
        x = np.array([w.features(latency) for w, _ in timed])
        y = np.array([s for _, s in timed])
        comm_seen = bool(x[:, 2].any())  # else every probe ran in a fake process group: keep the comm rates
        terms = [0, 1, 2, 3] if comm_seen else [0, 1, 3]
        if len(timed) >= len(terms):
            coef = dict(zip(terms, _nnls(x[:, terms], y)))
            rates = replace(rates, per_flop=coef[0], per_byte=coef[1], per_micro_batch=coef[3])
            if comm_seen:
                rates = replace(rates, per_comm_second=coef[2], per_collective=coef[2] * latency)
        else:
            predicted = np.array([rates.seconds(w) for w, _ in timed])
            scale = float(predicted @ y / (predicted @ predicted))
            rates = replace(rates, per_flop=rates.per_flop * scale, per_byte=rates.per_byte * scale,
                            per_micro_batch=rates.per_micro_batch * scale)
            if comm_seen:
                rates = replace(rates, per_comm_second=rates.per_comm_second * scale,
                                per_collective=rates.per_collective * scale)
        rates = replace(rates, calibrated_on=len(timed))
    if len(sized) >= 3:
        coef = _nnls(np.array([s for s, _ in sized], dtype=float), np.array([m for _, m in sized], dtype=float))
        rates = replace(rates, graph_grad_scale=coef[0], activation_scale=coef[1], head_activation_scale=coef[2])
    return rates


def calibrate_switches(rates: Rates, measured: Sequence[tuple[float, float]]) -> Rates:
    """`per_switch` and `switch_scale` fitted to measured switches, given as (the planner's estimate of
    the switch, its measured seconds) pairs, by non-negative least squares on (1, estimate). With one
    pair, or estimates that do not differ, only the fixed cost is fitted."""
    if not measured:
        return rates
    planned = np.array([p for p, _ in measured], dtype=float)
    seconds = np.array([s for _, s in measured], dtype=float)
    if len(measured) >= 2 and np.ptp(planned) > 0:
        per_switch, scale = _nnls(np.stack([np.ones_like(planned), planned], axis=1), seconds)
    else:
        per_switch, scale = max(0.0, float(np.mean(seconds - rates.switch_scale * planned))), rates.switch_scale
    return replace(rates, per_switch=float(per_switch), switch_scale=float(scale), switches_calibrated_on=len(measured))


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min ||x c - y|| over c >= 0 (Lawson-Hanson's active set, on unit-norm columns)."""
    norms = np.linalg.norm(x, axis=0)
    norms[norms == 0] = 1.0
    a = x / norms
    k = a.shape[1]
    passive = np.zeros(k, dtype=bool)
    c = np.zeros(k)
    for _ in range(3 * k):
        grad = a.T @ (y - a @ c)
        candidates = np.where(~passive & (grad > 1e-12 * max(1.0, np.abs(grad).max())))[0]
        if not len(candidates):
            break
        passive[candidates[np.argmax(grad[candidates])]] = True
        while True:
            z = np.zeros(k)
            z[passive] = np.linalg.lstsq(a[:, passive], y, rcond=None)[0]
            if (z[passive] > 0).all():
                c = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(c[neg] / (c[neg] - z[neg] + 1e-300))
            c = c + alpha * (z - c)
            passive &= c > 1e-15
    return c / norms
