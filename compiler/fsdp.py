"""Fully sharded data parallelism (ZeRO-3, torch's FSDP2) inside one ExecGraph (`DistConfig.fsdp`).

Each parameter is *stored* sharded over the data-parallel ranks (`storage_placements`: the dp axis
takes a dim no other axis shards, Shard(0) unless tensor parallelism has it) and *computed with*
in the placements of the same config without fsdp: propagation, and so every op and collective of
the step, is the dp config's. What fsdp adds is at the program's edges, per *unit* (`units`: a
repeated block's parameters together, as `fully_shard` is applied per transformer block; each
other module's on their own):

- before a unit's first use in the forward, one all-gather of its parameters' shards (one flat
  buffer, each shard padded to the largest, as FSDP2 pads); again before its first use in the
  backward (the forward's copies are freed after their last forward use: `reshard_after_forward`);
  each issued while the unit before it computes (`prefetch_gathers`, FSDP2's prefetch of one unit);
- the unit's gradients, partial sums over dp, are reduce-scattered into their shards, one flat
  buffer per unit, issued as soon as the backward has made them (`lower.issue_reductions_early`).

Why not `torch.distributed.fsdp.fully_shard`: it hooks a module's forward and autograd; here the
whole step is one traced program with its collectives as nodes (and switching needs layouts as
values), so the same schedule is written into the program instead. Shards follow torch.chunk's
sizes (DTensor's `Shard`, distconfig's `Layout`), so a switch moves them like any other layout.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from hotswitch.distconfig import chunk_span, fsdp_dim

from . import _dtensor as dt

__all__ = ["GatherPlan", "gather_unit", "prefetch_gathers", "reduce_scatter_unit", "storage_placements", "units"]

# "model.layers.3.mlp.up_proj.weight" -> "model.layers.3": the repeated block a parameter belongs to
_BLOCK = re.compile(r"^((?:[^.]+\.)*?\d+)(?=\.)")


def units(param_names: Sequence[str]) -> dict[str, str]:
    """Parameter -> its fsdp unit: the repeated block (a ModuleList child) it belongs to, else its
    own module (the embedding, the final norm, the head each gathered alone, when first used)."""
    out = {}
    for name in param_names:
        m = _BLOCK.match(name)
        out[name] = m.group(1) if m else name.rpartition(".")[0] or name
    return out


def storage_placements(compute: dict[str, tuple], shapes: dict[str, Sequence[int]], dp_axis: int,
                       dp: int) -> dict[str, tuple]:
    """Each parameter's placements with the dp axis sharding it on `distconfig.fsdp_dim` (Shard(0)
    unless tensor parallelism has it); a parameter with no such dim stays whole over dp."""
    out = {}
    for name, placements in compute.items():
        dim = fsdp_dim(shapes[name], placements, dp_axis, dp)
        out[name] = placements if dim is None else tuple(
            dt.Shard(dim) if i == dp_axis else p for i, p in enumerate(placements))
    return out


@dataclass(frozen=True)
class GatherPlan:
    """What a program's fsdp parameters need: per parameter placeholder index, its unit and the
    specs it is stored in and computed with; `dp_dim`: the mesh dim that shards them."""

    params: tuple[tuple[int, str, object, object], ...]  # (placeholder index, unit, storage spec, compute spec)
    dp_dim: int

    def even(self) -> bool:
        """Does every dp rank hold a shard of the same size? (Else a rank's program reads its dp
        coordinate: its shards' sizes.)"""
        return all(storage.shape[storage.placements[self.dp_dim].dim] % storage.mesh.size(self.dp_dim) == 0
                   for _, _, storage, _ in self.params)

    def unit_members(self) -> dict[str, list[tuple[int, object, object]]]:
        out: dict[str, list] = {}
        for index, unit, storage, compute in self.params:
            out.setdefault(unit, []).append((index, storage, compute))
        return out


def _chunking(want, dp_dim: int, size: int) -> tuple[int, int, list[int]]:
    """(the sharded dim, the padded chunk size, every dp rank's chunk size): torch.chunk's sizes."""
    dim = want.placements[dp_dim].dim
    n = want.mesh.size(dp_dim)
    return dim, math.ceil(size / n), [chunk_span(size, n, r)[1] for r in range(n)]


def gather_unit(storage_specs: Sequence, compute_specs: Sequence, dp_dim: int):
    """A function of a unit's local shards (this rank's, in `storage_specs`) giving its parameters
    in `compute_specs`: one all-gather over the dp mesh dim of their flattened shards, each padded
    to the chunk size of its parameter, unpacked and unpadded. For make_fx to trace."""
    from torch.distributed import _functional_collectives as funcol

    mesh = compute_specs[0].mesh
    shapes = [dt.local_shape(s) for s in compute_specs]
    chunks = [_chunking(w, dp_dim, shape[w.placements[dp_dim].dim]) for w, shape in zip(storage_specs, shapes)]

    def run(*shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        flat = []
        for x, (dim, c, _) in zip(shards, chunks):
            x = x.movedim(dim, 0)
            if x.shape[0] < c:
                x = torch.cat([x, x.new_zeros((c - x.shape[0], *x.shape[1:]))])
            flat.append(x.reshape(-1))
        gathered = funcol.all_gather_tensor(torch.cat(flat), 0, (mesh, dp_dim))
        gathered = gathered.view(mesh.size(dp_dim), -1)
        out, offset = [], 0
        for shape, (dim, c, _) in zip(shapes, chunks):
            rest = [s for d, s in enumerate(shape) if d != dim]
            n = c * math.prod(rest)
            whole = gathered[:, offset:offset + n].reshape(-1, *rest)[:shape[dim]]
            out.append(whole.movedim(0, dim).contiguous())
            offset += n
        return tuple(out)

    return run


def reduce_scatter_unit(have_specs: Sequence, want_specs: Sequence, dp_dim: int):
    """A function of a unit's gradients (partial sums over dp, in `have_specs`) giving this rank's
    shards of their sums (in `want_specs`): one reduce-scatter over the dp mesh dim of a flat buffer
    that holds every rank's chunks in rank order (each padded to its parameter's chunk size), then,
    for the gradients also partial on other mesh dims (sequence parallelism's norm weights, context
    parallelism's ranks), one all-reduce of those shards together per such dim. For make_fx to trace."""
    from torch.distributed import _functional_collectives as funcol

    mesh = want_specs[0].mesh
    dp = mesh.size(dp_dim)
    rank = mesh.get_coordinate()[dp_dim]
    shapes = [dt.local_shape(s) for s in have_specs]
    chunks = [_chunking(w, dp_dim, shape[w.placements[dp_dim].dim]) for w, shape in zip(want_specs, shapes)]
    # per gradient, the other mesh dims it is a partial sum over (`is_scattered`: they end Replicate)
    others = [tuple(i for i, p in enumerate(s.placements) if p.is_partial() and i != dp_dim) for s in have_specs]

    def run(*grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pieces = []
        for g, (dim, c, _) in zip(grads, chunks):
            g = g.movedim(dim, 0)
            if g.shape[0] < dp * c:
                g = torch.cat([g, g.new_zeros((dp * c - g.shape[0], *g.shape[1:]))])
            pieces.append(g.reshape(dp, -1))
        mine = funcol.reduce_scatter_tensor(torch.cat(pieces, dim=1).reshape(-1), "sum", 0, (mesh, dp_dim))
        flat = list(mine.split([p.shape[1] for p in pieces]))
        for dims in sorted(set(others) - {()}):
            members = [k for k, o in enumerate(others) if o == dims]
            summed = torch.cat([flat[k] for k in members])
            for d in dims:
                summed = funcol.all_reduce(summed, "sum", (mesh, d))
            for k, piece in zip(members, summed.split([flat[k].numel() for k in members])):
                flat[k] = piece
        out = []
        for piece, shape, (dim, c, sizes) in zip(flat, shapes, chunks):
            rest = [s for d, s in enumerate(shape) if d != dim]
            out.append(piece.view(c, *rest)[:sizes[rank]].movedim(0, dim).contiguous())
        return tuple(out)

    return run


def is_scattered(have, want, dp_dim: int) -> bool:
    """Is a gradient in `have` (its partial sums) reduce-scattered into `want` (an fsdp shard)?
    Only where the other mesh dims need nothing but the all-reduce `reduce_scatter_unit` adds (a
    partial sum to Replicate); any other change (a tied head's gradient, partial over tp, into a
    vocab-parallel Shard) is a redistribution of its own, after the dp reduction."""
    others = all(a == b or (a.is_partial() and b.is_replicate())
                 for i, (a, b) in enumerate(zip(have.placements, want.placements)) if i != dp_dim)
    return have.placements[dp_dim].is_partial() and want.placements[dp_dim].is_shard() and others


def prefetch_gathers(graph: fx.Graph) -> int:
    """FSDP2's prefetch: each fsdp all-gather (with the ops that pack its buffer) moves up to right
    after the previous unit's gather of the same phase is waited for, so that it runs while that
    unit computes; at most two units are gathered at a time. Collectives keep their order.
    Returns how many moved. Edits `graph` (its GraphModule writes its code again on `recompile()`)."""
    gathers = [n for n in graph.nodes if n.meta.get("custom", {}).get("fsdp") == "gather"
               and str(n.target).startswith("_c10d_functional.all_gather")]
    moved = 0
    for earlier, later in zip(gathers, gathers[1:]):
        if earlier.meta["custom"].get("phase") != later.meta["custom"].get("phase"):
            continue
        waits = [u for u in earlier.users if str(u.target).startswith("_c10d_functional.wait")]
        if not waits:
            continue
        anchor = waits[0]
        chain, stack = set(), [later]
        while stack:  # the collective and the packing ops that feed it (they read only the shards)
            n = stack.pop()
            if n in chain or n.op != "call_function":
                continue
            chain.add(n)
            stack += [a for a in n.all_input_nodes if a.meta.get("custom", {}).get("fsdp") == "gather"]
        position = {n: i for i, n in enumerate(graph.nodes)}
        if position[later] < position[anchor]:
            continue
        for n in sorted(chain, key=position.__getitem__):
            if position[n] > position[anchor]:
                anchor.append(n)
                anchor = n
                moved += 1
    return moved
