"""distconfig: parallel layouts as plain values (no process group, no compiler).

Placements, device meshes, tensor layouts (each device's box), node topology and the DistConfig
candidates a job can hot-switch between. Imports only numpy and torch.
"""

from .config import DistConfig
from .layout import Box, Layout
from .mesh import Mesh
from .placement import Partial, Placement, Replicate, Shard, from_torch, to_torch
from .topology import Topology

__all__ = [
    "Box",
    "DistConfig",
    "Layout",
    "Mesh",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "Topology",
    "from_torch",
    "to_torch",
]
