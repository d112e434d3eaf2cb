"""The dims along which a LogicGraph's values hold the same values in every slice (`uniform_dims`).

Data-parallel ranks share one lowered program when the program reads nothing of their dp
coordinate (`sharding.reads_coordinate`). Taking a rank's rows of a value computed whole on every rank
reads it (the rows' offset), unless every piece holds the same values: then rank 0's program, run on
rank r, computes rank r's own. HF Llama builds its attention mask that way: a [T, T] pattern from
positions made by `arange`, expanded over the batch and combined with other values made alike, then
cut into each rank's rows. Telling that from the graph takes a small abstract interpretation: per
node, the set of dims along which every slice is equal, from rules for the ops such masks are made
of (broadcasting element-wise ops, expands, unsqueezes, slices, cumulative sums, concatenations,
indexing, fresh tensors). Any other op yields no dim: the answer errs only towards reading.
"""
from __future__ import annotations

import weakref

import torch
import torch.fx as fx

__all__ = ["uniform_dims"]

aten = torch.ops.aten

# every element the same: every dim uniform
_FILLED = {aten.full.default, aten.zeros.default, aten.ones.default, aten.scalar_tensor.default,
           aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.new_zeros.default,
           aten.new_ones.default, aten.new_full.default}
# one tensor in, the same shape out, each element from the element at its place
_SAME_PLACE = {aten.clone.default, aten._to_copy.default, aten.alias.default, aten.detach.default,
               aten.lift_fresh_copy.default}


def uniform_dims(graph: fx.Graph) -> dict[fx.Node, frozenset[int]]:
    """tensor node -> the dims of its value along which every slice is equal (missing: none known).
    Computed once per graph (a LogicGraph is never edited)."""
    known = _MEMO.get(graph)
    if known is None:
        known = _MEMO[graph] = _interpret(graph)
    return known


_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _val(a):
    v = a.meta.get("val") if isinstance(a, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _is_one(size) -> bool:
    return type(size) is int and size == 1


def _interpret(graph: fx.Graph) -> dict[fx.Node, frozenset[int]]:
    out: dict[fx.Node, frozenset[int]] = {}

    def along(x: fx.Node, d: int) -> bool:
        return d in out.get(x, ())

    for node in graph.nodes:
        val = _val(node)
        if node.op != "call_function" or val is None:
            continue
        rank, target, args = val.dim(), node.target, node.args
        dims: set[int] = set()
        if target in _FILLED:
            dims = set(range(rank))
        elif target in _SAME_PLACE:
            dims = set(out.get(args[0], ()))
        elif isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
            # broadcasting: a dim is uniform where every tensor input is uniform along it or broadcasts it
            inputs = [a for a in (*args, *node.kwargs.values()) if _val(a) is not None]
            for d in range(rank):
                if all(_broadcasts(x, d, rank) or along(x, d - (rank - _val(x).dim())) for x in inputs):
                    dims.add(d)
        elif target is aten.expand.default:
            before = _val(args[0])
            new = rank - before.dim()
            dims = {d for d in range(rank)
                    if d < new or _is_one(before.shape[d - new]) or along(args[0], d - new)}
        elif target is aten.unsqueeze.default:
            at = args[1] % rank
            dims = {d for d in range(rank) if d == at or along(args[0], d if d < at else d - 1)}
        elif target in (aten.slice.Tensor, aten.cumsum.default):
            cut = args[1] % rank if len(args) > 1 else 0
            dims = {d for d in range(rank) if along(args[0], d) and (target is aten.slice.Tensor or d != cut)}
        elif target is aten.cat.default:
            at = (args[1] if len(args) > 1 else 0) % rank
            dims = {d for d in range(rank) if d != at and all(along(x, d) for x in args[0])}
        elif target is aten.index.Tensor:
            dims = _indexed(node, out)
        elif target in (aten.transpose.int, aten.t.default):
            a, b = (args[1] % rank, args[2] % rank) if target is aten.transpose.int else (0, rank - 1)
            swap = {a: b, b: a}
            dims = {d for d in range(rank) if along(args[0], swap.get(d, d))}
        elif target is aten.permute.default:
            dims = {d for d in range(rank) if along(args[0], args[1][d] % rank)}
        elif target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
            source = _val(args[0])
            if source is not None and len(out.get(args[0], ())) == source.dim():
                dims = set(range(rank))  # every element the same, in any shape
        if dims:
            out[node] = frozenset(dims)
    return out


def _broadcasts(x: fx.Node, d: int, rank: int) -> bool:
    """Does tensor `x`, broadcast to `rank` dims, repeat one slice along dim `d`?"""
    v = _val(x)
    k = d - (rank - v.dim())
    return k < 0 or _is_one(v.shape[k])


def _indexed(node: fx.Node, out: dict) -> set[int]:
    """aten.index.Tensor with index tensors for the leading dims of its input (the indexing a mask
    is built with): out[p..., rest] = x[i_0[p], ..., i_k[p], rest]. A dim of the indices' broadcast
    is uniform where each index either repeats along it or indexes a dim of x that is uniform."""
    x, indices = node.args[0], node.args[1]
    if any(i is None or _val(i) is None or _val(i).dtype in (torch.bool, torch.uint8) for i in indices):
        return set()  # an index left out, or a boolean mask (which picks elements by value)
    rank = _val(node).dim()
    lead = rank - (_val(x).dim() - len(indices))  # the indices' broadcast dims come first
    dims = set()
    for d in range(lead):
        if all(_broadcasts(i, d, lead) or d - (lead - _val(i).dim()) in out.get(i, ()) or j in out.get(x, ())
               for j, i in enumerate(indices)):
            dims.add(d)
    dims.update(d for d in range(lead, rank) if (d - lead + len(indices)) in out.get(x, ()))
    return dims

