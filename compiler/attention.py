"""The sharding rule of `document_attention` and its backward (`hotswitch.kernels.attention`), next to
DTensor's strategies for aten ops: per mesh dim, the op runs

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

from hotswitch.kernels import attention as _kernel

from . import _dtensor as dt

__all__ = ["ATTENTION_OPS", "register"]

ATTENTION_OPS = (_kernel.document_attention._opoverload, _kernel.document_attention_backward._opoverload)


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
    """Register both rules with DTensor's propagator (once per process)."""
    global _registered
    if not _registered:
        forward, backward = ATTENTION_OPS
        dt.register_mesh_dim_strategies(forward, _forward_strategies, 1, _sequence_only_on_cp)
        dt.register_mesh_dim_strategies(backward, _backward_strategies, 3, _sequence_only_on_cp)
        _registered = True
