"""A device mesh as a value: which device sits at which coordinate, with named axes.

Unlike torch's DeviceMesh it needs no process group, so planners can reason about 1024 devices
on one machine. Devices are stored flat in row-major order (the last axis is innermost).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Mesh"]


@dataclass(frozen=True, slots=True)
class Mesh:
    """`devices` may be given nested (e.g. [[0, 1], [2, 3]]) or as a numpy array; it is stored flat.

    The mesh's shape is the nesting's shape; use `Mesh.from_shape` to lay out a flat device list.
    """

    devices: tuple[int, ...]
    axis_names: tuple[str, ...]
    shape: tuple[int, ...] = field(init=False)
    _position: dict[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            grid = np.asarray(self.devices)
        except ValueError as e:  # ragged nesting
            raise ValueError(
                f"Mesh devices must be a rectangular nesting of ints, got {self.devices!r}; "
                "use Mesh.from_shape(shape, axis_names, devices) for a flat list"
            ) from e
        names = tuple(self.axis_names) if not isinstance(self.axis_names, str) else (self.axis_names,)
        if grid.size and not np.issubdtype(grid.dtype, np.integer):
            raise ValueError(f"Mesh devices must be ints (ranks), got {self.devices!r}")
        if grid.ndim == 0 or grid.size == 0:
            raise ValueError("a Mesh needs at least one axis and one device; pass e.g. [[0, 1]] or [0]")
        if len(names) != grid.ndim:
            raise ValueError(
                f"Mesh has {grid.ndim} axes (shape {grid.shape}) but {len(names)} axis_names {names}; "
                "give one name per axis"
            )
        if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
            raise ValueError(f"Mesh axis_names must be distinct non-empty strings, got {names}")
        flat = tuple(int(d) for d in grid.reshape(-1))
        if min(flat) < 0 or len(set(flat)) != len(flat):
            raise ValueError(f"Mesh devices must be distinct non-negative ranks, got {flat}")
        object.__setattr__(self, "devices", flat)
        object.__setattr__(self, "axis_names", names)
        object.__setattr__(self, "shape", tuple(int(s) for s in grid.shape))
        object.__setattr__(self, "_position", {d: i for i, d in enumerate(flat)})

    @classmethod
    def from_shape(
        cls,
        shape: Sequence[int],
        axis_names: Sequence[str],
        devices: Sequence[int] | None = None,
    ) -> Mesh:
        """Lay `devices` (default 0..n-1) out row-major over `shape`: last-axis peers are consecutive."""
        shape = tuple(int(s) for s in shape)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"Mesh shape must be a non-empty tuple of positive sizes, got {shape}")
        n = math.prod(shape)
        devices = tuple(range(n)) if devices is None else tuple(devices)
        if len(devices) != n:
            raise ValueError(
                f"Mesh shape {shape} holds {n} devices but {len(devices)} were given; "
                f"pass exactly {n} devices or change the shape"
            )
        return cls(np.asarray(devices, dtype=np.int64).reshape(shape), tuple(axis_names))

    def __repr__(self) -> str:
        devices = self.devices
        if devices == tuple(range(devices[0], devices[0] + len(devices))):
            devices = f"range({devices[0]}, {devices[0] + len(devices)})"
        return f"Mesh(shape={self.shape}, axis_names={self.axis_names}, devices={devices})"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return len(self.devices)

    def as_array(self) -> np.ndarray:
        """The devices as an int array of shape `shape` (a fresh copy: safe to modify)."""
        return np.asarray(self.devices, dtype=np.int64).reshape(self.shape)

    def axis_index(self, axis: str | int) -> int:
        """Position of an axis, given by name (or already by position)."""
        if isinstance(axis, int) and not isinstance(axis, bool):
            if not -self.ndim <= axis < self.ndim:
                raise ValueError(f"mesh axis {axis} is out of range for a {self.ndim}-axis mesh")
            return axis % self.ndim
        if axis not in self.axis_names:
            raise ValueError(f"mesh has no axis {axis!r}; its axes are {self.axis_names}")
        return self.axis_names.index(axis)

    def axis_size(self, axis: str | int) -> int:
        return self.shape[self.axis_index(axis)]

    def contains(self, device: int) -> bool:
        return device in self._position

    def position(self, device: int) -> int:
        """Index of `device` in `devices` (row-major order)."""
        try:
            return self._position[device]
        except (KeyError, TypeError):
            raise ValueError(
                f"device {device!r} is not in this mesh (devices {self.devices}); "
                "ask only about the mesh's own devices"
            ) from None

    def coordinate(self, device: int) -> tuple[int, ...]:
        """The device's coordinate, one index per mesh axis."""
        return tuple(int(c) for c in np.unravel_index(self.position(device), self.shape))

    def coordinates(self) -> np.ndarray:
        """All coordinates as an int array (size, ndim), rows in `devices` order."""
        return np.stack(np.unravel_index(np.arange(self.size), self.shape), axis=1).astype(np.int64)

    def axis_groups(self, axis: str | int) -> tuple[tuple[int, ...], ...]:
        """Devices that talk along `axis`: the same groups, in the same order, as torch's DeviceMesh.

        Each group is ordered by the coordinate along `axis`; groups by the other coordinates
        (row-major).
        """
        a = self.axis_index(axis)
        groups = np.moveaxis(self.as_array(), a, -1).reshape(-1, self.shape[a])
        return tuple(tuple(int(d) for d in g) for g in groups)
