"""Sharding propagation over a joint graph and lowering to one rank's ExecGraph.

Two steps, kept apart so the first can be inspected and tested on its own:

1. `propagate_graph`: walk the graph in order with DTensorSpecs built from global shapes. Each op
   asks DTensor's strategy for that op which input placements it needs and which output placement
   it gives; parameters (and views of them) are pinned to the layout the config gave them. A
   `Partial` result is reduced where it is produced (all-reduce, or reduce-scatter onto the sequence
   dim under sequence parallelism), except when its only consumers are additions of other partial
   values (then the sum is reduced, once) or the graph's outputs: that yields Megatron's collectives
   (one reduction after q/k/v's input-gradients are summed, not three) and leaves gradients partial
   for the buckets.
2. `lower`: those decisions become this rank's program, built node by node on its local shapes
   (each op's meta kernel gives them), every collective an explicit functional-collective node of
   the GraphModule (DTensor's redistributions, traced by make_fx and copied in); the data-
   parallel gradient reduction is emitted last, bucketed, followed by the division by the loss
   denominator and the redistribution of every gradient into its parameter's layout.
"""
from __future__ import annotations

import copy
import operator
import warnings
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from . import _dtensor as dt
from . import attention as _attention
from . import handoff
from ._dtensor import OpSchema
from ._torch import (
    FakeTensorMode,
    OpOverload,
    add_node,
    arg_leaves,
    codeless_module,
    codeless_modules,
    copy_node,
    graph_module,
    map_args,
    meta_like,
    op_schema,
    pytree,
    with_code,
)
from .tp_rules import SIZED_VIEW_OPS, VIEW_OPS
from .uniform import uniform_dims

_attention.register()  # the attention ops' rules (masked, document), beside DTensor's for aten ops

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

_DROP_OPS = {aten._assert_tensor_metadata.default, aten._assert_scalar.default}
_SYM_OPS = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int, aten.sym_storage_offset.default}
_LIKE_OPS = {aten.ones_like.default, aten.zeros_like.default, aten.full_like.default, aten.empty_like.default}
# Ops whose result depends on no input value: their placement is free (a local chunk of a fresh tensor).
_FRESH_OPS = _LIKE_OPS | {aten.new_zeros.default, aten.new_empty.default, aten.new_full.default,
                          aten.new_ones.default, aten.zeros.default, aten.full.default, aten.empty.memory_format,
                          aten.ones.default, aten.scalar_tensor.default}
_ADD_OPS = {aten.add.Tensor, aten.sub.Tensor}
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


class ShardingError(ValueError):
    """An op that DTensor's strategies cannot shard; the message names the node and its source line."""


def source_line(node: fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    # the user's frame is the last "File ..." line not inside torch
    frames = [
        (lines[i], lines[i + 1] if i + 1 < len(lines) else "") for i, ln in enumerate(lines) if ln.startswith("File ")
    ]
    frames = [f for f in frames if "/torch/" not in f[0]] or frames
    return f"{frames[-1][0]}: {frames[-1][1]}" if frames else "(no source line recorded)"


@dataclass
class Decision:
    kind: str  # "const" | "drop" | "getitem" | "op" | "placeholder"
    value: Any = None
    tensor_nodes: list = field(default_factory=list)
    in_specs: list = field(default_factory=list)
    want_specs: list = field(default_factory=list)
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    out_spec: Any = None  # spec (or tuple of specs) the op produces
    reduce_to: Any = None  # spec after the eager Partial reduction, if any
    # chosen by DTensor's strategy search with the op's own arguments: its placements alone say what
    # to do at another input shape (`ShardingDecisions`), no search needed
    replayable: bool = False
    encoded: Any = field(default=..., repr=False, compare=False)  # `_encoded(self)`, once known (...: not yet)

    @property
    def spec(self):
        return self.reduce_to if self.reduce_to is not None else self.out_spec


def _is_tensor_node(a) -> bool:
    return isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


def _has_partial(spec) -> bool:
    return isinstance(spec, dt.DTensorSpec) and any(p.is_partial() for p in spec.placements)


def _view_source(node: fx.Node) -> fx.Node:
    while isinstance(node, fx.Node) and node.target in VIEW_OPS:
        node = node.args[0]
    return node


@dataclass
class GraphSharding:
    decisions: dict[fx.Node, Decision]
    output_specs: list
    keep_partial: frozenset = frozenset()  # nodes whose Partial values stay unreduced
    replayed: int = 0  # decisions taken from `ShardingDecisions` instead of DTensor's search
    searched: tuple[str, ...] = ()  # nodes DTensor's strategy search decided (their decisions are replayable)

    def placements(self) -> ShardingDecisions:
        """What was decided, without shapes: per searched op, the placements it wants its tensor
        inputs in and the placements it produces."""
        ops = {node.name: _encoded(d) for node, d in self.decisions.items() if d.kind == "op" and d.replayable}
        return ShardingDecisions({k: v for k, v in ops.items() if v is not None},
                                 frozenset(n.name for n in self.keep_partial))


def _encoded(d: Decision) -> tuple | None:
    """A replayable decision's placements as plain values (`ShardingDecisions.ops`), or None when
    they hold a _StridedShard that is not written relative to an input (`_relative_strided`)."""
    if d.encoded is not ...:
        return d.encoded
    # one output: its placements (a tuple); several: a list of those (None: not a tensor)
    out = [None if o is None else o.placements for o in d.out_spec] \
        if isinstance(d.out_spec, (tuple, list)) else d.out_spec.placements
    encoded = dt.encode_placements((tuple(w.placements for w in d.want_specs), out))
    d.encoded = _relative_strided(d) if _mentions(encoded, ("SS",)) else encoded
    return d.encoded


def reads_coordinate(sharding: GraphSharding, graph: fx.Graph, mesh_dim: int, extra: tuple = ()) -> bool:
    """Could this rank's program for `sharding` depend on its coordinate on mesh dim `mesh_dim`?

    Lowering reads a rank's coordinate only to take its own piece of a value: a redistribution into
    a Shard (or _StridedShard) on that dim (which chunk, and with uneven shards its size), a
    vocab-parallel _MaskPartial there (its index offset), and seeded random ops (DTensor's RNG
    offsets). Three such pieces are the same on every rank: an even piece of a fresh tensor (zeros,
    full: every chunk holds the same values), an even piece of a whole value along a dim whose
    slices are all equal (`uniform.uniform_dims`: HF Llama's attention mask, cut into each dp rank's
    rows), and an even reduce-scatter (the collective picks the chunk). Without any other, ranks
    that differ only on `mesh_dim` and have the same local shapes lower the same program, so one of
    them lowers it for all (data parallelism's ranks, whose batch pieces are their own inputs).
    `extra`: (have, want) spec pairs the output plan redistributes."""
    uniform = uniform_dims(graph)

    def reads(have, want, source=None) -> bool:
        if not isinstance(have, dt.DTensorSpec) or not isinstance(want, dt.DTensorSpec):
            return False
        a, b = have.placements[mesh_dim], want.placements[mesh_dim]
        if isinstance(a, dt.MaskPartial) or isinstance(b, dt.MaskPartial):
            return True
        if a == b or not isinstance(b, (dt.Shard, dt.StridedShard)):
            return False
        even = isinstance(b, dt.Shard) and want.shape[b.dim] % want.mesh.size(mesh_dim) == 0
        same_pieces = source is not None and (
            _is_fresh(source) or (a.is_replicate() and b.dim in uniform.get(source, ())))
        return not (even and (a.is_partial() or same_pieces))

    if any(n.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())
           for n in graph.nodes):
        return True
    for d in sharding.decisions.values():
        if d.kind != "op":
            continue
        if any(reads(h, w, n) for n, h, w in zip(d.tensor_nodes, d.in_specs, d.want_specs)):
            return True
        if reads(d.out_spec, d.reduce_to) or any(
                reads(o, o) for o in (d.out_spec if isinstance(d.out_spec, (tuple, list)) else (d.out_spec,))):
            return True
    return any(reads(h, w) for h, w in extra)


def mixes_rows(sharding: GraphSharding, mesh_dim: int) -> tuple[str, ...]:
    """Source lines of the ops whose values combine rows of different ranks along mesh dim
    `mesh_dim` (data parallelism's) other than by summing: a batch-sharded value gathered there
    (Shard -> Replicate or another Shard), or a value pending an average over it (a batch mean).

    Each rank lowers its program with the batch it holds times dp as the global batch, so those ops
    are exact only when every dp rank holds the same number of rows. Summing (gradients, the loss's
    numerator and count) is exact for any split."""
    def gathers(have, want) -> bool:
        if not isinstance(have, dt.DTensorSpec) or not isinstance(want, dt.DTensorSpec):
            return False
        a, b = have.placements[mesh_dim], want.placements[mesh_dim]
        return a.is_shard() and a != b

    def averages(spec) -> bool:
        specs = spec if isinstance(spec, (tuple, list)) else (spec,)
        return any(isinstance(s, dt.DTensorSpec) and s.placements[mesh_dim].is_partial()
                   and getattr(s.placements[mesh_dim], "reduce_op", "sum") != "sum" for s in specs)

    lines = []
    for node, d in sharding.decisions.items():
        if d.kind == "op" and (any(gathers(h, w) for h, w in zip(d.in_specs, d.want_specs))
                               or averages(d.out_spec) or gathers(d.out_spec, d.reduce_to)):
            lines.append(f"{node.name} ({node.target}) from {source_line(node)}")
    return tuple(lines)


def _mentions(encoded, kinds: tuple[str, ...]) -> bool:
    """Does an encoded decision hold a placement of one of `kinds` ("SS", "SSin", ...)? A placement
    (or marker) is a tuple led by its kind's name; anything else nested is walked, without recursion
    (this runs for every op of every lowering)."""
    stack = [encoded]
    while stack:
        e = stack.pop()
        if (type(e) is tuple or type(e) is list) and e:  # encoded: plain tuples and lists only
            if type(e[0]) is str:
                if e[0] in kinds:
                    return True
            else:
                stack.extend(e)
    return False


def _same_strided(p, q) -> bool:
    return isinstance(p, dt.StridedShard) and isinstance(q, dt.StridedShard) and (p.dim, p.split_factor) == (
        q.dim, q.split_factor)


def _relative_strided(d: Decision):
    """A _StridedShard's split factor is the product of the dims folded in front of the sharded one
    (the batch, when [B, H, T, d] is viewed as [B*H, T, d]): a shape, so it is not written down.
    What is: an input kept in the _StridedShard it arrives in ("SSin", k), and an output strided like
    input k on a dim of the same size ("SSof", k), as a batched matmul or an element-wise op on the
    flattened heads gives. Anything else involving one (None) is searched again at every shape."""
    if isinstance(d.out_spec, (tuple, list)):
        return None
    want = []
    for k, (have, w) in enumerate(zip(d.in_specs, d.want_specs)):
        row = []
        for i, p in enumerate(w.placements):
            if isinstance(p, dt.StridedShard):
                if not _same_strided(p, have.placements[i]):
                    return None
                row.append(("SSin", k))
            else:
                row.append(dt.encode_placements(p))
        want.append(tuple(row))
    out = []
    for i, p in enumerate(d.out_spec.placements):
        if isinstance(p, dt.StridedShard):
            k = next((k for k, w in enumerate(d.want_specs) if _same_strided(p, w.placements[i])
                      and w.shape[p.dim] == d.out_spec.shape[p.dim]), None)
            if k is None:
                return None
            out.append(("SSof", k))
        else:
            out.append(dt.encode_placements(p))
    return (tuple(want), tuple(out))


def _absolute_strided(placements, in_specs: list):
    """`_relative_strided`'s markers resolved against the specs the inputs arrive in now: the
    placements to replay and the (output dim, input index) pairs whose sizes must still agree; None
    when an input no longer arrives strided."""
    want_rel, out_rel = placements
    if not _mentions(placements, ("SSin", "SSof")):
        return placements, ()
    want = []
    for k, row in enumerate(want_rel):
        resolved = []
        for i, e in enumerate(row):
            if isinstance(e, tuple) and e and e[0] == "SSin":
                p = in_specs[k].placements[i]
                if not isinstance(p, dt.StridedShard):
                    return None
                e = dt.encode_placements(p)
            resolved.append(e)
        want.append(tuple(resolved))
    out, checks = [], []
    for i, e in enumerate(out_rel):
        if isinstance(e, tuple) and e and e[0] == "SSof":
            k = e[1]
            e = want[k][i]
            checks.append((e[1], k))
        out.append(e)
    return (tuple(want), tuple(out)), tuple(checks)


@dataclass(frozen=True)
class ShardingDecisions:
    """A config's sharding decisions for one graph, apart from shapes: node name -> (placements of
    its tensor inputs, placements of its output). The graph is symbolic in batch and sequence, and
    these placements do not depend on them, so lowering the graph for another input shape replays
    them (a fake run per op for the new global shapes) instead of running DTensor's strategy search
    again. A view whose size DTensor rewrote into its output's local shape gets that local shape at
    the new size (`tp_rules.SIZED_VIEW_OPS`); other ops whose arguments DTensor rewrites for its choice, and ops
    with a _StridedShard (whose split factor is a shape), are propagated anew. Plain
    values: picklable, kept per config in memory and in the persistent cache (`hotswitch.compiler.cache`).

    `dp_shared`: whether the program the search lowered read no dp coordinate (`reads_coordinate`),
    so that its dp ranks shared it; a rank given these decisions expects the same and waits for the
    shared program instead of replaying them first (None: not known, or no dp)."""

    ops: dict[str, tuple]
    keep_partial: frozenset[str]
    dp_shared: bool | None = None


def _seq_dim(node: fx.Node, seq_symbol) -> int | None:
    val = node.meta.get("val")
    if seq_symbol is None or not isinstance(val, torch.Tensor) or val.dim() < 2:
        return None
    for d, s in enumerate(val.shape):
        if isinstance(s, torch.SymInt) and s.node.expr == seq_symbol:
            return d
    return None


def propagate_graph(graph: fx.Graph, mesh: dt.DeviceMesh, placeholder_specs: list, *, sp_axis: int | None = None,
                    cp_axis: int | None = None,
                    seq_symbol=None, pinned_nodes: set[fx.Node] = frozenset(), strict: bool = True,
                    keep_partial: set[fx.Node] | None = None, memo: dict | None = None,
                    decided: ShardingDecisions | None = None) -> GraphSharding:
    """Decide placements for every node. `keep_partial=None` runs the policy's two passes. DTensor's
    strategies run under hotswitch's policy only during this call (`_dtensor.propagation(memo)`).
    `decided`: this graph's decisions at another input shape, replayed where they apply.
    `sp_axis` / `cp_axis`: the mesh dims that shard the sequence (sequence / context parallelism):
    partial values are reduce-scattered onto it there (under sp, those of parameter ops only)."""
    with dt.propagation(memo):
        if decided is not None and keep_partial is None:
            keep_partial = {n for n in graph.nodes if n.name in decided.keep_partial}
        return _propagate_graph(graph, mesh, placeholder_specs, sp_axis=sp_axis, cp_axis=cp_axis,
                                seq_symbol=seq_symbol, pinned_nodes=pinned_nodes, strict=strict,
                                keep_partial=keep_partial, decided=decided)


def _propagate_graph(graph, mesh, placeholder_specs, *, sp_axis, cp_axis, seq_symbol, pinned_nodes, strict,
                     keep_partial, decided=None):
    earlier: dict[fx.Node, Decision] = {}
    if keep_partial is None:
        first = propagate_graph(graph, mesh, placeholder_specs, sp_axis=sp_axis, cp_axis=cp_axis,
                                seq_symbol=seq_symbol, pinned_nodes=pinned_nodes, strict=strict, keep_partial=set())
        partial = {n for n, d in first.decisions.items() if d.kind == "op" and _has_partial(d.out_spec)}
        keep_partial = _partials_to_keep(graph, partial)
        # the policy's second pass: an op whose inputs arrive as they did in the first pass is decided
        # as it was then (only what the kept partials reach is decided again)
        earlier = first.decisions
    replayed, searched = 0, []
    decisions: dict[fx.Node, Decision] = {}
    specs: dict[fx.Node, Any] = {}
    values: dict[fx.Node, Any] = {}
    alike = _AlikeOps(specs, values, pinned_nodes)
    placeholders = iter(placeholder_specs)
    for node in graph.nodes:
        if node.op == "placeholder":
            specs[node] = next(placeholders)
            decisions[node] = Decision("placeholder", out_spec=specs[node])
            continue
        if node.op == "output":
            break
        placements = decided.ops.get(node.name) if decided is not None else None
        d = None if placements is None else alike.decision(
            node, ("replay", placements), lambda: _replay(node, placements, mesh, specs, values))
        if d is not None:
            replayed += 1
        else:
            d = _as_before(earlier[node], specs) if node in earlier else None
            if d is None:
                d = alike.decision(node, "decide", lambda: _decide(node, mesh, specs, values, pinned_nodes, strict,
                                                                   rows_sharded=cp_axis is not None))
            if d.replayable and d.kind == "op" and _encoded(d) is not None:
                searched.append(node.name)
        if d.kind == "op" and _has_partial(d.out_spec) and node not in keep_partial:
            scatter = sp_axis is not None and _from_param_op(node, pinned_nodes)
            d.reduce_to = _reduction_target(d.out_spec, node, sp_axis if scatter else None, seq_symbol, cp_axis)
        decisions[node] = d
        if d.kind == "const":
            values[node] = d.value
        elif d.kind == "getitem":
            specs[node] = specs[node.args[0]][node.args[1]]
            d.out_spec = specs[node]
        elif d.kind == "op":
            specs[node] = d.spec
    out = next(n for n in graph.nodes if n.op == "output")
    return GraphSharding(decisions, [specs[a] for a in pytree.tree_leaves(out.args[0])], frozenset(keep_partial),
                         replayed, tuple(searched))


class _AlikeOps:
    """The decisions of one propagation by what decides them: an op's target, its tensor inputs'
    specs (and whether each is a parameter's view, or a fresh tensor), its other arguments, and how
    it is decided (searched, or replayed from which placements). A repeated block's ops are decided
    once, for its first copy; the others get that decision, bound to their own inputs (what an op of
    a later copy would be decided, since nothing else reaches `_decide` or `_replay`).

    Kept out: ops whose decisions carry a _MaskPartial (an object per use: it links an input's
    redistribution to the output's reduction), and decisions that are not plain DTensor choices
    (fallbacks, factories, values). A _StridedShard is a value like any placement: its split factor
    is a shape, and the inputs' specs in the key carry their shapes (under sequence parallelism
    every matmul reads one: [b, s] flattened; an 8-layer Llama's tp4sp search decided 18 ops per
    layer more without them)."""

    def __init__(self, specs: dict, values: dict, pinned_nodes):
        self.specs, self.values, self.pinned = specs, values, pinned_nodes
        self.seen: dict[tuple, Decision] = {}

    def decision(self, node: fx.Node, how, decide) -> Decision | None:
        """An alike op's decision bound to `node`'s inputs, else `decide()` (kept for the ops alike
        `node` where it may stand for them)."""
        found = self._key_of(node, how)
        if found is None:
            return decide()
        key, tensor_nodes = found
        d = self.seen.get(key)
        if d is None:
            d = decide()
            if d is not None and d.kind == "op" and d.replayable and not _mentions_per_use_placements(d):
                self.seen[key] = d
            return d
        ins = [self.specs[n] for n in tensor_nodes]
        want = [now if w is then else w for w, then, now in zip(d.want_specs, d.in_specs, ins)]
        return Decision("op", tensor_nodes=tensor_nodes, in_specs=ins, want_specs=want, args=d.args,
                        kwargs=d.kwargs, out_spec=d.out_spec, replayable=d.replayable, encoded=d.encoded)

    def _key_of(self, node: fx.Node, how) -> tuple[tuple, list[fx.Node]] | None:
        """(what decides `node`, its tensor inputs), or None for an op not keyed."""
        target = node.target
        if not isinstance(target, OpOverload) or target in _SYM_OPS or target in _DROP_OPS:
            return None
        tensor_nodes, inputs = [], []

        def leaf(a):
            if isinstance(a, fx.Node):
                if _is_tensor_node(a):
                    spec = self.specs.get(a)
                    if not isinstance(spec, dt.DTensorSpec) or _per_use(spec):
                        raise _NotAlike
                    tensor_nodes.append(a)
                    inputs.append((spec, a in self.pinned, _is_fresh(a)))
                    return _TENSOR
                if a not in self.values:
                    raise _NotAlike
                a = self.values[a]
            if isinstance(a, (tuple, list)):
                return (type(a), tuple(leaf(x) for x in a))
            if isinstance(a, dict):
                return (dict, tuple((k, leaf(v)) for k, v in a.items()))
            hash(a)
            return (type(a), a)

        try:
            key = (target, how, leaf(node.args), leaf(dict(node.kwargs)))
            if not tensor_nodes:
                return None
            key = (*key, tuple(inputs))
            hash(key)
        except (_NotAlike, TypeError):
            return None
        return key, tensor_nodes


class _NotAlike(Exception):
    """An op `_AlikeOps` does not key."""


def _per_use(spec) -> bool:
    """Does `spec` hold a _MaskPartial (see `_AlikeOps`)?"""
    return isinstance(spec, dt.DTensorSpec) and any(isinstance(p, dt.MaskPartial) for p in spec.placements)


def _mentions_per_use_placements(d: Decision) -> bool:
    outs = d.out_spec if isinstance(d.out_spec, (tuple, list)) else (d.out_spec,)
    return any(_per_use(spec) for spec in (*d.want_specs, *outs))


_TENSOR = object()  # a tensor input's place among an op's arguments (its spec is keyed apart)


def _as_before(d: Decision, specs: dict) -> Decision | None:
    """The first pass's decision `d` for an op whose inputs now arrive in the same specs, its output's
    reduction left to decide; None when an input changed (or for anything but an op). The first
    pass's decisions are dropped after the second, so a _MaskPartial stays one object per use."""
    if d.kind != "op":
        return None
    for n, before in zip(d.tensor_nodes, d.in_specs):
        now = specs[n]
        if now is not before and now != before:
            return None
    return replace(d, reduce_to=None)


def _replay(node: fx.Node, placements, mesh, specs, values) -> Decision | None:
    """The decision for `node` from its placements at another shape (see ShardingDecisions), or
    None when there is nothing to replay or the inputs arrive in other placements than then."""
    if placements is None:
        return None
    tensor_nodes = [a for a in arg_leaves((node.args, node.kwargs)) if _is_tensor_node(a)]
    if len(tensor_nodes) != len(placements[0]) or any(n not in specs for n in tensor_nodes):
        return None
    resolved = _absolute_strided(placements, [specs[n] for n in tensor_nodes])
    if resolved is None:
        return None
    placements, same_size = resolved
    # fresh objects per use: DTensor's _MaskPartial (vocab-parallel embedding) carries the mask its
    # input redistribution makes and its output reduction applies; decoding keeps that pair linked
    want, out = dt.decode_placements(placements)
    concrete = lambda a: values.get(a, a) if isinstance(a, fx.Node) and not _is_tensor_node(a) else a  # noqa: E731
    to_schema = lambda a: specs[a] if _is_tensor_node(a) else concrete(a)  # noqa: E731
    args = map_args(to_schema, node.args)
    kwargs = map_args(to_schema, dict(node.kwargs))
    try:
        metas = _meta_run(node.target, args, kwargs)
    except Exception:  # noqa: BLE001 - replay is an optimization: propagate this op the usual way
        return None
    if isinstance(out, list) != isinstance(metas, (tuple, list)):
        return None
    if any(metas.shape[dim] != specs[tensor_nodes[k]].shape[dim] for dim, k in same_size):
        return None
    if isinstance(out, list):
        out_spec = tuple(None if p is None or not isinstance(m, torch.Tensor) else dt.make_spec(mesh, p, m)
                         for p, m in zip(out, metas))
    else:
        out_spec = dt.make_spec(mesh, out, metas)
    # an input wanted as it arrives keeps its spec (building one costs more than the rest of a replay)
    want_specs = [specs[n] if _as_it_arrives(w, specs[n]) else dt.DTensorSpec(mesh, w, specs[n].tensor_meta)
                  for n, w in zip(tensor_nodes, want)]
    if node.target in SIZED_VIEW_OPS:  # the view's size, as DTensor rewrote it: the output's local shape
        if not (_evenly_sharded(out_spec) and _evenly_sharded(want_specs[0])):
            return None  # uneven pieces at this shape: DTensor decides it again
        args = (args[0], list(dt.local_shape(out_spec)))
    return Decision("op", tensor_nodes=tensor_nodes, in_specs=[specs[n] for n in tensor_nodes], want_specs=want_specs,
                    args=args, kwargs=kwargs, out_spec=out_spec, replayable=True)


def _evenly_sharded(spec) -> bool:
    """Does every rank hold a piece of the same shape (each sharded dim divisible by its ranks, and
    a _StridedShard's also by its split factor)?"""
    ways: dict[int, int] = {}
    for i, p in enumerate(spec.placements):
        if isinstance(p, (dt.Shard, dt.StridedShard)):
            factor = p.split_factor if isinstance(p, dt.StridedShard) else 1
            ways[p.dim] = ways.get(p.dim, 1) * spec.mesh.size(i) * factor
    return all(spec.shape[d] % w == 0 for d, w in ways.items())


def _as_it_arrives(placements, spec) -> bool:
    """Wanted in the placements it has (and no _MaskPartial, whose objects must be the fresh ones)."""
    return tuple(placements) == tuple(spec.placements) and not any(isinstance(p, dt.MaskPartial) for p in placements)


def _partials_to_keep(graph: fx.Graph, partial: set[fx.Node]) -> set[fx.Node]:
    """Partial values left unreduced: those consumed only by views, by sums of partial values, by
    *_like ops and by the outputs (gradients, loss parts: reduced in buckets). A sum of partial values
    is itself partial, so it is reduced once where the sum is made (one all-reduce of the summed
    input-gradients of q, k and v, or of gate and up, as Megatron issues), or not at all when it too
    feeds only sums and outputs."""
    sums: dict[fx.Node, bool] = {}

    def partial_source(n) -> bool:  # partial in the first pass, or a sum of such values
        n = _view_source(n)
        if not isinstance(n, fx.Node) or n.target is aten.embedding.default:
            # an embedding's partial (DTensor's MaskPartial) masks rows by the shape of its indices:
            # it must be reduced where it is produced, never through a view or a sum
            return False
        if n in partial:
            return True
        if n.target not in _ADD_OPS:
            return False
        if n not in sums:
            args = [a for a in n.args[:2] if isinstance(a, fx.Node)]
            sums[n] = len(args) == 2 and all(partial_source(a) for a in args)
        return sums[n]

    def read_as_partial(n: fx.Node) -> bool:  # every consumer can take n's value unreduced
        return bool(n.users) and all(
            u.op == "output" or u.target in VIEW_OPS or u.target in _LIKE_OPS or u.target in _SYM_OPS
            or (u.target in _ADD_OPS and partial_source(u))
            for u in n.users)

    return {n for n in graph.nodes if n.op == "call_function" and partial_source(n) and read_as_partial(n)}


def _from_param_op(node: fx.Node, pinned_nodes) -> bool:
    """Is this partial value the output of a parameter op (row-parallel linear, embedding), possibly
    through views and sums? Megatron's sequence parallelism reduce-scatters exactly those."""
    n = _view_source(node)
    if n.target in _ADD_OPS:
        return any(_from_param_op(a, pinned_nodes) for a in n.args[:2] if isinstance(a, fx.Node))
    return any(a in pinned_nodes for a in n.all_input_nodes)


def _reduction_target(spec, node: fx.Node, sp_axis: int | None, seq_symbol, cp_axis: int | None = None):
    placements = list(spec.placements)
    seq = _seq_dim(node, seq_symbol) if sp_axis is not None or cp_axis is not None else None
    for i, p in enumerate(placements):
        if not p.is_partial():
            continue
        taken = any(isinstance(q, dt.Shard) and q.dim == seq for j, q in enumerate(placements) if j != i)
        onto_seq = i in (sp_axis, cp_axis) and seq is not None and not taken
        placements[i] = dt.Shard(seq) if onto_seq else dt.Replicate()
    return dt.DTensorSpec(spec.mesh, tuple(placements), spec.tensor_meta)


def _decide(node, mesh, specs, values, pinned_nodes, strict, rows_sharded: bool = False) -> Decision:
    """`rows_sharded`: the sequence is sharded (context parallelism), so flattened [batch x seq]
    rows arrive as _StridedShards that row-wise ops should keep (`_propagate_strided_as_shard`)."""
    target = node.target
    if target in _DROP_OPS:
        return Decision("drop")
    if target is operator.getitem and isinstance(specs.get(node.args[0]), (tuple, list)):
        return Decision("getitem")
    concrete = lambda a: values.get(a, a) if isinstance(a, fx.Node) and not _is_tensor_node(a) else a  # noqa: E731
    if target in _SYM_OPS or not isinstance(target, OpOverload):
        args = map_args(lambda a: values[a] if isinstance(a, fx.Node) and a in values else a, node.args)
        if target in _SYM_OPS:
            meta = specs[node.args[0]].tensor_meta
            value = {
                aten.sym_size.int: lambda: meta.shape[args[1]],
                aten.sym_numel.default: lambda: meta.shape.numel(),
                aten.sym_stride.int: lambda: meta.stride[args[1]],
                aten.sym_storage_offset.default: lambda: 0,
            }[target]()
        else:
            value = target(*args, **node.kwargs)
        return Decision("const", value=value)

    tensor_nodes = [a for a in arg_leaves((node.args, node.kwargs)) if _is_tensor_node(a)]
    to_schema = lambda a: specs[a] if _is_tensor_node(a) else concrete(a)  # noqa: E731
    args = map_args(to_schema, node.args)
    kwargs = map_args(to_schema, dict(node.kwargs))
    if not tensor_nodes or target in _LIKE_OPS:
        # Factory ops (no tensor input) are replicated; *_like of a partial value is a fresh tensor.
        like = specs[tensor_nodes[0]] if tensor_nodes else None
        placements = tuple(dt.Replicate() if (like is None or p.is_partial()) else p
                           for p in (like.placements if like else [dt.Replicate()] * mesh.ndim))
        meta = _meta_run(target, args, kwargs)
        spec = dt.make_spec(mesh, placements, meta)
        return Decision("op", tensor_nodes=tensor_nodes, in_specs=[specs[n] for n in tensor_nodes],
                        want_specs=[specs[n] for n in tensor_nodes], args=args, kwargs=kwargs, out_spec=spec)
    if all(p.is_replicate() for n in tensor_nodes for p in specs[n].placements):
        # Every input whole on every rank: the op runs as on one device (masks, RoPE tables, ...).
        return _fallback(node, mesh, specs, tensor_nodes, args, kwargs)
    pinned = frozenset(i for i, n in enumerate(tensor_nodes) if n in pinned_nodes)
    error = None
    if dt.has_rule(target):
        try:
            out = _propagate_placing_fresh(target, args, kwargs, pinned, tensor_nodes, specs)
        except Exception as e:  # DTensor raises many types; each becomes a ShardingError below
            error, out = e, None
        if rows_sharded and (out is None or _moves_strided(out, tensor_nodes, specs)):
            out = _propagate_strided_as_shard(target, args, kwargs, pinned, tensor_nodes, specs) or out
        if out is None and "unevenly sharded" in str(error):
            out = _propagate_gathering_uneven(target, args, kwargs, pinned, tensor_nodes, specs)
        if out is not None:
            if out.output_spec is not None:
                redo = out.redistribute_schema
                want = list(redo.args_spec) if redo is not None else [specs[n] for n in tensor_nodes]
                rewritten = redo is not None and out.use_val_from_redistribute_schema
                if rewritten:
                    args, kwargs = redo.args_schema, redo.kwargs_schema
                resized = rewritten and _sized_as_output(target, args, kwargs, out.output_spec)
                return Decision("op", tensor_nodes=tensor_nodes, in_specs=[specs[n] for n in tensor_nodes],
                                want_specs=want, args=args, kwargs=kwargs, out_spec=out.output_spec,
                                replayable=(not rewritten or resized) and len(want) == len(tensor_nodes))
            error = RuntimeError("no output sharding")
    if error is None:
        problem = f"no sharding rule for {target}"
    else:
        first_line = str(error).splitlines()[0][:200] if str(error) else ""
        problem = f"{target} could not be sharded ({type(error).__name__}: {first_line})"
    message = (
        f"{problem} at graph node {node.name!r}, from {source_line(node)}; input placements: "
        f"{[tuple(specs[n].placements) for n in tensor_nodes]}. Fix: rewrite that line with ops DTensor can shard, "
        "or compile with strict=False to run it replicated (its inputs are gathered) with a warning."
    )
    if strict:
        raise ShardingError(message)
    warnings.warn("hotswitch: " + message, stacklevel=2)
    return _fallback(node, mesh, specs, tensor_nodes, args, kwargs)


def _sized_as_output(target, args, kwargs, out_spec) -> bool:
    """Did DTensor rewrite only this view's size, into its output's local shape? Then the decision
    is replayed at another shape with the output's local shape there (`_replay`)."""
    return (target in SIZED_VIEW_OPS and not kwargs and len(args) == 2 and isinstance(args[0], dt.DTensorSpec)
            and isinstance(out_spec, dt.DTensorSpec) and list(args[1]) == list(dt.local_shape(out_spec)))


def _is_fresh(node: fx.Node) -> bool:
    node = _view_source(node)
    return isinstance(node, fx.Node) and node.target in _FRESH_OPS


def _propagate_placing_fresh(target, args, kwargs, pinned, tensor_nodes, specs):
    """Propagate; when an input is a fresh replicated tensor (zeros for a slice_scatter, say) and a
    sibling input is sharded, first try that input placed like the sibling: a fresh tensor is
    chunked locally for free, whereas DTensor, following the replicated one, would all-gather."""
    out = dt.propagate(target, args, kwargs, pinned)
    fresh = [
        i for i, n in enumerate(tensor_nodes) if _is_fresh(n) and all(p.is_replicate() for p in specs[n].placements)
    ]
    needs = out.redistribute_schema is not None and any(
        i not in fresh and w.placements != specs[n].placements
        for i, (n, w) in enumerate(zip(tensor_nodes, out.redistribute_schema.args_spec)))
    if not fresh or not needs:
        return out
    donors = [
        specs[n]
        for i, n in enumerate(tensor_nodes)
        if i not in fresh
        and not any(p.is_partial() for p in specs[n].placements)
        and not all(p.is_replicate() for p in specs[n].placements)
    ]
    for donor in donors:
        fresh_nodes = {tensor_nodes[i] for i in fresh}
        swap = lambda a: dt.DTensorSpec(a.mesh, donor.placements, a.tensor_meta) if (  # noqa: E731
            isinstance(a, dt.DTensorSpec) and any(a is specs[n] for n in fresh_nodes) and a.ndim == donor.ndim) else a
        try:
            trial = dt.propagate(target, map_args(swap, args), map_args(swap, kwargs), pinned)
        except Exception:  # noqa: BLE001 - this placement is only a candidate
            continue
        want = trial.redistribute_schema.args_spec if trial.redistribute_schema is not None else None
        if trial.output_spec is not None and (want is None or all(
                i in fresh or w.placements == specs[n].placements for i, (n, w) in enumerate(zip(tensor_nodes, want)))):
            if trial.redistribute_schema is None:  # keep the real (replicated) specs as "have": chunk locally
                trial.redistribute_schema = OpSchema(target, map_args(swap, args), map_args(swap, kwargs))
            return trial
    return out


def _moves_strided(out, tensor_nodes, specs) -> bool:
    """Does this propagation redistribute an input that arrives as a _StridedShard?"""
    redo = out.redistribute_schema
    return redo is not None and any(
        isinstance(p, dt.StridedShard) and w.placements[i] != p
        for n, w in zip(tensor_nodes, redo.args_spec) for i, p in enumerate(specs[n].placements))


def _propagate_strided_as_shard(target, args, kwargs, pinned, tensor_nodes, specs):
    """Rows of a _StridedShard (a sequence-sharded [batch, seq] flattened into one dim, under
    context parallelism) kept where they are by an op that treats that dim row by row: propagate
    with the strided inputs as plain Shards of the same dim; where nothing is redistributed and the
    output is sharded on a dim of the same size, it is strided the same way (or partial, for a
    contraction over those rows). DTensor's strategies for some ops (cross-entropy's gather, a
    weight gradient's mm) match Shard only. None when that does not apply."""
    strided: dict[int, tuple[int, int]] = {}  # mesh dim -> (split factor, size of the strided dim)
    for n in tensor_nodes:
        for i, p in enumerate(specs[n].placements):
            if isinstance(p, dt.StridedShard):
                if strided.setdefault(i, (p.split_factor, specs[n].shape[p.dim])) != (p.split_factor,
                                                                                     specs[n].shape[p.dim]):
                    return None
    if not strided:
        return None

    def as_shard(a):
        if not isinstance(a, dt.DTensorSpec) or not any(isinstance(p, dt.StridedShard) for p in a.placements):
            return a
        placements = tuple(dt.Shard(p.dim) if isinstance(p, dt.StridedShard) else p for p in a.placements)
        return dt.DTensorSpec(a.mesh, placements, a.tensor_meta)

    try:
        trial = dt.propagate(target, map_args(as_shard, args), map_args(as_shard, kwargs), pinned)
    except Exception:  # noqa: BLE001 - only a candidate
        return None
    out = trial.output_spec
    if not isinstance(out, dt.DTensorSpec):
        return None
    # what each input must be in: a strided input as it is; a replicated one chunked into the same
    # strided rows (a local slice); any other move only on the mesh dims that are not strided
    redo = trial.redistribute_schema
    wants = []  # per tensor input, in order (equal specs may be one memoized object: never key by id)
    for k, n in enumerate(tensor_nodes):
        have = specs[n].placements
        w = list(redo.args_spec[k].placements if redo is not None else as_shard(specs[n]).placements)
        for i, (split_factor, size) in strided.items():
            if isinstance(have[i], dt.StridedShard):
                if w[i] != dt.Shard(have[i].dim):
                    return None
                w[i] = have[i]
            elif have[i].is_shard():
                # a plain Shard of the same rows (DTensor moved the batch onto this mesh dim upstream)
                # holds contiguous rows, not strided ones: the trial sees both as Shard and would pair
                # unaligned rows. Move it into the strided rows (DTensor redistributes S -> _S).
                if specs[n].shape[have[i].dim] != size or w[i] != have[i]:
                    return None
                w[i] = dt.StridedShard(have[i].dim, split_factor=split_factor)
            elif w[i] != have[i]:
                if not (have[i].is_replicate() and type(w[i]) is dt.Shard and specs[n].shape[w[i].dim] == size):
                    return None
                w[i] = dt.StridedShard(w[i].dim, split_factor=split_factor)
        wants.append(dt.DTensorSpec(specs[n].mesh, tuple(w), specs[n].tensor_meta))
    placements = list(out.placements)
    for i, (split_factor, size) in strided.items():
        q = placements[i]
        if q.is_partial():  # a contraction over those rows, paired alike in every input
            continue
        if not isinstance(q, dt.Shard) or isinstance(q, dt.StridedShard) or out.shape[q.dim] != size:
            return None
        placements[i] = dt.StridedShard(q.dim, split_factor=split_factor)
    trial = copy.copy(trial)  # propagation results are memoized: never change one in place
    trial.output_spec = dt.DTensorSpec(out.mesh, tuple(placements), out.tensor_meta)
    leaves, tree = pytree.tree_flatten((args, kwargs))
    queue = iter(wants)
    leaves = [next(queue) if isinstance(a, dt.DTensorSpec) else a for a in leaves]
    want_args, want_kwargs = pytree.tree_unflatten(leaves, tree)
    trial.redistribute_schema = OpSchema(target, want_args, want_kwargs)
    trial.use_val_from_redistribute_schema = False
    return trial


def _propagate_gathering_uneven(target, args, kwargs, pinned, tensor_nodes, specs):
    """A view DTensor refuses because it would flatten or unflatten an unevenly sharded dim (a
    batch of 3 rows over 2 ranks; 2 kv heads of one row over 4): gather the uneven mesh dims of
    the input first, or, when the uneven dim is the output's, every sharded one; then propagate."""
    def gathered(a, every: bool):
        if not isinstance(a, dt.DTensorSpec):
            return a
        placements = tuple(
            dt.Replicate() if isinstance(p, dt.Shard) and (every or a.shape[p.dim] % a.mesh.size(i)) else p
            for i, p in enumerate(a.placements))
        return a if placements == a.placements else dt.DTensorSpec(a.mesh, placements, a.tensor_meta)

    for every in (False, True):
        want_args = map_args(lambda a: gathered(a, every), args)  # noqa: B023 - used at once
        want_kwargs = map_args(lambda a: gathered(a, every), kwargs)  # noqa: B023
        try:
            trial = dt.propagate(target, want_args, want_kwargs, pinned)
        except Exception:  # noqa: BLE001 - only a candidate
            continue
        if trial.output_spec is not None:
            break
    else:
        return None
    if trial.redistribute_schema is None:
        trial = copy.copy(trial)  # memoized: never change one in place
        trial.redistribute_schema = OpSchema(target, want_args, want_kwargs)
        trial.use_val_from_redistribute_schema = False
    return trial


def _fallback(node, mesh, specs, tensor_nodes, args, kwargs) -> Decision:
    """Run the op on replicated inputs (gathered first when they are not): always correct."""
    want = [dt.DTensorSpec(mesh, (dt.Replicate(),) * mesh.ndim, specs[n].tensor_meta) for n in tensor_nodes]
    metas = _meta_run(node.target, args, kwargs)
    make = lambda m: dt.make_spec(mesh, (dt.Replicate(),) * mesh.ndim, m) if isinstance(m, torch.Tensor) else None  # noqa: E731
    out = tuple(make(m) for m in metas) if isinstance(metas, (tuple, list)) else make(metas)
    return Decision("op", tensor_nodes=tensor_nodes, in_specs=[specs[n] for n in tensor_nodes], want_specs=want,
                    args=args, kwargs=kwargs, out_spec=out)


_fake_mode = FakeTensorMode(allow_non_fake_inputs=True)


def _meta_run(target, args, kwargs, device: torch.device | None = None):
    """What the op gives (shapes, strides, dtypes; no data) for inputs like `args`' tensors and
    DTensorSpecs (a spec stands for a tensor of its global shape): its meta kernel run on meta
    tensors, tens of microseconds. An op without a meta kernel runs on fake tensors on `device`
    instead (milliseconds). Tensors come back on the meta device."""
    def like(dev):
        def convert(a):
            if isinstance(a, dt.DTensorSpec):
                return torch.empty_strided(a.shape, a.stride, dtype=a.tensor_meta.dtype, device=dev)
            if isinstance(a, torch.Tensor):
                return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=dev)
            return a
        return convert

    try:
        key = (target, _signature(args), _signature(kwargs), device)
    except TypeError:  # an argument that cannot be a key: run the op
        key = None
    if key is not None and key in _META_MEMO:
        return _META_MEMO[key]
    meta_kwargs = {**kwargs, "device": torch.device("meta")} if _takes_device(target) else kwargs
    try:
        out = target(*map_args(like("meta"), args), **map_args(like("meta"), meta_kwargs))
    except (NotImplementedError, RuntimeError):  # no meta kernel (a real error raises again below)
        with _fake_mode:
            out = meta_like(target(*map_args(like(device), args), **map_args(like(device), kwargs)))
    if key is not None:
        if len(_META_MEMO) > 100_000:
            _META_MEMO.clear()
        _META_MEMO[key] = out
    return out


# op and inputs (`_signature`) -> what `_meta_run` gave: repeated blocks, other configs and other
# lengths ask for the same ops on the same shapes again. Values only (meta tensors), never mutated.
_META_MEMO: dict = {}


def _signature(a):
    """What an op's result shapes can depend on: tensors' and specs' shapes, strides and dtypes, other
    arguments by type and value (1 and 1.0 promote differently). TypeError: not hashable."""
    if isinstance(a, dt.DTensorSpec):
        return ("tensor", tuple(a.shape), tuple(a.stride), a.tensor_meta.dtype)
    if isinstance(a, torch.Tensor):
        return ("tensor", tuple(a.shape), tuple(a.stride()), a.dtype)
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_signature(x) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((k, _signature(v)) for k, v in a.items()))
    hash(a)
    return (type(a), a)


def _takes_device(target) -> bool:
    return isinstance(target, OpOverload) and any(a.name == "device" for a in op_schema(target).arguments)


# --------------------------------------------------------------------------------------------- lowering

@dataclass(frozen=True)
class OutputPlan:
    """How the graph's outputs become the ExecGraph's results."""

    split_loss: bool
    num_losses: int  # 2 when (num, den), else 1
    param_specs: tuple  # the layout every gradient must end in (empty for a forward-only graph)


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


def lower(
    graph: fx.Graph,
    sharding: GraphSharding,
    local_inputs: list[torch.Tensor],
    out_plan: OutputPlan | StageOutputPlan,
    mesh: dt.DeviceMesh,
    bucket_bytes: int = BUCKET_BYTES,
    device: torch.device | None = None,
    traced: dict | None = None,
    reduce_early: bool = False,
    attention: tuple[torch.device, bool] | None = None,
    codeless: bool = False,
) -> fx.GraphModule:
    """Build this rank's program: local shards in, (loss, *local grads) out, collectives as nodes.

    With a StageOutputPlan: (outputs of the stage graph...) out, sent values in their neighbours'
    layouts and nothing reduced over the data-parallel axis. `device`: where the program runs; the
    LogicGraph's factory ops (masks, positions, zeros) were traced on the model's device and are
    placed there instead. `local_inputs`: examples of this rank's inputs (only their shapes, strides,
    dtypes and device are read). `traced`: a dict the caller owns (one per config, say) that keeps
    the redistributions traced here for its later programs. The collectives wait where their result
    is read (`wait_where_read`) and, with `reduce_early`, the gradient buckets are reduced behind the
    backward (`issue_reductions_early`): both edit the graph before its GraphModule writes the code, once.
    `attention`: (the device the program runs on, for Inductor?): its attention is written as torch's
    fused kernels there (`attention.fuse_attention`), not at run time on a copy of the program.
    `codeless`: the program's code is written when it is first run (a program read as a graph only).
    """
    decisions = sharding.decisions
    on_device = placed_on(device)
    finish = output_finisher(graph, sharding, out_plan, mesh, bucket_bytes)
    program = _ProgramBuilder(local_inputs[0].device if local_inputs else device or torch.device("cpu"), traced)
    env: dict[fx.Node, Any] = {}
    moved: dict[tuple, fx.Node] = {}  # (value, placements): one all-gather of a tensor serves all its consumers
    inputs = iter(local_inputs)
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = program.placeholder(next(inputs))
            continue
        if node.op == "output":
            leaves = [env[a] for a in pytree.tree_leaves(node.args[0])]
            if isinstance(out_plan, OutputPlan) and _OnProgram.takes(leaves):
                result = _finish(leaves, sharding.output_specs, out_plan, mesh, bucket_bytes, _OnProgram(program, node))
            else:
                # what the end depends on: the outputs' local and global layouts (a gradient's are its
                # parameter's), not the sequence length: traced once per config, reused at other lengths
                key = ("finish", id(mesh), out_plan, tuple(sharding.output_specs), bucket_bytes, device,
                       tuple(_layout(v.meta["val"]) if isinstance(v, fx.Node) else ("const", repr(v)) for v in leaves))
                result = program.inline(key, lambda *values: finish(list(values)), leaves, node)
            program.output(result)
            add_hand_offs(program.graph, sharding.output_specs, out_plan, bucket_bytes)
            break
        d = decisions[node]
        if d.kind == "drop":
            continue
        if d.kind == "const":
            env[node] = d.value
        elif d.kind == "getitem":
            env[node] = program.getitem(env[node.args[0]], node.args[1], node.args[0])  # a part of its op
        elif _has_mask_partial(d):
            # a vocab-parallel _MaskPartial carries the mask its input redistribution computes to the
            # reduction of the op's output: the three are traced together
            inputs = [env[n] for n in d.tensor_nodes]
            try:
                out = tuple(d.out_spec) if isinstance(d.out_spec, (tuple, list)) else d.out_spec
                key = ("decision", id(mesh), node.target, tuple(d.in_specs), tuple(d.want_specs), out, d.reduce_to,
                       _signature(d.args), _signature(d.kwargs), tuple(_layout(v.meta["val"]) for v in inputs), device)
                hash(key)
            except TypeError:  # an argument that cannot be a key: traced every time
                key = None
            env[node] = program.inline(key, _run_decision(node, d, on_device), inputs, node)
        else:
            tensors = []
            for src, have, want in zip(d.tensor_nodes, d.in_specs, d.want_specs):
                value = env[src]
                if have.placements != want.placements:
                    key = (src, want.placements)
                    if key not in moved:
                        moved[key] = program.redistribute(value, have, want, node)
                    value = moved[key]
                tensors.append(value)
            it = iter(tensors)
            fill = lambda a: next(it) if isinstance(a, dt.DTensorSpec) else a  # noqa: E731
            out = program.call(node.target, map_args(fill, d.args),
                               on_device(map_args(fill, dict(d.kwargs))), node)
            if d.reduce_to is not None:
                out = program.redistribute(out, d.out_spec, d.reduce_to, node)
            env[node] = out
    if attention is not None:
        _attention.fuse_attention(program.graph, *attention, keep_meta=SOURCE_META)
    if reduce_early:
        issue_reductions_early(program.graph)
        hand_off_early(program.graph)
    wait_where_read(program.graph)
    return program.module(codeless)


def add_hand_offs(graph: fx.Graph, specs: list, plan: OutputPlan | StageOutputPlan, bucket_bytes: int) -> None:
    """Before the output of a training program that reduces its gradients (an OutputPlan with
    parameters; graph outputs (loss, *grads)), one `handoff.gradients_final` call per group of
    gradients final together: per reduction bucket of the end (`_buckets`, on the unfinished
    outputs' `specs`), then those no bucket reduces. `hand_off_early` moves them up."""
    if not isinstance(plan, OutputPlan) or not plan.param_specs:
        return
    metas = [torch.empty(dt.local_shape(s), dtype=s.tensor_meta.dtype, device="meta") for s in specs]
    groups = [tuple(i - plan.num_losses for i in bucket if i >= plan.num_losses)
              for buckets in _buckets(metas, specs, plan.num_losses, bucket_bytes).values() for bucket in buckets]
    groups = [g for g in groups if g]
    bucketed = {k for g in groups for k in g}
    rest = tuple(k for k in range(len(plan.param_specs)) if k not in bucketed)
    out = next(n for n in graph.nodes if n.op == "output")
    grads = pytree.tree_leaves(out.args[0])[1:]
    for indices in groups + ([rest] if rest else []):
        with graph.inserting_before(out):
            hook = graph.call_function(handoff.gradients_final, (indices, *[grads[k] for k in indices]))
        hook.meta = {k: out.meta[k] for k in SOURCE_META if k in out.meta}
        hook.meta["custom"] = {**hook.meta.get("custom", {}), "phase": "reduce"}


def placed_on(device: torch.device | None):
    """kwargs -> kwargs with a factory op's `device` replaced by `device` (None: left as traced)."""
    if device is None:
        return lambda kwargs: kwargs
    return lambda kwargs: {**kwargs, "device": device} if "device" in kwargs else kwargs


def output_finisher(graph: fx.Graph, sharding: GraphSharding, out_plan: OutputPlan | StageOutputPlan, mesh,
                    bucket_bytes: int):
    """Tags `graph`'s phases for `out_plan` and returns what turns its output values (local tensors,
    in the output's order) into the program's results."""
    if isinstance(out_plan, StageOutputPlan):
        _tag_phases(graph, out_plan.forward_outputs)
        return lambda leaves: _finish_stage(leaves, sharding.output_specs, out_plan)
    _tag_phases(graph, out_plan.num_losses)
    return lambda leaves: _finish(leaves, sharding.output_specs, out_plan, mesh, bucket_bytes)


def _has_mask_partial(d: Decision) -> bool:
    specs = [*d.in_specs, *d.want_specs, d.reduce_to,
             *(d.out_spec if isinstance(d.out_spec, (tuple, list)) else (d.out_spec,))]
    return any(isinstance(p, dt.MaskPartial) for s in specs if isinstance(s, dt.DTensorSpec) for p in s.placements)


def _run_decision(node: fx.Node, d: Decision, on_device):
    """`d` executed on local tensors (the ones of `d.tensor_nodes`, in order): its input
    redistributions, the op, its output's reduction."""
    def run(*values):
        tensors = [dt.redistribute(v, have, want) if have.placements != want.placements else v
                   for v, have, want in zip(values, d.in_specs, d.want_specs)]
        it = iter(tensors)
        fill = lambda a: next(it) if isinstance(a, dt.DTensorSpec) else a  # noqa: E731
        out = node.target(*map_args(fill, d.args), **on_device(map_args(fill, dict(d.kwargs))))
        return dt.redistribute(out, d.out_spec, d.reduce_to) if d.reduce_to is not None else out
    return run


# what a node of the program keeps of the LogicGraph node it comes from (what make_fx's
# `preserve_node_meta` copies): its phase, source line and module path
SOURCE_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn", "custom")


class _ProgramBuilder:
    """One rank's ExecGraph, emitted node by node.

    A LogicGraph op becomes one node calling the same op on local values; its `meta["val"]` (the
    local shape, strides and dtype) comes from running the op's meta kernel on meta tensors, tens of
    microseconds, where tracing it through make_fx's proxy and fake-tensor modes took 2-3 ms. Only what
    DTensor executes for us (redistributions, the bucketed reduction at the end) is traced by make_fx,
    each distinct one once per program, and its nodes are copied in. Every `meta["val"]` is a tensor
    on the meta device."""

    def __init__(self, device: torch.device, traced: dict | None = None):
        self.graph = fx.Graph()
        self.device = device  # where the examples for make_fx are made (DTensor reads their device)
        self.attrs: dict[str, torch.Tensor] = {}
        self.traced: dict[Any, tuple] = {} if traced is None else traced
        self.placeholders = 0

    def placeholder(self, example: torch.Tensor) -> fx.Node:
        node = self.graph.placeholder(f"arg{self.placeholders}_1")
        self.placeholders += 1
        node.meta["val"] = meta_like(example)
        return node

    def call(self, target, args, kwargs, source: fx.Node) -> fx.Node:
        val = lambda a: a.meta["val"] if isinstance(a, fx.Node) else a  # noqa: E731
        out = _meta_run(target, map_args(val, args), map_args(val, kwargs), self.device)
        node = add_node(self.graph, "call_function", target, tuple(args), dict(kwargs))
        return self._annotate(node, out, source)

    def emit(self, target, args: tuple, val: torch.Tensor, source: fx.Node) -> fx.Node:
        """A node whose value the caller knows (a collective's: its input's shape)."""
        return self._annotate(add_node(self.graph, "call_function", target, args), val, source)

    def getitem(self, value: fx.Node, index: int, source: fx.Node) -> fx.Node:
        node = add_node(self.graph, "call_function", operator.getitem, (value, index))
        return self._annotate(node, value.meta["val"][index], source)

    def redistribute(self, value: fx.Node, have, want, source: fx.Node) -> fx.Node:
        # by the mesh's identity: meshes alike in shape may have other process groups (a new generation)
        key = ("redistribute", id(have.mesh), have, want, _layout(value.meta["val"]), self.device)
        return self.inline(key, lambda t: dt.redistribute(t, have, want), [value], source)

    def inline(self, key, fn, inputs: list, source: fx.Node):
        """`fn(*inputs)` traced by make_fx (once per `key`; None: every time) and copied in; its result
        with nodes of this program in place of the traced ones. Non-tensor inputs are passed as they are."""
        tensors = [a for a in inputs if isinstance(a, fx.Node)]

        def on_tensors(*values):
            it = iter(values)
            return fn(*[next(it) if isinstance(a, fx.Node) else a for a in inputs])

        sub = self.traced[key][0] if key in self.traced else None
        if sub is None:
            examples = [_example(n.meta["val"], self.device) for n in tensors]
            with warnings.catch_warnings(), codeless_modules():  # its nodes are copied; its code is never read
                warnings.simplefilter("ignore")
                sub = make_fx(on_tensors, tracing_mode="fake")(*examples)
            if key is not None:
                self.traced[key] = (sub, fn)  # fn keeps what the key names by identity (the mesh) alive
        env: dict[fx.Node, Any] = {}
        placeholders = iter(tensors)
        result = None
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(placeholders)
            elif n.op == "output":
                result = fx.node.map_arg(n.args[0], lambda a: env[a])
            elif n.op == "get_attr":
                name = f"_constant{len(self.attrs)}"
                self.attrs[name] = getattr(sub, n.target)
                env[n] = self._annotate(self.graph.get_attr(name), n.meta.get("val"), source)
            else:
                env[n] = self._annotate(copy_node(self.graph, n, env.__getitem__), n.meta.get("val"), source)
        return result

    def output(self, result) -> None:
        self.graph.output(result)

    def module(self, codeless: bool = False) -> fx.GraphModule:
        """The program as a GraphModule, its code generated once (`codeless`: when first run, if ever)."""
        root = torch.nn.Module()
        for name, value in self.attrs.items():
            setattr(root, name, value)
        _drop_dead_nodes(self.graph)
        return codeless_module(root, self.graph) if codeless else graph_module(root, self.graph)

    @staticmethod
    def _annotate(node: fx.Node, val, source: fx.Node) -> fx.Node:
        meta = node.meta  # edited in place: assigning a node's attribute runs fx's lookups
        meta.clear()
        meta.update((k, source.meta[k]) for k in SOURCE_META if k in source.meta)
        if val is not None:
            node.meta["val"] = meta_like(val)
        return node


def _drop_dead_nodes(graph: fx.Graph) -> None:
    """`graph.eliminate_dead_code()` for a graph built in order: a node is asked whether it has side
    effects only when nothing reads it (fx asks every node, after linting the whole graph: at 8
    layers a sixth of writing a program's code)."""
    for node in reversed(graph.nodes):
        if not node.users and not node.is_impure():
            graph.erase_node(node)


def _layout(value) -> tuple:
    """What a traced redistribution or end of a program reads of a local value: shape, strides, dtype."""
    if isinstance(value, (tuple, list)):
        return tuple(_layout(v) for v in value)
    return tuple(value.shape), value.stride(), value.dtype


def _example(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor like `meta` on `device` for make_fx to trace with (DTensor's uneven
    _StridedShard gather builds index tensors from real values; faked inputs would make them
    data-dependent)."""
    return torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device=device)


def _tag_phases(graph: fx.Graph, forward_outputs: int | tuple[int, ...]) -> None:
    """Tag nodes (meta['custom']['phase']): 'forward' if the loss (the first `forward_outputs`
    outputs, or those at the given indices) depends on them, else 'backward'."""
    out = next(n for n in graph.nodes if n.op == "output")
    leaves = pytree.tree_leaves(out.args[0])
    indices = range(forward_outputs) if isinstance(forward_outputs, int) else forward_outputs
    losses = [leaves[i] for i in indices]
    forward: set[fx.Node] = set()
    stack = list(losses)
    while stack:
        n = stack.pop()
        if n in forward or not isinstance(n, fx.Node):
            continue
        forward.add(n)
        stack.extend(n.all_input_nodes)
    for n in graph.nodes:
        phase = "reduce" if n.op == "output" else "forward" if n in forward else "backward"
        n.meta["custom"] = {**n.meta.get("custom", {}), "phase": phase, "source": n.name}


def collectives(gm: fx.GraphModule, phase: str | None = None) -> list[fx.Node]:
    """The collective nodes of an ExecGraph (waits excluded), optionally of one phase."""
    return [n for n in gm.graph.nodes if _is_collective(n)
            and (phase is None or n.meta.get("custom", {}).get("phase") == phase)]


def issue_reductions_early(graph: fx.Graph) -> int:
    """DDP's overlap, in the graph: each gradient bucket's all-reduce, with the concatenation and
    views that pack it, moves to right after the last value it carries is computed. It then runs
    on the process group's side (gloo's thread, NCCL's stream) while the backward goes on; its wait
    stays where the result is first read, at the end. Returns how many all-reduces moved. Ranks of
    a group run alike graphs, so they still issue their collectives in one order. Edits `graph` (a
    GraphModule owning it writes its code again on `recompile()`)."""
    moved = 0
    for node in [n for n in graph.nodes if _is_reduce_phase(n) and _is_collective(n)
                 and collective_kind(n) == "all_reduce"]:
        chain, stack = set(), [node]
        while stack:  # the node and the packing ops feeding it (never a wait: that would block early)
            n = stack.pop()
            if n in chain:
                continue
            chain.add(n)
            stack += [a for a in n.all_input_nodes if a.op == "call_function" and _is_reduce_phase(a)
                      and not _is_collective(a) and not _is_wait(a)]
        position = {n: i for i, n in enumerate(graph.nodes)}
        anchor = max((a for c in chain for a in c.all_input_nodes if a not in chain), key=position.__getitem__)
        moved += _follow(anchor, sorted(chain, key=position.__getitem__), position)
    return moved


def wait_where_read(graph: fx.Graph) -> int:
    """Each collective's wait moves down to right before the first op that reads its result: a
    traced redistribution waits at once, so nothing ran while the collective was in flight. Now what
    does not need the result (a weight's gradient while its input's gradient is all-reduced, as
    Megatron overlaps them) runs before the wait. Issue order is untouched. Returns how many moved.
    Edits `graph`, as `issue_reductions_early` does."""
    moved = 0
    position = {n: i for i, n in enumerate(graph.nodes)}
    for node in [n for n in graph.nodes if _is_wait(n)]:
        if not node.users:
            continue
        first = min(node.users, key=position.__getitem__)
        if position[first] > position[node] + 1:
            first.prepend(node)
            moved += 1
    return moved


def hand_off_early(graph: fx.Graph) -> int:
    """Each gradient bucket's hand-off call (`compiler.handoff`), with the reduce-phase ops it reads
    (the bucket's wait, split and views, the division by the loss denominator), moves up to right
    after the next bucket's all-reduce is issued: the bucket's reduction still overlaps the backward
    until then, and its gradients can leave while the rest of the backward runs. Collectives are
    never moved, so every rank issues them in the same order as before. Returns how many calls
    moved. Edits `graph`, as `issue_reductions_early` does."""
    moved = 0
    # bucket reductions, in issue order (collectives never move here, so neither does that order)
    issues = [n for n in graph.nodes
              if _is_reduce_phase(n) and _is_collective(n) and collective_kind(n) == "all_reduce"]
    for hook in [n for n in graph.nodes if handoff.is_hand_off(n)]:
        position = {n: i for i, n in enumerate(graph.nodes)}
        candidates, stack = set(), [hook]
        while stack:  # the hook and the reduce-phase ops it reads, up to the collectives
            n = stack.pop()
            if n in candidates:
                continue
            candidates.add(n)
            stack += [a for a in n.all_input_nodes if a.op == "call_function" and _is_reduce_phase(a)
                      and not _is_collective(a)]
        outside = [a for c in candidates for a in c.all_input_nodes if a not in candidates]
        anchor = max(outside, key=position.__getitem__, default=None)
        if anchor is None:
            continue
        # behind the next bucket's issue, if one comes before the hook
        later = [n for n in issues if position[anchor] < position[n] < position[hook]]
        if later:
            anchor = later[0]
        chain = sorted((c for c in candidates if position[c] > position[anchor]), key=position.__getitem__)
        moved += _follow(anchor, chain, position)
    return moved


def _follow(anchor: fx.Node, chain: list[fx.Node], position: dict[fx.Node, int]) -> int:
    """Move `chain` (in graph order) to right after `anchor`; 1 if anything moved, 0 if it already
    stood there (or is empty). `position`: each node's index before the move."""
    if not chain or position[chain[0]] == position[anchor] + 1 and all(
            position[b] == position[a] + 1 for a, b in zip(chain, chain[1:])):
        return 0
    for c in chain:
        anchor.append(c)
        anchor = c
    return 1


def _is_reduce_phase(node: fx.Node) -> bool:
    return node.meta.get("custom", {}).get("phase") == "reduce"


def _is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and str(node.target).startswith("_c10d_functional.") and not _is_wait(node)


def _is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and str(node.target).startswith("_c10d_functional.wait_tensor")


def collective_kind(node: fx.Node) -> str:
    """'all_reduce', 'all_gather', 'reduce_scatter', 'all_to_all', ... of a collective node."""
    op = str(node.target).split(".")[1]  # "_c10d_functional.all_reduce.default" -> "all_reduce"
    return op.removesuffix("_into_tensor").removesuffix("_tensor").removesuffix("_single")


def count_collectives(gm: fx.GraphModule, phase: str | None = None) -> Counter:
    """Collective nodes of an ExecGraph by kind (`collective_kind`)."""
    return Counter(collective_kind(node) for node in collectives(gm, phase))


def _partial_dims(spec) -> tuple[int, ...]:
    return tuple(i for i, p in enumerate(spec.placements) if p.is_partial())


def _buckets(leaves, specs, num_losses: int, bucket_bytes: int) -> dict[tuple, list[list[int]]]:
    """The gradient buckets of a program's end: per set of partial mesh dims, lists of output
    indices, gradients in reverse order (the backward produces the last layers first). The loss
    numerator and denominator ride along with the first bucket of their kind, so that every
    gradient is final (divided by the global denominator) once its own bucket is reduced.
    `leaves`: the outputs' local values (tensors or meta tensors)."""
    order = list(range(num_losses)) + list(range(len(leaves)))[num_losses:][::-1]
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


class _OnTensors:
    """`_finish`'s operations on tensors (local values, traced by make_fx: `lower_reduction`)."""

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


class _OnProgram:
    """`_finish`'s operations emitted into a program under construction, by its builder: the nodes
    make_fx would trace from `_OnTensors`, each value from its op's meta kernel (tracing the end of
    an 8-layer model through make_fx was a fifth of lowering it). For outputs a flat view can read
    (`takes`); others are traced."""

    def __init__(self, program: _ProgramBuilder, source: fx.Node):
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

    def all_reduce(self, x, mesh, dim: int):
        # the collective's value is its input's shape: no kernel to run for it
        group = mesh.get_group(dim).group_name
        reduced = self.program.emit(c10d.all_reduce.default, (x, "sum", group), x.meta["val"], self.source)
        return self.program.emit(c10d.wait_tensor.default, (reduced,), x.meta["val"], self.source)


def _finish(leaves, specs, plan: OutputPlan, mesh, bucket_bytes, ops=_OnTensors):
    """Reduce partial outputs in buckets, divide by the loss denominator, put grads in param layout.
    `ops`: on tensors (traced), or emitted into a program (`_OnProgram`)."""
    reduced = list(leaves)
    for dims, buckets in _buckets([ops.value(v) for v in leaves], specs, plan.num_losses, bucket_bytes).items():
        for bucket in buckets:
            flat = ops.cat([ops.flat(leaves[i]) for i in bucket])
            for d in dims:
                flat = ops.all_reduce(flat, mesh, d)
            for i, piece in zip(bucket, ops.split(flat, [ops.value(leaves[i]).numel() for i in bucket])):
                reduced[i] = ops.view(piece, ops.value(leaves[i]).shape)
    final_specs = [
        dt.DTensorSpec(s.mesh, tuple(dt.Replicate() if p.is_partial() else p for p in s.placements), s.tensor_meta)
        for s in specs
    ]
    losses, grads = reduced[: plan.num_losses], reduced[plan.num_losses:]
    for k, (g, have, want) in enumerate(zip(grads, final_specs[plan.num_losses:], plan.param_specs)):
        if have.placements != want.placements:
            grads[k] = ops.redistribute(g, have, want)
    if plan.split_loss:
        num, den = losses
        den = ops.to(den, ops.value(num).dtype)
        return (ops.div(num, den), *[ops.div(g, den) for g in grads])
    return (losses[0], *grads)


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
            return _finish(list(leaves), specs, plan, mesh, bucket_bytes)
        den, *grads = _finish(list(leaves), specs, OutputPlan(False, 1, plan.param_specs), mesh, bucket_bytes)
        return (den, *[g / den.to(g.dtype) for g in grads])

    with warnings.catch_warnings(), codeless_modules():  # its code is written once, edited
        warnings.simplefilter("ignore")
        gm = make_fx(run, tracing_mode="fake")(*local_examples)
    for node in gm.graph.nodes:
        node.meta["custom"] = {**node.meta.get("custom", {}), "phase": "reduce"}
    gm.graph.eliminate_dead_code()
    return with_code(gm)
