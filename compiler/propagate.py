"""Sharding propagation over a joint graph: each op asks DTensor's strategy which input placements
it needs and which output placement it gives (`propagate_graph` -> `sharding.GraphSharding`).

The graph is walked in order with DTensorSpecs built from global shapes. Parameters (and views of
them) are pinned to the layout the config gave them. A `Partial` result is reduced where it is
produced (all-reduce, or reduce-scatter onto the sequence dim under sequence parallelism), except
when its only consumers are additions of other partial values (then the sum is reduced, once) or
the graph's outputs: that yields Megatron's collectives (one reduction after q/k/v's
input-gradients are summed, not three) and leaves gradients partial for the buckets. Decisions of
an earlier shape are replayed (`ShardingDecisions`), and alike ops are decided once (`_AlikeOps`).
"""
from __future__ import annotations

import copy
import math
import operator
import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx

from . import _dtensor as dt
from . import attention as _attention
from ._dtensor import OpSchema
from ._torch import (
    FakeTensorMode,
    OpOverload,
    arg_leaves,
    map_args,
    meta_like,
    op_schema,
    pytree,
)
from .sharding import (
    _LIKE_OPS,
    Decision,
    GraphSharding,
    ShardingDecisions,
    ShardingError,
    _absolute_strided,
    _encoded,
    _has_partial,
    _is_fresh,
    _is_tensor_node,
    _view_source,
    singletons,
    unshardable,
)
from .tp_rules import SIZED_VIEW_OPS, VIEW_OPS
from .uniform import uniform_dims

aten = torch.ops.aten

_attention.register()  # the attention ops' rules (masked, document), beside DTensor's for aten ops

_DROP_OPS = {aten._assert_tensor_metadata.default, aten._assert_scalar.default}

_SYM_OPS = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int, aten.sym_storage_offset.default}

_ADD_OPS = {aten.add.Tensor, aten.sub.Tensor}

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
                    decided: ShardingDecisions | None = None, config: str = "") -> GraphSharding:
    """Decide placements for every node. `keep_partial=None` runs the policy's two passes. DTensor's
    strategies run under hotswitch's policy only during this call (`_dtensor.propagation(memo)`).
    `decided`: this graph's decisions at another input shape, replayed where they apply.
    `sp_axis` / `cp_axis`: the mesh dims that shard the sequence (sequence / context parallelism):
    partial values are reduce-scattered onto it there (under sp, those of parameter ops only).
    `config`: the config's name, which an op it cannot shard names (`sharding.unshardable`)."""
    with dt.propagation(memo):
        if decided is not None and keep_partial is None:
            keep_partial = {n for n in graph.nodes if n.name in decided.keep_partial}
        run = lambda rows: _propagate_graph(  # noqa: E731
            graph, mesh, placeholder_specs, sp_axis=sp_axis, cp_axis=cp_axis, seq_symbol=seq_symbol,
            pinned_nodes=pinned_nodes, strict=strict, keep_partial=keep_partial, decided=decided, config=config,
            fresh_rows=rows)
        rows = FreshRows.of(graph, mesh, placeholder_specs, pinned_nodes)
        if rows is None:
            return run(None)
        try:
            out = run(rows)
        except ShardingError:
            out = None
        if out is None or rows.gathered(out):
            out = run(None)  # a value made in rows was wanted whole after all: make it whole, as before
        return out

def _propagate_graph(graph, mesh, placeholder_specs, *, sp_axis, cp_axis, seq_symbol, pinned_nodes, strict,
                     keep_partial, decided=None, config="", fresh_rows: FreshRows | None = None):
    earlier: dict[fx.Node, Decision] = {}
    if keep_partial is None:
        first = _propagate_graph(graph, mesh, placeholder_specs, sp_axis=sp_axis, cp_axis=cp_axis,
                                 seq_symbol=seq_symbol, pinned_nodes=pinned_nodes, strict=strict, keep_partial=set(),
                                 config=config, fresh_rows=fresh_rows)
        partial = {n for n, d in first.decisions.items() if d.kind == "op" and _has_partial(d.out_spec)}
        keep_partial = _partials_to_keep(graph, partial)
        # the policy's second pass: an op whose inputs arrive as they did in the first pass is decided
        # as it was then (only what the kept partials reach is decided again)
        earlier = first.decisions
    replayed, searched = 0, []
    decisions: dict[fx.Node, Decision] = {}
    specs: dict[fx.Node, Any] = {}
    values: dict[fx.Node, Any] = {}
    alike = _AlikeOps(specs, values, pinned_nodes, fresh_rows.input_free if fresh_rows is not None else frozenset())
    placeholders = iter(placeholder_specs)
    for node in graph.nodes:
        if node.op == "placeholder":
            specs[node] = next(placeholders)
            decisions[node] = Decision("placeholder", out_spec=specs[node])
            continue
        if node.op == "output":
            break
        placements = decided.ops.get(node.name) if decided is not None else None
        ones = decided.ones.get(node.name) if decided is not None else None
        d = None if placements is None else alike.decision(
            node, ("replay", placements, ones), lambda: _replay(node, placements, mesh, specs, values, ones))
        if d is not None:
            replayed += 1
        else:
            d = _as_before(earlier[node], specs) if node in earlier else None
            if d is None:
                d = alike.decision(node, "decide", lambda: _decide(node, mesh, specs, values, pinned_nodes, strict,
                                                                   rows_sharded=cp_axis is not None, config=config,
                                                                   fresh_rows=fresh_rows))
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

    def __init__(self, specs: dict, values: dict, pinned_nodes, input_free=frozenset()):
        self.specs, self.values, self.pinned, self.input_free = specs, values, pinned_nodes, input_free
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
        if not isinstance(target, OpOverload) or target in _SYM_OPS or target in _DROP_OPS or node in self.input_free:
            return None  # (a value made from no input is decided by what it is, not only its inputs' specs)
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

def _replay(node: fx.Node, placements, mesh, specs, values, ones: tuple | None = None) -> Decision | None:
    """The decision for `node` from its placements at another shape (see ShardingDecisions), or
    None when there is nothing to replay, the inputs arrive in other placements than then, or
    other dims are of size 1 than then (`ones`, `sharding.singletons`)."""
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
        metas = meta_run(node.target, args, kwargs)
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
    if ones is not None and singletons([specs[n] for n in tensor_nodes], out_spec) != ones:
        return None
    # an input wanted as it arrives keeps its spec (building one costs more than the rest of a replay)
    want_specs = [specs[n] if _as_it_arrives(w, specs[n]) else dt.spec(mesh, w, specs[n].tensor_meta)
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
    return dt.spec(spec.mesh, tuple(placements), spec.tensor_meta)

def _decide(node, mesh, specs, values, pinned_nodes, strict, rows_sharded: bool = False, config: str = "",
            fresh_rows: FreshRows | None = None) -> Decision:
    """`rows_sharded`: the sequence is sharded (context parallelism), so flattened [batch x seq]
    rows arrive as _StridedShards that row-wise ops should keep (`_propagate_strided_as_shard`).
    `config`: the config's name, for the error of an op it cannot shard (`sharding.unshardable`).
    `fresh_rows`: how the batch's rows are sharded, for values made from no input (`FreshRows`)."""
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
        meta = meta_run(target, args, kwargs)
        spec = dt.make_spec(mesh, placements, meta)
        return Decision("op", tensor_nodes=tensor_nodes, in_specs=[specs[n] for n in tensor_nodes],
                        want_specs=[specs[n] for n in tensor_nodes], args=args, kwargs=kwargs, out_spec=spec)
    if all(p.is_replicate() for n in tensor_nodes for p in specs[n].placements):
        # Every input whole on every rank: the op runs as on one device (RoPE tables, ...), except a
        # value of the batch's rows made from no input (HF's attention mask), made in rows
        out = fresh_rows.propagate(node, target, args, kwargs, tensor_nodes, specs) if fresh_rows else None
        if out is None:
            return _fallback(node, mesh, specs, tensor_nodes, args, kwargs)
        return _chosen(out, target, args, kwargs, tensor_nodes, specs)
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
        if out is None:
            unflattened = _unflatten_strided(target, args, kwargs, tensor_nodes, specs)
            if unflattened is not None:
                return unflattened
        if out is not None:
            if out.output_spec is not None:
                return _chosen(out, target, args, kwargs, tensor_nodes, specs)
            error = RuntimeError("no output sharding")
    if error is None:
        problem = f"no sharding rule for {target}"
    else:
        first_line = str(error).splitlines()[0][:200] if str(error) else ""
        problem = f"{target} could not be sharded ({type(error).__name__}: {first_line})"
    # what runs it: its inputs whole on every mesh dim that shards one (strict=False gathers them there)
    names = mesh.mesh_dim_names or tuple(f"mesh dim {i}" for i in range(mesh.ndim))
    over = " and ".join(names[i] for i in range(mesh.ndim)
                        if any(not specs[n].placements[i].is_replicate() for n in tensor_nodes))
    fix = (f"It runs with its inputs replicated over {over} (Replicate there): compile with strict=False to "
           f"gather them (with a warning), rewrite that line with ops DTensor can shard, or leave "
           f"{config or 'this config'!r} out of the configs.")
    error = unshardable(config, node, problem, [tuple(specs[n].placements) for n in tensor_nodes], fix)
    if strict:
        raise error
    warnings.warn(f"hotswitch: {error}", stacklevel=2)
    return _fallback(node, mesh, specs, tensor_nodes, args, kwargs)

def _chosen(out, target, args, kwargs, tensor_nodes, specs) -> Decision:
    """The decision of a propagation result `out` (an OutputSharding with an output spec)."""
    redo = out.redistribute_schema
    want = list(redo.args_spec) if redo is not None else [specs[n] for n in tensor_nodes]
    rewritten = redo is not None and out.use_val_from_redistribute_schema
    if rewritten:
        args, kwargs = redo.args_schema, redo.kwargs_schema
    resized = rewritten and _sized_as_output(target, args, kwargs, out.output_spec)
    return Decision("op", tensor_nodes=tensor_nodes, in_specs=[specs[n] for n in tensor_nodes],
                    want_specs=want, args=args, kwargs=kwargs, out_spec=out.output_spec,
                    replayable=(not rewritten or resized) and len(want) == len(tensor_nodes))


@dataclass(frozen=True)
class FreshRows:
    """Values made from no input that hold the batch's rows, made in rows as the batch is sharded.

    HF models build their attention mask from positions alone (`arange`s, an expand over the batch,
    compares): [rows, 1, T, T] booleans whose every row is alike (`uniform.uniform_dims`). Decided as
    any op on replicated inputs, it is made whole on every rank and cut into its rows only where
    attention reads it: at 32K tokens and 64 rows, 64 GiB on each rank. Made in rows from the first
    op whose value holds alike rows, a dp rank makes only its own (1/dp of it), each input it reads
    in rows cut locally from a small replicated value of alike rows: no collective, and no
    coordinate read that would part the dp ranks' programs (`sharding.reads_coordinate`)."""

    placements: tuple  # the batch's rows: Shard(0) on the mesh dims that split them, Replicate elsewhere
    rows: int  # the global batch
    input_free: frozenset  # nodes whose values are made from no input
    in_rows: frozenset  # those of them to make in rows (`_made_in_rows`)

    @classmethod
    def of(cls, graph: fx.Graph, mesh, placeholder_specs, pinned_nodes) -> FreshRows | None:
        """From the first input (not a parameter) whose rows are sharded; None without one."""
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        for node, spec in zip(placeholders, placeholder_specs):
            if node in pinned_nodes or not isinstance(spec, dt.DTensorSpec) or not spec.shape:
                continue
            rows = tuple(p if type(p) is dt.Shard and p.dim == 0 else dt.Replicate() for p in spec.placements)
            ways = math.prod(mesh.size(i) for i, p in enumerate(rows) if p.is_shard())
            if ways > 1 and spec.shape[0] >= ways and isinstance(node.meta.get("val"), torch.Tensor):
                free = _input_free(graph)
                in_rows = _made_in_rows(graph, free, node.meta["val"].shape[0])
                return cls(rows, spec.shape[0], free, in_rows) if in_rows else None
        return None

    def propagate(self, node, target, args, kwargs, tensor_nodes, specs):
        """DTensor's propagation of `node` (every input replicated) with its inputs of the batch's
        rows in rows, when it is to be made in rows and comes out in rows with no input moved but
        those cut locally; else None."""
        if node not in self.in_rows:
            return None
        in_rows = [n for n in tensor_nodes if specs[n].ndim and specs[n].shape[0] == self.rows]
        if not in_rows:
            return None
        swap = lambda a: dt.spec(a.mesh, self.placements, a.tensor_meta) if (  # noqa: E731
            isinstance(a, dt.DTensorSpec) and any(a is specs[n] for n in in_rows)) else a
        trial = _propagate_swapped(target, args, kwargs, swap)
        if trial is None or not isinstance(trial.output_spec, dt.DTensorSpec) \
                or tuple(trial.output_spec.placements) != self.placements:
            return None
        want = trial.redistribute_schema.args_spec
        if len(want) != len(tensor_nodes) or any(
                tuple(w.placements) != tuple(specs[n].placements)
                and not (n in in_rows and tuple(w.placements) == self.placements)
                for n, w in zip(tensor_nodes, want)):
            return None
        return trial

    def gathered(self, sharding: GraphSharding) -> bool:
        """Was a value made from no input in rows wanted otherwise on their mesh dims (a gather)?"""
        dims = [i for i, p in enumerate(self.placements) if p.is_shard()]
        for d in sharding.decisions.values():
            if d.kind != "op":
                continue
            for n, have, want in zip(d.tensor_nodes, d.in_specs, d.want_specs):
                if n in self.input_free and isinstance(have, dt.DTensorSpec) and any(
                        have.placements[i].is_shard() and want.placements[i] != have.placements[i] for i in dims):
                    return True
        return False


def _made_in_rows(graph: fx.Graph, input_free: frozenset, batch) -> frozenset:
    """The values made from no input worth making in rows: of the batch's rows (dim 0 of size
    `batch`, the inputs' rows, as a symbol where the trace keeps it dynamic), alike along them, and
    read only where rows can stay rows: by values made in rows too, or by values made from inputs
    (attention, beside its queries' rows). Never as the value an index picks rows of (the mask's
    positions, picked by a batch `arange`): that reads every row. Decided from the outputs back, so
    a chain is made in rows from its first such value on; where DTensor cannot propagate an op in
    rows (an index), it is made whole and its readers cut it."""
    uniform = uniform_dims(graph)
    chosen: set[fx.Node] = set()

    def reads_in_rows(user: fx.Node, value: fx.Node) -> bool:
        if user not in input_free:
            return user.op == "call_function"
        picked = user.target is aten.index.Tensor and value is user.args[0]
        if picked and (not user.args[1] or user.args[1][0] is not None):
            return False  # its rows picked by an index
        return user in chosen

    for node in reversed(graph.nodes):
        val = node.meta.get("val")
        if node not in input_free or not isinstance(val, torch.Tensor) or not val.dim() \
                or not _same_size(val.shape[0], batch) or 0 not in uniform.get(node, ()):
            continue
        if node.users and all(reads_in_rows(u, node) for u in node.users):
            chosen.add(node)
    return frozenset(chosen)


def _same_size(a, b) -> bool:
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and a.node.expr == b.node.expr
    return a == b


def _input_free(graph: fx.Graph) -> frozenset:
    """The tensor nodes whose values are made from no input (factories, and ops on such values only)."""
    free: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "call_function" and _is_tensor_node(n) and all(
                a in free for a in n.all_input_nodes if _is_tensor_node(a)):
            free.add(n)
    return frozenset(free)


def _unflatten_strided(target, args, kwargs, tensor_nodes, specs) -> Decision | None:
    """A view that splits one dim back into the two a flatten merged, where that dim is sharded by a
    plain Shard over some mesh dims (the outer one's, data parallelism's rows) and a _StridedShard
    over others (the inner one's, sequence parallelism's positions): [b*s, V] -> [b, s, V] after a
    dp x tp x sp LM head. DTensor's view rule asks every mesh dim to divide the outer size b (2
    rows under dp2 do not divide over tp4), though the strided one shards s; this is its answer
    where it would be right: the plain Shards on the outer dim, the strided one on the inner, when
    its split factor is the outer size's share per plain Shard and every piece is even."""
    if target not in SIZED_VIEW_OPS or target is aten.expand.default or kwargs or len(args) != 2 \
            or len(tensor_nodes) != 1:
        return None
    spec, shape = specs[tensor_nodes[0]], list(args[1])
    strided = [(i, p) for i, p in enumerate(spec.placements) if isinstance(p, dt.StridedShard)]
    if len(strided) != 1 or any(not isinstance(s, int) for s in shape):
        return None
    mesh_dim, ss = strided[0]
    d = ss.dim
    old = list(spec.shape)
    if -1 in shape or len(shape) != len(old) + 1 or shape[:d] != old[:d] or shape[d + 2:] != old[d + 1:] \
            or shape[d] * shape[d + 1] != old[d]:
        return None
    plain = [i for i, p in enumerate(spec.placements) if p.is_shard(d) and not isinstance(p, dt.StridedShard)]
    outer = math.prod(spec.mesh.size(i) for i in plain)
    if shape[d] % outer or shape[d] // outer != ss.split_factor or shape[d + 1] % spec.mesh.size(mesh_dim) \
            or any(i > mesh_dim for i in plain):
        return None
    placements = [dt.Shard(d + 1) if i == mesh_dim else (dt.Shard(p.dim + 1) if p.is_shard() and p.dim > d else p)
                  for i, p in enumerate(spec.placements)]
    out_spec = dt.make_spec(spec.mesh, placements, meta_run(target, args, kwargs))
    return Decision("op", tensor_nodes=tensor_nodes, in_specs=[spec], want_specs=[spec],
                    args=(args[0], list(dt.local_shape(out_spec))), kwargs=kwargs, out_spec=out_spec,
                    replayable=True)


def _sized_as_output(target, args, kwargs, out_spec) -> bool:
    """Did DTensor rewrite only this view's size, into its output's local shape? Then the decision
    is replayed at another shape with the output's local shape there (`_replay`)."""
    return (target in SIZED_VIEW_OPS and not kwargs and len(args) == 2 and isinstance(args[0], dt.DTensorSpec)
            and isinstance(out_spec, dt.DTensorSpec) and list(args[1]) == list(dt.local_shape(out_spec)))

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
        swap = lambda a: dt.spec(a.mesh, donor.placements, a.tensor_meta) if (  # noqa: E731
            isinstance(a, dt.DTensorSpec) and any(a is specs[n] for n in fresh_nodes) and a.ndim == donor.ndim) else a
        trial = _propagate_swapped(target, args, kwargs, swap, pinned)
        if trial is not None and trial.output_spec is not None and all(
                i in fresh or w.placements == specs[n].placements
                for i, (n, w) in enumerate(zip(tensor_nodes, trial.redistribute_schema.args_spec))):
            return trial
    return out


def _propagate_swapped(target, args, kwargs, swap, pinned: frozenset[int] = frozenset()):
    """DTensor's propagation as if some replicated inputs arrived in other placements (`swap`: a
    spec -> the one to assume), placements a rank reaches by a local cut. Where DTensor asks to move
    nothing, what it wants is the assumed specs, the inputs' real specs staying what they have: the
    cut. None where DTensor refuses."""
    args, kwargs = map_args(swap, args), map_args(swap, kwargs)
    try:
        trial = dt.propagate(target, args, kwargs, pinned)
    except Exception:  # noqa: BLE001 - only a candidate
        return None
    if trial.output_spec is not None and trial.redistribute_schema is None:
        trial.redistribute_schema = OpSchema(target, args, kwargs)  # (dt.propagate returns a copy to edit)
    return trial

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
        return dt.spec(a.mesh, placements, a.tensor_meta)

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
        wants.append(dt.spec(specs[n].mesh, tuple(w), specs[n].tensor_meta))
    placements = list(out.placements)
    for i, (split_factor, size) in strided.items():
        q = placements[i]
        if q.is_partial():  # a contraction over those rows, paired alike in every input
            continue
        if not isinstance(q, dt.Shard) or isinstance(q, dt.StridedShard) or out.shape[q.dim] != size:
            return None
        placements[i] = dt.StridedShard(q.dim, split_factor=split_factor)
    trial = copy.copy(trial)  # propagation results are memoized: never change one in place
    trial.output_spec = dt.spec(out.mesh, tuple(placements), out.tensor_meta)
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
        return a if placements == a.placements else dt.spec(a.mesh, placements, a.tensor_meta)

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
    want = [dt.spec(mesh, (dt.Replicate(),) * mesh.ndim, specs[n].tensor_meta) for n in tensor_nodes]
    metas = meta_run(node.target, args, kwargs)
    make = lambda m: dt.make_spec(mesh, (dt.Replicate(),) * mesh.ndim, m) if isinstance(m, torch.Tensor) else None  # noqa: E731
    out = tuple(make(m) for m in metas) if isinstance(metas, (tuple, list)) else make(metas)
    return Decision("op", tensor_nodes=tensor_nodes, in_specs=[specs[n] for n in tensor_nodes], want_specs=want,
                    args=args, kwargs=kwargs, out_spec=out)

_fake_mode = FakeTensorMode(allow_non_fake_inputs=True)

def meta_run(target, args, kwargs, device: torch.device | None = None):
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

# op and inputs (`_signature`) -> what `meta_run` gave: repeated blocks, other configs and other
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

