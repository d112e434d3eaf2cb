"""The one module that touches torch.distributed.tensor's private sharding machinery.

We reuse DTensor's op sharding strategies (hundreds of aten ops) at compile time, on specs built
from global shapes, without creating any DTensor. Everything private is imported here so that an
upstream change breaks one file. Pinned to torch 2.13.
"""
from __future__ import annotations

import contextvars
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import _sharding_prop as _sp
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, OutputSharding
from torch.distributed.tensor._redistribute import redistribute_local_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = [
    "DTensorSpec", "DeviceMesh", "OpSchema", "OutputSharding", "Partial", "Placement", "Replicate",
    "Shard", "StridedShard", "make_spec", "propagate", "redistribute", "local_shape", "has_rule",
]

from torch.distributed.tensor.placement_types import _StridedShard as StridedShard  # noqa: E402

_propagator = DTensor._op_dispatcher.sharding_propagator

# Strategy expansion prices every candidate input placement with `redistribute_cost`; for
# _StridedShard specs that runs a graph search per call (~40 ms), and DTensor's own cache keys on
# whole specs, so it almost never hits across the nodes of one graph. The price depends only on the
# mesh, both placements (with shard orders), the global shape and the dtype: memoize on those.
from torch.distributed.tensor._ops import utils as _op_utils  # noqa: E402

_original_cost = _op_utils.redistribute_cost
_cost_memo: dict[tuple, float] = {}


def _memoized_redistribute_cost(current: DTensorSpec, target: DTensorSpec) -> float:
    shapes = tuple(None if s.tensor_meta is None else (tuple(s.tensor_meta.shape), s.tensor_meta.dtype)
                   for s in (current, target))
    key = (current.mesh, current.placements, target.placements, getattr(current, "shard_order", None),
           getattr(target, "shard_order", None), shapes)
    cost = _cost_memo.get(key)
    if cost is None:
        if len(_cost_memo) > 200_000:
            _cost_memo.clear()
        cost = _cost_memo[key] = _original_cost(current, target)
    return cost


_op_utils.redistribute_cost = _memoized_redistribute_cost
_original_select = _sp._select_min_cost_strategy
# Indices (into OpSchema.args_spec) of inputs whose placement must not change: parameters keep the
# layout the config gave them (Megatron's rule), so the strategy search may not redistribute them.
_pinned: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar("hotswitch_pinned", default=frozenset())


def _nests_one_dim(spec) -> bool:
    specs = spec if isinstance(spec, (tuple, list)) else (spec,)
    for s in specs:
        dims = [p.dim for p in getattr(s, "placements", ()) if isinstance(p, Shard)]
        if len(dims) != len(set(dims)):
            return True
    return False


def _select_keeping_pinned(strategy: OpStrategy, op_schema: OpSchema | None = None):
    if len(strategy.strategies) > 1:
        # Never shard one tensor dim over two mesh axes when another choice exists: Megatron layouts
        # do not, and DTensor's local shapes for flattening nested uneven shards are inconsistent.
        flat = [s for s in strategy.strategies if not _nests_one_dim(s.output_specs)]
        if flat and len(flat) < len(strategy.strategies):
            strategy = OpStrategy(flat)
    pinned = _pinned.get()
    if pinned and op_schema is not None and len(strategy.strategies) > 1:
        current = op_schema.args_spec
        keep = [
            s for s in strategy.strategies
            if all(i >= len(current) or s.input_specs is None
                   or s.input_specs[i].placements == current[i].placements for i in pinned)
        ]
        if keep:
            strategy = OpStrategy(keep)
    return _original_select(strategy, op_schema)


_sp._select_min_cost_strategy = _select_keeping_pinned


def make_spec(mesh: DeviceMesh, placements: Sequence[Placement], meta: torch.Tensor) -> DTensorSpec:
    """A spec for a global tensor described by `meta` (a fake or real tensor of the global shape)."""
    return DTensorSpec(mesh, tuple(placements), TensorMeta(meta.shape, meta.stride(), meta.dtype))


def has_rule(op) -> bool:
    p = _propagator
    return (op in p.op_strategy_funcs or op in p.op_to_rules
            or op in getattr(p, "op_single_dim_strategy_funcs", {})
            or _sp.DecompShardingStrategy.has_decomp(op))


def propagate(op, args_schema: tuple, kwargs_schema: dict, pinned: frozenset[int] = frozenset()) -> OutputSharding:
    """DTensor's sharding propagation for one op on specs; `pinned` inputs keep their placements."""
    schema = OpSchema(op, args_schema, kwargs_schema, schema_info=_propagator.op_to_schema_info.get(op))
    if not pinned:
        return _propagator.propagate_op_sharding(schema)
    token = _pinned.set(pinned)
    try:
        return _propagator.propagate_op_sharding_non_cached(schema)
    finally:
        _pinned.reset(token)


def redistribute(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec) -> torch.Tensor:
    """Local-shard redistribution; under make_fx tracing it records functional collectives."""
    return redistribute_local_tensor(local, src, dst)


def local_shape(spec: DTensorSpec) -> tuple[int, ...]:
    return local_shape_and_offset(spec)[0]


def local_shape_and_offset(spec: DTensorSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's piece of a global tensor (torch.chunk semantics, uneven shards included)."""
    shape, offset = compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)
    return tuple(shape), tuple(offset)

