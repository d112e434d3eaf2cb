"""How one mesh axis places a tensor: the torch.distributed.tensor vocabulary, as plain values.

Ours are frozen dataclasses (hashable, picklable, comparable) so that layouts and plans can be
cached and built without a process group; `to_torch` / `from_torch` cross over to DTensor's types
(torch is imported there, not here: `hotswitch --help` and planning never load it).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Placement", "Shard", "Replicate", "Partial", "REDUCE_OPS", "fsdp_dim", "to_torch", "from_torch"]

# The reductions c10d (and so DTensor's Partial) can apply when a partial value is reduced.
REDUCE_OPS = ("sum", "avg", "product", "min", "max")


class _PlacementKind:
    """The three `is_*` questions, answered once here instead of by isinstance at every call site."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class Shard(_PlacementKind):
    """Split tensor dim `dim` into one chunk per device along the mesh axis (torch.chunk sizes)."""

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise ValueError(f"Shard(dim) needs an int tensor dim, got {self.dim!r}; pass e.g. Shard(0)")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or self.dim == dim

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate(_PlacementKind):
    """Every device along the mesh axis holds the same full piece."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True, slots=True)
class Partial(_PlacementKind):
    """Every device along the mesh axis holds a full-shape summand; the value is their reduction."""

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in REDUCE_OPS:
            raise ValueError(
                f"Partial reduce_op {self.reduce_op!r} is not a c10d reduction; use one of {REDUCE_OPS}"
            )

    def is_partial(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op})"


Placement = Shard | Replicate | Partial


def fsdp_dim(shape, placements, dp_axis: int, dp: int) -> int | None:
    """The tensor dim fsdp shards a parameter on over the data-parallel mesh axis `dp_axis` (`dp`
    ranks), given its placements without fsdp (ours or torch's): the first dim that no other axis
    shards and that has at least `dp` entries, so that every rank holds a non-empty piece; None
    where the parameter stays whole over dp (no such dim, as FSDP2 leaves a tensor-parallel bias of
    fewer entries than ranks, or the dp axis already places it). The compiler stores parameters so
    (`compiler.fsdp`) and the cluster planner prices the same layouts (`switch.cluster`)."""
    if not placements[dp_axis].is_replicate():
        return None
    taken = {p.dim for p in placements if p.is_shard()}
    return next((d for d, size in enumerate(shape) if d not in taken and size >= dp), None)


def to_torch(p: Placement):
    """Our placement -> the equal torch.distributed.tensor placement."""
    from torch.distributed.tensor import placement_types as _tp

    if isinstance(p, Shard):
        return _tp.Shard(p.dim)
    if isinstance(p, Replicate):
        return _tp.Replicate()
    if isinstance(p, Partial):
        return _tp.Partial(p.reduce_op)
    raise ValueError(f"to_torch expects Shard, Replicate or Partial from distconfig, got {p!r}")


def from_torch(p) -> Placement:
    """A torch.distributed.tensor placement -> ours. _StridedShard has no equivalent here (yet)."""
    if isinstance(p, (Shard, Replicate, Partial)):
        return p
    from torch.distributed.tensor import placement_types as _tp

    # _StridedShard is not a Shard subclass in torch 2.13, but guard in case that changes.
    if type(p).__name__ == "_StridedShard":
        raise ValueError(
            f"{p!r} (a strided shard from a reshape of a sharded tensor) has no distconfig equivalent; "
            "redistribute the tensor to a plain Shard/Replicate layout before converting it"
        )
    if isinstance(p, _tp.Shard):
        return Shard(p.dim)
    if isinstance(p, _tp.Replicate):
        return Replicate()
    if isinstance(p, _tp.Partial):
        return Partial(p.reduce_op)
    raise ValueError(f"from_torch expects a torch Shard, Replicate or Partial placement, got {p!r}")
