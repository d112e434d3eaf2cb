"""Which piece of a tensor each device holds: a box, one [start, stop) interval per tensor dim.

Placements compose in mesh-axis order exactly as torch's
`torch.distributed.tensor._utils._compute_local_shape_and_global_offset` does, so our boxes are
DTensor's local shards and DCP checkpoint chunks:

- `Shard(d)` on an axis of size k splits the piece of dim d held so far into k chunks of
  ceil(n / k) (torch.chunk sizes): trailing chunks may be smaller or empty. A later axis sharding
  the same dim subdivides the earlier axis's piece.
- An empty piece is the box [size, size) of the global dim (torch's offset for it).
- `Replicate()` and `Partial()` leave the piece as it is; under `Partial` every device holds a
  full-shape summand of the value, so its box covers the whole (unreduced) piece.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np

from .mesh import Mesh
from .placement import Partial, Placement, Replicate, Shard, from_torch

__all__ = ["Layout", "Box", "chunk_span"]

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Layout:
    """A tensor of `global_shape` placed on `mesh`: placements[i] says what mesh axis i does."""

    global_shape: tuple[int, ...]
    mesh: Mesh
    placements: tuple[Placement, ...]
    _boxes: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _box_of: dict | None = field(default=None, init=False, repr=False, compare=False)  # device -> box(device)

    def __post_init__(self) -> None:
        shape = tuple(self.global_shape)
        if not all(isinstance(s, numbers.Integral) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise ValueError(f"Layout global_shape must be non-negative ints, got {self.global_shape!r}")
        if not isinstance(self.mesh, Mesh):
            raise ValueError(
                f"Layout mesh must be a distconfig Mesh, got {self.mesh!r}; build one with Mesh.from_shape"
            )
        placements = tuple(
            p if isinstance(p, (Shard, Replicate, Partial)) else from_torch(p) for p in self.placements
        )
        if len(placements) != self.mesh.ndim:
            raise ValueError(
                f"Layout has {len(placements)} placements {placements} for a {self.mesh.ndim}-axis mesh "
                f"{self.mesh.axis_names}; give exactly one placement per mesh axis"
            )
        ndim = len(shape)
        for axis, p in enumerate(placements):
            if isinstance(p, Shard) and not -ndim <= p.dim < ndim:
                raise ValueError(
                    f"{p} on mesh axis {self.mesh.axis_names[axis]!r} is out of range for a "
                    f"{ndim}-dim tensor of shape {shape}; shard a dim in [{-ndim}, {ndim})"
                )
        placements = tuple(Shard(p.dim % ndim) if isinstance(p, Shard) else p for p in placements)
        object.__setattr__(self, "global_shape", tuple(int(s) for s in shape))
        object.__setattr__(self, "placements", placements)

    @property
    def ndim(self) -> int:
        return len(self.global_shape)

    @property
    def is_partial(self) -> bool:
        return any(p.is_partial() for p in self.placements)

    @property
    def is_replicated(self) -> bool:
        """Every device holds the whole (final) tensor."""
        return all(p.is_replicate() for p in self.placements)

    def boxes(self) -> np.ndarray:
        """Every device's box as an int64 array (mesh.size, ndim, 2), rows in mesh.devices order.

        Vectorized over devices (the only Python loop is over mesh axes); cached and read-only.
        """
        if self._boxes is None:
            object.__setattr__(self, "_boxes", _boxes_at(self, self.mesh.coordinates()))
        return self._boxes

    def box(self, device: int) -> Box:
        """The device's [start, stop) per tensor dim (memoized: executing a switch asks for it per slice)."""
        if self._box_of is None:
            object.__setattr__(self, "_box_of", {})
        box = self._box_of.get(device)
        if box is None:
            box = self._box_of[device] = tuple(map(tuple, self.boxes()[self.mesh.position(device)].tolist()))
        return box

    def local_shape(self, device: int) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.box(device))

    def global_offset(self, device: int) -> tuple[int, ...]:
        """Where the device's piece starts (torch's global_offset; for DCP chunk metadata)."""
        return tuple(a for a, _ in self.box(device))

    def local_shapes(self) -> np.ndarray:
        """Every device's local shape, (mesh.size, ndim), in mesh.devices order."""
        b = self.boxes()
        return b[..., 1] - b[..., 0]

    def numel(self, device: int) -> int:
        return math.prod(self.local_shape(device))

    def nbytes(self, device: int, itemsize) -> int:
        """Bytes the device holds; `itemsize` in bytes or a torch dtype (anything with .itemsize)."""
        if not isinstance(itemsize, numbers.Integral):
            itemsize = itemsize.itemsize
        return self.numel(device) * itemsize

    def owners(self) -> dict[Box, tuple[int, ...]]:
        """Each distinct non-empty box -> the devices holding it (replicas), in mesh.devices order.

        A Partial layout has no owners: no device holds the final value until it is reduced.
        """
        if self.is_partial:
            raise ValueError(
                f"layout {self.placements} is Partial: devices hold summands, not pieces of the value; "
                "reduce it first (all-reduce or reduce-scatter) and ask the reduced layout for owners"
            )
        b = self.boxes()
        nonempty = np.all(b[..., 1] > b[..., 0], axis=1)  # a 0-dim tensor's box is never empty
        result: dict[Box, list[int]] = {}
        for device, row, keep in zip(self.mesh.devices, b.tolist(), nonempty.tolist()):
            if keep:
                result.setdefault(tuple(map(tuple, row)), []).append(device)
        return {box: tuple(devices) for box, devices in result.items()}

    def __repr__(self) -> str:
        mesh = f"{self.mesh.axis_names}={self.mesh.shape}"
        return f"Layout({self.global_shape}, {list(self.placements)} on {mesh})"


def chunk_span(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of piece `index` when n elements are cut into `parts` as torch.chunk cuts them,
    and DTensor's Shard: pieces of ceil(n / parts), the last ones smaller or empty."""
    step = -(-n // parts)
    start = min(index * step, n)
    return start, min(step, n - start)


def _boxes_at(layout: Layout, coords: np.ndarray) -> np.ndarray:
    """Boxes of the devices at `coords` (n, mesh.ndim): torch's shard-by-shard walk, on arrays."""
    n = len(coords)
    full = np.asarray(layout.global_shape, dtype=np.int64)
    start = np.zeros((n, layout.ndim), dtype=np.int64)
    size = np.broadcast_to(full, (n, layout.ndim)).copy()
    for axis, p in enumerate(layout.placements):
        if not isinstance(p, Shard):
            continue
        d, k, c = p.dim, layout.mesh.shape[axis], coords[:, axis]
        chunk = -(-size[:, d] // k)  # ceil: torch.chunk's chunk size
        offset = chunk * c
        new_size = np.clip(np.minimum(size[:, d], offset + chunk) - offset, 0, None)
        # torch puts an empty piece at the end of the global dim
        start[:, d] = np.where(new_size > 0, start[:, d] + offset, full[d])
        size[:, d] = new_size
    assert np.all((start >= 0) & (start + size <= full)), "a box left its tensor"
    boxes = np.stack([start, start + size], axis=-1)
    boxes.setflags(write=False)
    return boxes
