"""Pipeline parallelism at run time: lowered stage programs, micro-batches, GPipe and 1F1B.

A config with pp > 1 runs `pp` stages (compiler/stages.py cuts the LogicGraph), each on a (dp, tp)
sub-mesh of the config's (pp, dp, tp) mesh. Each rank lowers only its own stage's joint graph, with
the same propagation and lowering as every other config, into a *forward* and a *backward* program
(compiler.stages.split_forward_backward); the last stage's joint graph runs whole at its forward,
because its backward needs nothing from another stage. Ranks with the same (dp, tp) coordinate form
one pipeline; between neighbours the activations go forward and their gradients backward by
point-to-point send/recv, each tensor in the layout the receiving stage expects (batch dim sharded
over dp, replicated over tp, or sharded on the sequence dim under sequence parallelism).

**One step.** The local batch is cut into micro-batches (dim 0, torch.tensor_split sizes). The loss
numerator, its denominator and the parameter gradients of each micro-batch are summed *unreduced*;
after the last micro-batch one reduction program per stage (`compiler.lower.lower_reduction`) does
the data-parallel all-reduce (bucketed), the division by the global denominator and the
redistribution into the parameter layouts: one gradient reduction per step, not per micro-batch, and
the result equals one step on the whole batch exactly, whatever the micro-batches' token counts.
pp = 1 with several micro-batches is the same machinery with one stage and no sends.

**Why our own schedule, not torch.distributed.pipelining's.** Its `PipelineStage` can run our
programs (an nn.Module whose forward is an autograd.Function over the lowered graphs), but it fixes
one tensor shape for all micro-batches: its receive buffers are allocated once per stage from one
metadata record (given statically, or inferred by running a real forward and backward of the first
micro-batch). Our data parallelism splits batches unevenly (torch.chunk semantics: a batch of 5 on
dp = 2 is 3 + 2 rows) and so do micro-batches, so the shapes differ between micro-batches, between
steps and between the data-parallel pipelines of one step. Here every rank derives each micro-batch's
receive shapes from its own lowered program, no metadata is exchanged, and the schedule is the
loop below: GPipe (all forwards, then all backwards) and 1F1B in Megatron's form (pp - stage - 1
warm-up forwards, then one forward and one backward alternately, then the remaining backwards).
Sends are non-blocking (`isend`, waited for at the end of the step) and receives block right before
the computation that needs them, so any order in which a value's producer runs before its consumer
is free of deadlock.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import sympy
import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils import _pytree as pytree

from compiler import _dtensor as dt
from compiler.lower import OutputPlan, StageOutputPlan, lower, lower_reduction, propagate_graph
from compiler.stages import Stage, split_forward_backward, stage_joint
from compiler.tp_rules import param_views
from compiler.trace import LogicGraph

SCHEDULES = ("1f1b", "gpipe")


@dataclass
class StageProgram:
    """This rank's lowered programs for one stage and one micro-batch shape.

    Training, not the last stage: forward (params, buffers, inputs, acts in) -> (acts out..., den,
    saved...), backward (saved..., grads of acts out) -> (param grads..., grads of acts in...).
    Training, last stage (or pp = 1): forward -> (num, den, param grads..., grads of acts in...).
    Forward only: forward -> (acts out..., den) or, last, (num, den).
    """

    joint: fx.GraphModule  # the whole lowered graph, before the forward/backward cut
    forward: fx.GraphModule
    backward: fx.GraphModule | None
    train: bool
    is_last: bool
    n_acts_out: int
    n_losses: int  # 2 (num, den) on the last stage, 1 (den) elsewhere
    n_params: int
    send_grads: tuple[bool, ...]  # per act in: is a gradient sent back for it (floating point)
    recv_acts: list[tuple[tuple[int, ...], torch.dtype]]
    recv_grads: list[tuple[tuple[int, ...], torch.dtype]]
    deferred_specs: list  # DTensorSpecs of (losses..., param grads...) as the program returns them
    param_specs: list  # DTensorSpecs of the stage's parameters
    seconds: float = 0.0


@dataclass
class StepStats:
    """What one pipelined step did on this rank (for tests and benchmarks)."""

    schedule: str
    micro_batches: int
    stage: int
    num_stages: int
    order: list[str] = field(default_factory=list)  # "F0", "B0", ... in execution order
    sends: int = 0
    recvs: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0


def _concrete(size, values: dict) -> int:
    if isinstance(size, torch.SymInt):
        return int(sympy.sympify(size.node.expr).subs(values))
    return int(size)


def lower_stage(logic: LogicGraph, stage: Stage | None, st, buffers: list[torch.Tensor], local_shapes: tuple,
                input_dtypes: list[torch.dtype], *, train: bool, strict: bool = True) -> StageProgram:
    """Lower one stage (None: the whole model, pp = 1) for micro-batches of `local_shapes` (this
    rank's rows) on the stage's (dp, tp) mesh `st.mesh`."""
    t0 = time.perf_counter()
    if stage is None:
        graph, param_names, n_out, is_last = (logic.joint if train else logic.forward).graph, logic.param_names, 0, True
    else:
        graph = (stage_joint(logic, stage) if train else stage.forward).graph
        param_names, n_out, is_last = stage.param_names, len(stage.acts_out), stage.is_last
    mesh, axis, config = st.mesh, st.axis, st.config
    ndim, dp = mesh.ndim, config.dp
    virtual = [(s[0] * dp, *s[1:]) for s in local_shapes]  # see CompiledModel._virtual_shapes
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    n_p, n_b, n_i = len(param_names), len(buffers), logic.num_inputs
    inputs = phs[n_p + n_b:n_p + n_b + n_i]
    boundary = phs[n_p + n_b + n_i:]
    values, batch_syms, seq_sym = {}, set(), None
    for ph, shape in zip(inputs, virtual):
        val = ph.meta["val"]
        for d, s in enumerate(val.shape):
            if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol):
                values[s.node.expr] = shape[d]
                if d == 0:
                    batch_syms.add(s.node.expr)
                if d == 1 and seq_sym is None and val.dim() >= 2:
                    seq_sym = s.node.expr

    def boundary_spec(val) -> dt.DTensorSpec:
        shape = tuple(_concrete(s, values) for s in val.shape)
        placements = [dt.Replicate()] * ndim
        if dp > 1 and "dp" in axis and val.dim() and isinstance(val.shape[0], torch.SymInt) \
                and val.shape[0].node.expr.free_symbols & batch_syms:
            placements[axis["dp"]] = dt.Shard(0)
        if config.sp and "tp" in axis:
            seq = [d for d, s in enumerate(val.shape) if isinstance(s, torch.SymInt) and s.node.expr == seq_sym]
            if seq:
                placements[axis["tp"]] = dt.Shard(seq[0])
        return dt.make_spec(mesh, placements, torch.empty(shape, dtype=val.dtype, device="meta"))

    specs = [dt.make_spec(mesh, st.param_specs[n], torch.empty(logic.param_shapes[n], dtype=logic.param_dtypes[n], device="meta"))
             for n in param_names]
    specs += [dt.make_spec(mesh, (dt.Replicate(),) * ndim, b.to("meta")) for b in buffers]
    for shape, dtype in zip(virtual, input_dtypes):
        placements = [dt.Replicate()] * ndim
        if dp > 1 and "dp" in axis:
            placements[axis["dp"]] = dt.Shard(0)
        specs.append(dt.make_spec(mesh, placements, torch.empty(shape, dtype=dtype, device="meta")))
    specs += [boundary_spec(ph.meta["val"]) for ph in boundary]
    n_acts_in = len(stage.acts_in) if stage is not None else 0
    sharding = propagate_graph(graph, mesh, specs, sp_axis=axis.get("tp") if config.sp else None, seq_symbol=seq_sym,
                               pinned_nodes=param_views(graph, n_p), strict=strict)
    out_vals = [n.meta["val"] for n in _leaves(graph)]
    n_losses = 2 if is_last else 1
    sent = [(i, boundary_spec(out_vals[i])) for i in range(n_out)]  # activations, in the next stage's layout
    if train:
        first_grad_in = n_out + n_losses + n_p
        sent += [(first_grad_in + k, specs[n_p + n_b + n_i + k]) for k in range(n_acts_in)]
    plan = StageOutputPlan(forward_outputs=tuple(range(n_out + n_losses)), sent=tuple(sent))
    local = [torch.empty(dt.local_shape(s), dtype=s.tensor_meta.dtype) for s in specs]
    gm = lower(graph, sharding, local, plan, mesh)
    gm.meta["hotswitch"] = {"config": config.name, "stage": stage.index if stage is not None else 0,
                            "local_shapes": local_shapes, "sharding": sharding}
    recv_acts = [(tuple(t.shape), t.dtype) for t in local[n_p + n_b + n_i:n_p + n_b + n_i + n_acts_in]]
    recv_grads = [(tuple(t.shape), t.dtype) for t in local[n_p + n_b + n_i + n_acts_in:]]
    forward, backward = gm, None
    if train and recv_grads:
        forward, backward, _ = split_forward_backward(gm, len(recv_grads), plan.forward_outputs)
    deferred = list(range(n_out, n_out + n_losses)) + (list(range(n_out + n_losses, n_out + n_losses + n_p)) if train else [])
    return StageProgram(
        joint=gm, forward=forward, backward=backward, train=train, is_last=is_last, n_acts_out=n_out,
        n_losses=n_losses, n_params=n_p, send_grads=tuple(dtype.is_floating_point for _, dtype in recv_acts),
        recv_acts=recv_acts, recv_grads=recv_grads, deferred_specs=[sharding.output_specs[i] for i in deferred],
        param_specs=specs[:n_p], seconds=time.perf_counter() - t0)


def _leaves(graph: fx.Graph) -> list[fx.Node]:
    out = next(n for n in graph.nodes if n.op == "output")
    return pytree.tree_leaves(out.args[0])


def schedule_order(schedule: str, stage: int, num_stages: int, micro_batches: int, train: bool = True) -> list[tuple[str, int]]:
    """The order of this stage's forward ("F", i) and backward ("B", i) passes."""
    k = micro_batches
    if not train:
        return [("F", i) for i in range(k)]
    if schedule == "gpipe":
        return [("F", i) for i in range(k)] + [("B", i) for i in range(k)]
    if schedule == "1f1b":
        warmup = min(num_stages - stage - 1, k)
        order = [("F", i) for i in range(warmup)]
        for i in range(k - warmup):
            order += [("F", warmup + i), ("B", i)]
        return order + [("B", i) for i in range(k - warmup, k)]
    raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")


def run_step(programs: list[StageProgram], params: list[torch.Tensor], buffers: list[torch.Tensor],
             micro_inputs: list[tuple[torch.Tensor, ...]], *, stage: int, num_stages: int, prev_rank: int | None,
             next_rank: int | None, schedule: str, accumulate_dtype: torch.dtype | None = None):
    """Run this rank's part of one step: every micro-batch's forward and (training) backward in
    the schedule's order, with the point-to-point exchanges. Returns (sums of the deferred outputs
    - loss parts, then parameter gradients - over the micro-batches, StepStats)."""
    t0 = time.perf_counter()
    k = len(micro_inputs)
    train = programs[0].train
    stats = StepStats(schedule if num_stages > 1 and train else "sequential", k, stage, num_stages)
    works: list = []
    sums: list[torch.Tensor] | None = None
    pending: dict[int, tuple] = {}

    def send(tensors, peer):
        for t in tensors:
            t = t.contiguous()
            works.append((dist.isend(t, dst=peer), t))
            stats.sends += 1
            stats.bytes_sent += t.numel() * t.element_size()

    def recv(metas, peer):
        out = []
        for shape, dtype in metas:
            t = torch.empty(shape, dtype=dtype)
            dist.recv(t, src=peer)
            stats.recvs += 1
            out.append(t)
        return out

    def add(values):
        nonlocal sums
        if sums is None:
            sums = [v.detach().to(accumulate_dtype) if accumulate_dtype is not None and v.is_floating_point() else v.detach().clone()
                    for v in values]
        else:
            for s, v in zip(sums, values):
                s.add_(v)

    for kind, i in schedule_order(schedule, stage, num_stages, k, train):
        p = programs[i]
        stats.order.append(f"{kind}{i}")
        if kind == "F":
            acts = recv(p.recv_acts, prev_rank) if prev_rank is not None and p.recv_acts else []
            outs = p.forward(*params, *buffers, *micro_inputs[i], *acts)
            sent = outs[:p.n_acts_out]
            if sent:
                send(sent, next_rank)
            if not train:
                add(outs[p.n_acts_out:p.n_acts_out + p.n_losses])
            elif p.backward is None:  # last stage: its joint graph ran whole
                losses = outs[:p.n_losses]
                grads = outs[p.n_losses:p.n_losses + p.n_params]
                pending[i] = (list(losses) + list(grads), outs[p.n_losses + p.n_params:])
            else:
                pending[i] = (list(outs[p.n_acts_out:p.n_acts_out + p.n_losses]), outs[p.n_acts_out + p.n_losses:])
        else:
            deferred, rest = pending.pop(i)
            if p.backward is None:
                grads_in = rest
            else:
                grads_out = recv(p.recv_grads, next_rank) if next_rank is not None else []
                back = p.backward(*rest, *grads_out)
                deferred = deferred + list(back[:p.n_params])
                grads_in = back[p.n_params:]
            add(deferred)
            if prev_rank is not None:
                send([g for g, ok in zip(grads_in, p.send_grads) if ok], prev_rank)
    for work, _ in works:
        work.wait()
    stats.seconds = time.perf_counter() - t0
    return sums, stats


def reduction_for(st, program: StageProgram, sums: list[torch.Tensor]) -> fx.GraphModule:
    """The stage's once-per-step reduction program (cached on the config state per layout)."""
    key = (program.train, program.n_losses, tuple(s.placements for s in program.deferred_specs),
           tuple((tuple(t.shape), t.dtype) for t in sums))
    if key not in st.reductions:
        plan = OutputPlan(split_loss=True, num_losses=program.n_losses, param_specs=tuple(program.param_specs) if program.train else ())
        st.reductions[key] = lower_reduction(program.deferred_specs, plan, st.mesh, [torch.empty_like(t) for t in sums])
    return st.reductions[key]
