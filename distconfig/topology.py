"""Where devices sit and how fast they talk: the planner prices bytes with these bandwidths.

Ranks are assigned to nodes in consecutive blocks (node = rank // devices_per_node), which is what
torchrun does. Only two link classes exist, intra- and inter-node, as in HotSPa's planner.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass

__all__ = ["Topology"]


@dataclass(frozen=True, slots=True)
class Topology:
    """`num_devices` ranks on nodes of `devices_per_node`; bandwidths in bytes/s per link."""

    num_devices: int
    devices_per_node: int
    intra_node_bandwidth: float = 100e9
    inter_node_bandwidth: float = 12.5e9

    def __post_init__(self) -> None:
        for name in ("num_devices", "devices_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Topology {name} must be a positive int, got {value!r}")
        if self.num_devices % self.devices_per_node:
            raise ValueError(
                f"Topology has {self.num_devices} devices, not a multiple of devices_per_node="
                f"{self.devices_per_node}; every node must hold the same number of devices, so pick a "
                "devices_per_node that divides num_devices"
            )
        for name in ("intra_node_bandwidth", "inter_node_bandwidth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(
                    f"Topology {name} must be a positive finite number of bytes/s, got {value!r}"
                )
            object.__setattr__(self, name, float(value))

    @classmethod
    def from_env(cls, world_size: int | None = None) -> Topology:
        """The job's topology from torchrun's env, overridable so one machine can pose as several nodes.

        WORLD_SIZE (or `world_size`) devices; LOCAL_WORLD_SIZE per node unless
        HOTSWITCH_DEVICES_PER_NODE is set; HOTSWITCH_INTRA_NODE_BW / HOTSWITCH_INTER_NODE_BW in bytes/s.
        """
        if world_size is None:
            world_size = _env_number("WORLD_SIZE", int, default=1)
        per_node = _env_number("HOTSWITCH_DEVICES_PER_NODE", int, default=None)
        if per_node is None:
            per_node = _env_number("LOCAL_WORLD_SIZE", int, default=world_size)
        return cls(
            num_devices=world_size,
            devices_per_node=per_node,
            intra_node_bandwidth=_env_number("HOTSWITCH_INTRA_NODE_BW", float, default=100e9),
            inter_node_bandwidth=_env_number("HOTSWITCH_INTER_NODE_BW", float, default=12.5e9),
        )

    @property
    def num_nodes(self) -> int:
        return self.num_devices // self.devices_per_node

    def node_of(self, device: int) -> int:
        if not isinstance(device, numbers.Integral) or not 0 <= device < self.num_devices:
            raise ValueError(
                f"device {device!r} is not in this topology of {self.num_devices} devices; "
                f"use a rank in [0, {self.num_devices})"
            )
        return int(device) // self.devices_per_node

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)

    def bandwidth(self, a: int, b: int) -> float:
        """Bytes/s from a to b; a copy within one device is free (inf)."""
        if a == b:
            self.node_of(a)  # validates
            return math.inf
        return self.intra_node_bandwidth if self.same_node(a, b) else self.inter_node_bandwidth


def _env_number(name: str, kind: type, default):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={raw!r} is not a valid {kind.__name__}; set it to e.g. "
            f"{'8' if kind is int else '12.5e9'} or unset it"
        ) from None
