"""distconfig: parallel layouts as plain values (no process group, no compiler).

Placements, device meshes, tensor layouts (each device's box), node topology and the DistConfig
candidates a job can hot-switch between. Imports only numpy; torch only inside the functions that
cross over to DTensor (`to_torch`, `from_torch`, `DistConfig.device_mesh`), so that the CLI's help
and pure planning start without it.
"""

from .config import GRAMMAR, DistConfig, parse_configs, standard_configs
from .layout import Box, Layout, chunk_span
from .mesh import Mesh
from .placement import Partial, Placement, Replicate, Shard, from_torch, fsdp_dim, to_torch
from .stages import balanced_split
from .topology import Topology

__all__ = [
    "GRAMMAR",
    "Box",
    "DistConfig",
    "Layout",
    "Mesh",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "Topology",
    "balanced_split",
    "chunk_span",
    "from_torch",
    "fsdp_dim",
    "parse_configs",
    "standard_configs",
    "to_torch",
]
