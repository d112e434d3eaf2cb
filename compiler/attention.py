"""The sharding rules of hotswitch's attention ops (`hotswitch.kernels.attention`), next to DTensor's
strategies for aten ops, and `AttentionWhole`, which keeps a model's `scaled_dot_product_attention`
whole while it is traced.

`masked_attention` (and its backward), per mesh dim, runs replicated; on a shard of the batch; on a
shard of the heads (when the mesh dim divides both head counts); or on a shard of the queries (the
mask's rows with them, keys and values whole, their gradients partial sums): the mask says where
each query sits, so a sequence shard needs no offset. That last one is how context parallelism runs
a causal model's attention, as DTensor runs the math decomposition (mask rows sliced, keys gathered).

`document_attention` (and its backward), per mesh dim, runs

- replicated;
- on a shard of the batch (dim 0 of everything);
- on a shard of the heads (dim 1 of q, k, v and the output; positions and ids whole): tensor
  parallelism, when the mesh dim divides both head counts;
- on a shard of the sequence (dim 2 of q, k, v and the output, dim 1 of positions and ids): context
  parallelism, on the mesh dim named "cp" only, because there the runtime installs the
  implementation that fetches other ranks' keys and values (`hotswitch.runtime.cp_attention`).
  Anywhere else (sp's sequence shards on the tp axis) a sharded sequence is gathered first.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hotswitch.kernels import attention as _kernel

from . import _dtensor as dt

__all__ = ["ATTENTION_OPS", "MASKED_OPS", "AttentionWhole", "register"]

ATTENTION_OPS = (_kernel.document_attention._opoverload, _kernel.document_attention_backward._opoverload)
MASKED_OPS = (_kernel.masked_attention._opoverload, _kernel.masked_attention_backward._opoverload)


class AttentionWhole(TorchFunctionMode):
    """While a model is exported: its `F.scaled_dot_product_attention` calls become `masked_attention`,
    one op of the LogicGraph, where the op computes them exactly (`masked_call`; a causal call gets
    its mask written out). Other calls (dropout, a mask that takes gradients) are decomposed as before."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            call = _kernel.masked_call(*args, **kwargs)
            if call is not None:
                return _kernel.masked_attention(*call)
        return func(*args, **kwargs)


def _mask_along(mask_spec, dim: int, sharded):
    """The mask's placement where q is sharded on `dim`: sharded alike, unless it broadcasts there."""
    return sharded if mask_spec.shape[dim] > 1 else dt.Replicate()


def _masked_forward_strategies(op_schema):
    r, s0, s1, s2 = dt.Replicate(), dt.Shard(0), dt.Shard(1), dt.Shard(2)
    mask = op_schema.args_schema[3]
    #        out q   k   v   mask
    return [[r, r, r, r, r],
            [s0, s0, s0, s0, _mask_along(mask, 0, s0)],
            [s1, s1, s1, s1, _mask_along(mask, 1, s1)],
            [s2, s2, r, r, _mask_along(mask, 2, s2)]]


def _masked_backward_strategies(op_schema):
    r, s0, s1, s2, p = dt.Replicate(), dt.Shard(0), dt.Shard(1), dt.Shard(2), dt.Partial()
    mask = op_schema.args_schema[4]
    #        dq  dk  dv  grad q   k   v   mask
    return [[r, r, r, r, r, r, r, r],
            [s0, s0, s0, s0, s0, s0, s0, _mask_along(mask, 0, s0)],
            [s1, s1, s1, s1, s1, s1, s1, _mask_along(mask, 1, s1)],
            [s2, p, p, s2, s2, r, r, _mask_along(mask, 2, s2)]]


def _heads_divide(mesh, input_specs, output_spec) -> bool:
    """Heads (dim 1 of q, k, v) sharded only where the mesh dim divides both head counts: grouped
    queries map query head h to key head h // (H / Hkv), which holds shard by shard only then."""
    heads = [spec.tensor_meta.shape[1] for spec in input_specs[:-1]]  # the mask last
    return all(not (p.is_shard() and p.dim == 1) or all(h % mesh.size(i) == 0 for h in heads)
               for i, p in enumerate(input_specs[0].placements))


def _forward_strategies(op_schema):
    r, s0, s1, s2 = dt.Replicate(), dt.Shard(0), dt.Shard(1), dt.Shard(2)
    #        out  q   k   v   positions ids
    return [[r, r, r, r, r, r],
            [s0, s0, s0, s0, s0, s0],
            [s1, s1, s1, s1, r, r],
            [s2, s2, s2, s2, s1, s1]]


def _backward_strategies(op_schema):
    r, s0, s1, s2 = dt.Replicate(), dt.Shard(0), dt.Shard(1), dt.Shard(2)
    #        dq  dk  dv  grad q   k   v   positions ids
    return [[r, r, r, r, r, r, r, r, r],
            [s0, s0, s0, s0, s0, s0, s0, s0, s0],
            [s1, s1, s1, s1, s1, s1, s1, r, r],
            [s2, s2, s2, s2, s2, s2, s2, s1, s1]]


def _sequence_only_on_cp(mesh, input_specs, output_spec) -> bool:
    """The sequence (dim 2 of the first input, q or grad) may be sharded only over "cp"."""
    names = mesh.mesh_dim_names or ()
    first = input_specs[0]
    return all(not (p.is_shard() and p.dim == 2) or (i < len(names) and names[i] == "cp")
               for i, p in enumerate(first.placements))


_registered = False


def register() -> None:
    """Register the rules with DTensor's propagator (once per process)."""
    global _registered
    if not _registered:
        forward, backward = ATTENTION_OPS
        dt.register_mesh_dim_strategies(forward, _forward_strategies, 1, _sequence_only_on_cp)
        dt.register_mesh_dim_strategies(backward, _backward_strategies, 3, _sequence_only_on_cp)
        forward, backward = MASKED_OPS
        dt.register_mesh_dim_strategies(forward, _masked_forward_strategies, 1, _heads_divide)
        dt.register_mesh_dim_strategies(backward, _masked_backward_strategies, 3, _heads_divide)
        _registered = True
