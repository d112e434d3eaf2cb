"""The end of a training program: how its outputs become results (`OutputPlan`, `StageOutputPlan`).

Partial gradients are all-reduced in buckets (DDP's, in reverse order, the loss parts riding with
the first), divided once by the loss denominator and redistributed into their parameters'
layouts; a pipeline stage's sent values go into their neighbour's layout. Written once, run two
ways (`OnTensors` traced by make_fx, `OnProgram` emitted into a program under construction),
and as a program of its own for micro-batches (`lower_reduction`).
"""
from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from . import _dtensor as dt
from ._torch import (
    ancestors,
    codeless_modules,
    pytree,
    with_code,
)
from .fsdp import is_scattered, reduce_scatter_unit
from .sharding import GraphSharding

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size

@dataclass(frozen=True)
class OutputPlan:
    """How the graph's outputs become the ExecGraph's results."""

    split_loss: bool
    num_losses: int  # 2 when (num, den), else 1
    param_specs: tuple  # the layout every gradient must end in (empty for a forward-only graph)
    # fsdp (`compiler.fsdp`): the gradients of each unit (parameter indices, the last unit's first:
    # the backward's order), reduce-scattered together over mesh dim `dp_dim` into their shards
    units: tuple[tuple[int, ...], ...] = ()
    dp_dim: int | None = None

@dataclass(frozen=True)
class StageOutputPlan:
    """Outputs of a pipeline stage's graph (or of one micro-batch's graph under pp=1).

    Values sent to a neighbouring stage (activations forward, their gradients backward) are
    redistributed into the layout the neighbour takes them in (`sent`: output index -> spec). The
    loss parts and the parameter gradients are returned as propagation left them (partial over the
    data-parallel axis, some over the tensor-parallel one): the runtime sums them over the step's
    micro-batches and reduces them once, with `lower_reduction`, the way DDP's `no_sync` defers its
    all-reduce to the last micro-batch.
    """

    forward_outputs: tuple[int, ...]  # outputs the forward pass computes (phase tagging)
    sent: tuple[tuple[int, Any], ...] = ()  # (output index, DTensorSpec it must end in)

def output_finisher(graph: fx.Graph, sharding: GraphSharding, out_plan: OutputPlan | StageOutputPlan, mesh,
                    bucket_bytes: int):
    """Tags `graph`'s phases for `out_plan` and returns what turns its output values (local tensors,
    in the output's order) into the program's results."""
    if isinstance(out_plan, StageOutputPlan):
        _tag_phases(graph, out_plan.forward_outputs)
        return lambda leaves: _finish_stage(leaves, sharding.output_specs, out_plan)
    _tag_phases(graph, out_plan.num_losses)
    return lambda leaves: finish_outputs(leaves, sharding.output_specs, out_plan, mesh, bucket_bytes)

def _tag_phases(graph: fx.Graph, forward_outputs: int | tuple[int, ...]) -> None:
    """Tag nodes (meta['custom']['phase']): 'forward' if the loss (the first `forward_outputs`
    outputs, or those at the given indices) depends on them, else 'backward'."""
    out = next(n for n in graph.nodes if n.op == "output")
    leaves = pytree.tree_leaves(out.args[0])
    indices = range(forward_outputs) if isinstance(forward_outputs, int) else forward_outputs
    forward = ancestors([leaves[i] for i in indices])
    for n in graph.nodes:
        phase = "reduce" if n.op == "output" else "forward" if n in forward else "backward"
        n.meta["custom"] = {**n.meta.get("custom", {}), "phase": phase, "source": n.name}

def _partial_dims(spec) -> tuple[int, ...]:
    return tuple(i for i, p in enumerate(spec.placements) if p.is_partial())

def gradient_buckets(leaves, specs, num_losses: int, bucket_bytes: int,
                     skip: frozenset[int] = frozenset()) -> dict[tuple, list[list[int]]]:
    """The gradient buckets of a program's end: per set of partial mesh dims, lists of output
    indices, gradients in reverse order (the backward produces the last layers first). The loss
    numerator and denominator ride along with the first bucket of their kind, so that every
    gradient is final (divided by the global denominator) once its own bucket is reduced.
    `leaves`: the outputs' local values (tensors or meta tensors); `skip`: outputs reduced otherwise
    (fsdp's reduce-scattered gradients, `scattered_units`)."""
    order = list(range(num_losses)) + [i for i in range(len(leaves))[num_losses:][::-1] if i not in skip]
    groups: dict[tuple, list[list[int]]] = {}
    for i in order:
        dims = _partial_dims(specs[i])
        if not dims:
            continue
        buckets = groups.setdefault(dims, [[]])
        size = sum(leaves[j].numel() * leaves[j].element_size() for j in buckets[-1])
        holds_grads = any(j >= num_losses for j in buckets[-1])  # never the loss parts alone
        if holds_grads and size + leaves[i].numel() * leaves[i].element_size() > bucket_bytes and i >= num_losses:
            buckets.append([])
        buckets[-1].append(i)
    return groups

class OnTensors:
    """`finish_outputs`'s operations on tensors (local values, traced by make_fx: `lower_reduction`)."""

    value = staticmethod(lambda x: x)
    flat = staticmethod(lambda x: x.reshape(-1))
    cat = staticmethod(torch.cat)
    split = staticmethod(lambda x, sizes: x.split(sizes))
    view = staticmethod(lambda x, shape: x.view(shape))
    redistribute = staticmethod(dt.redistribute)
    to = staticmethod(lambda x, dtype: x.to(dtype))
    div = staticmethod(operator.truediv)

    @staticmethod
    def all_reduce(x, mesh, dim: int):
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(x, "sum", (mesh, dim))

    @staticmethod
    def traced(key, fn, inputs):
        return fn(*inputs)

class OnProgram:
    """`finish_outputs`'s operations emitted into a program under construction, by its builder: the nodes
    make_fx would trace from `OnTensors`, each value from its op's meta kernel (tracing the end of
    an 8-layer model through make_fx was a fifth of lowering it). For outputs a flat view can read
    (`takes`); others are traced."""

    def __init__(self, program, source: fx.Node):  # program: a `lower._ProgramBuilder`
        self.program, self.source = program, source

    @staticmethod
    def takes(leaves) -> bool:
        def flattens(v) -> bool:
            try:
                v.view(-1)  # as reshape(-1) does, without a copy
            except RuntimeError:
                return False
            return True
        return all(isinstance(v, fx.Node) and isinstance(v.meta.get("val"), torch.Tensor) and flattens(v.meta["val"])
                   for v in leaves)

    def _call(self, target, *args, **kwargs) -> fx.Node:
        return self.program.call(target, args, kwargs, self.source)

    def value(self, x: fx.Node) -> torch.Tensor:
        return x.meta["val"]

    def flat(self, x):
        return self._call(aten.view.default, x, [-1])

    def cat(self, xs):
        return self._call(aten.cat.default, list(xs))

    def split(self, x, sizes):
        parts = self._call(aten.split_with_sizes.default, x, list(sizes))
        return [self.program.getitem(parts, i, self.source) for i in range(len(sizes))]

    def view(self, x, shape):
        return self._call(aten.view.default, x, list(shape))

    def redistribute(self, x, have, want):
        return self.program.redistribute(x, have, want, self.source)

    def to(self, x, dtype):
        return x if x.meta["val"].dtype == dtype else self._call(aten._to_copy.default, x, dtype=dtype)

    def div(self, x, y):
        return self._call(aten.div.Tensor, x, y)

    def traced(self, key, fn, inputs):
        """`fn(*inputs)` traced by make_fx (once per `key`) and copied in (`_ProgramBuilder.inline`)."""
        return self.program.inline(key, fn, list(inputs), self.source)

    def all_reduce(self, x, mesh, dim: int):
        # the collective's value is its input's shape: no kernel to run for it
        group = mesh.get_group(dim).group_name
        reduced = self.program.emit(c10d.all_reduce.default, (x, "sum", group), x.meta["val"], self.source)
        return self.program.emit(c10d.wait_tensor.default, (reduced,), x.meta["val"], self.source)

def finish_outputs(leaves, specs, plan: OutputPlan, mesh, bucket_bytes, ops=OnTensors):
    """Reduce partial outputs in buckets, divide by the loss denominator, put grads in param layout.
    `ops`: on tensors (traced), or emitted into a program (`OnProgram`)."""
    reduced = list(leaves)
    final_specs = [
        dt.spec(s.mesh, tuple(dt.Replicate() if p.is_partial() else p for p in s.placements), s.tensor_meta)
        for s in specs
    ]
    scattered = scattered_units(specs, plan)
    for unit in scattered:  # fsdp: one reduce-scatter per unit, into the gradients' shards
        wants = [plan.param_specs[i - plan.num_losses] for i in unit]
        key = ("fsdp scatter", id(mesh), tuple(specs[i] for i in unit), tuple(wants))
        outs = ops.traced(key, reduce_scatter_unit([specs[i] for i in unit], wants, plan.dp_dim),
                          [leaves[i] for i in unit])
        for i, out, want in zip(unit, outs, wants):
            reduced[i], final_specs[i] = out, want
    skip = frozenset(i for unit in scattered for i in unit)
    for dims, buckets in gradient_buckets([ops.value(v) for v in leaves], specs, plan.num_losses, bucket_bytes,
                                          skip).items():
        for bucket in buckets:
            flat = ops.cat([ops.flat(leaves[i]) for i in bucket])
            for d in dims:
                flat = ops.all_reduce(flat, mesh, d)
            for i, piece in zip(bucket, ops.split(flat, [ops.value(leaves[i]).numel() for i in bucket])):
                reduced[i] = ops.view(piece, ops.value(leaves[i]).shape)
    losses, grads = reduced[: plan.num_losses], reduced[plan.num_losses:]
    for k, (g, have, want) in enumerate(zip(grads, final_specs[plan.num_losses:], plan.param_specs)):
        if have.placements != want.placements:
            grads[k] = ops.redistribute(g, have, want)
    if plan.split_loss:
        num, den = losses
        den = ops.to(den, ops.value(num).dtype)
        return (ops.div(num, den), *[ops.div(g, den) for g in grads])
    return (losses[0], *grads)

def scattered_units(specs, plan: OutputPlan) -> list[list[int]]:
    """Per fsdp unit (`plan.units`, in order), the output indices of its gradients that are
    reduce-scattered (partial over dp, stored sharded over it: `fsdp.is_scattered`)."""
    out = []
    for unit in plan.units:
        indices = [plan.num_losses + k for k in unit
                   if is_scattered(specs[plan.num_losses + k], plan.param_specs[k], plan.dp_dim)]
        if indices:
            out.append(indices)
    return out


def _finish_stage(leaves, specs, plan: StageOutputPlan):
    out = list(leaves)
    for i, want in plan.sent:
        if specs[i].placements != want.placements:
            out[i] = dt.redistribute(out[i], specs[i], want)
    return tuple(out)

def lower_reduction(specs: list, plan: OutputPlan, mesh: dt.DeviceMesh, local_examples: list[torch.Tensor],
                    bucket_bytes: int = BUCKET_BYTES) -> fx.GraphModule:
    """The once-per-step reduction of values summed over micro-batches, as a graph of its own.

    Inputs: the loss parts and gradients a StageOutputPlan left unreduced, with their `specs`;
    outputs what the end of a training graph gives: (loss, *grads in their parameter layouts).
    The same buckets, division by the loss denominator and redistribution as `lower` emits. A
    pipeline stage without the loss passes only the denominator (`plan.num_losses == 1` and
    `plan.split_loss`): it gets (den, *grads / den).
    """
    den_only = plan.split_loss and plan.num_losses == 1

    def run(*leaves):
        if not den_only:
            return finish_outputs(list(leaves), specs, plan, mesh, bucket_bytes)
        den, *grads = finish_outputs(list(leaves), specs, OutputPlan(False, 1, plan.param_specs), mesh, bucket_bytes)
        return (den, *[g / den.to(g.dtype) for g in grads])

    with warnings.catch_warnings(), codeless_modules():  # its code is written once, edited
        warnings.simplefilter("ignore")
        gm = make_fx(run, tracing_mode="fake")(*local_examples)
    for node in gm.graph.nodes:
        node.meta["custom"] = {**node.meta.get("custom", {}), "phase": "reduce"}
    gm.graph.eliminate_dead_code()
    return with_code(gm)

