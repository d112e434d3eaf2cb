"""What one DistConfig holds on this rank (`ConfigState`), and the placement rules read off it: each
parameter's Layout, this rank's coordinate and groups along a mesh axis, its part of a batch.

Pure but for `make_config_state`, which builds the config's DeviceMesh (and, under pp > 1, the
process groups of parameters shared by stages): every rank calls it for every config.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh

from hotswitch.compiler.fsdp import storage_placements, units
from hotswitch.compiler.lengths import LengthFit
from hotswitch.compiler.program import StageMesh, StageProgram
from hotswitch.compiler.sharding import ShardingDecisions
from hotswitch.compiler.stages import StageSplit
from hotswitch.compiler.tp_rules import TPRoles, param_placements
from hotswitch.distconfig import DistConfig, Layout, Mesh, Replicate, chunk_span, from_torch
from hotswitch.switch.state import state_key


@dataclass
class LengthFamily:
    """A config's programs (its stage's on this rank, under pp > 1) at one local shape but the sequence
    length: the first lowered and a second (a sample, `Programs._second_length`, or lowered in
    full where sampling failed), then their fit (`compiler.lengths`), or why they do not fit."""

    # (length, program); the second's program is dropped once fitted (a sample's graph: nothing reads it again)
    lowered: list[tuple[int, StageProgram | None]] = field(default_factory=list)
    fit: LengthFit | None = None
    refused: str | None = None  # why no length is fitted: every one is lowered
    # second lengths sampled that did not fit (length, why), each then its own program: after
    # `programs._SECOND_LENGTHS` of them the family is refused (an uneven length refuses; the next may fit)
    unfit: list[tuple[int, str]] = field(default_factory=list)
    fit_loaded: bool = False  # the fit came from the compile cache (an earlier process made it)


@dataclass
class ConfigState:
    """What one DistConfig needs on this rank."""

    config: DistConfig
    mesh: DeviceMesh  # this rank's stage mesh: the config's `stage_axes` (dp, tp); all of it under pp = 1
    axis: dict[str, int]  # mesh axis name -> mesh dim
    param_specs: dict[str, tuple]  # parameter name -> torch placements, one per mesh dim
    # (local shapes, train, reduce) -> this rank's programs: whole-model graphs with the DP reduction
    # inside (reduce=True, one forward_backward call under pp = 1) or deferred (micro-batches, pp > 1)
    programs: dict[tuple, StageProgram] = field(default_factory=dict)
    compile_seconds: dict[tuple, float] = field(default_factory=dict)
    fit_seconds: float = 0.0  # spent fitting programs in the length (`compiler.lengths`)
    last_shapes: tuple | None = None
    layouts: dict | None = None  # parameter name -> distconfig Layout, built on first use
    # pp > 1: `full_mesh` is (pp, dp, cp, tp) and `mesh` this rank's stage's slice of it
    full_mesh: DeviceMesh | None = None
    stage: int = 0
    copy_groups: dict[tuple, object] = field(default_factory=dict)  # stages sharing a parameter -> this rank's group
    reductions: dict[tuple, fx.GraphModule] = field(default_factory=dict)
    # (train, stage) -> the placements decided for that graph at its first shape: later shapes replay them
    decisions: dict[tuple, ShardingDecisions] = field(default_factory=dict)
    # (local shapes but the sequence length, train, reduce) -> its programs' lengths (see Programs._fitted)
    lengths: dict[tuple, LengthFamily] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where this rank computes
    runner: str | None = None  # the backend whose fused attention kernels its programs get (StageMesh.runner)
    # fsdp: the placements parameters compute in (`param_specs` is where they are stored), and their units
    compute_specs: dict[str, tuple] | None = None
    units: dict[str, str] | None = None

    @property
    def where(self) -> StageMesh:
        """The stage's mesh and placements, as the compiler's lowering takes them."""
        compute = self.compute_specs or self.param_specs
        storage = {n: p for n, p in self.param_specs.items() if p != compute[n]} or None
        return StageMesh(self.mesh, self.axis, self.config.dp, self.config.sp, compute, self.config.name,
                         self.device, cp=self.config.cp, runner=self.runner, param_storage=storage,
                         units=self.units if storage else None, recompute=self.config.recompute)

    def coordinate(self, axis_name: str) -> int:
        """This rank's coordinate along mesh axis `axis_name` (0 where the mesh has no such axis)."""
        if axis_name not in self.axis:
            return 0
        return self.mesh.get_coordinate()[self.axis[axis_name]]

    def groups(self, axis_name: str) -> list[list[int]]:
        """The mesh's groups along `axis_name` (ranks whose coordinates differ on that axis alone), each
        a list of ranks in the axis's order; every rank its own group when the mesh has no such axis."""
        mesh = self.mesh.mesh
        if axis_name not in self.axis:
            return [[r] for r in mesh.flatten().tolist()]
        return mesh.movedim(self.axis[axis_name], -1).reshape(-1, mesh.size(self.axis[axis_name])).tolist()

    def local_batch_shapes(self, shapes: tuple, sequence_inputs: tuple[bool, ...]) -> tuple:
        """This rank's part of a global batch of `shapes`: its data-parallel rows and, under context
        parallelism, its share of the sequence (of the inputs `sequence_inputs` marks)."""
        dp, index, cp = self.config.dp, self.coordinate("dp"), self.config.cp
        return tuple((split_size(s[0], dp, index), chunk_span(s[1], cp, self.coordinate("cp"))[1], *s[2:])
                     if cp > 1 and along_seq else (split_size(s[0], dp, index), *s[1:])
                     for s, along_seq in zip(shapes, sequence_inputs))

    def cp_length(self, shapes: tuple, sequence_inputs: tuple[bool, ...]) -> int | None:
        """The global sequence length of a batch of `shapes` when context parallelism cuts it unevenly
        (cp ranks then hold different lengths, so a program is lowered for the global one); None
        when cp divides it (a program is then lowered for its local length times cp)."""
        cp = self.config.cp
        lengths = {s[1] for s, along_seq in zip(shapes, sequence_inputs) if along_seq}
        return next((n for n in lengths if n % cp), None) if cp > 1 else None


def make_config_state(config: DistConfig, roles: TPRoles, param_shapes: dict[str, torch.Size], *, rank: int,
                      device: torch.device, runner: str | None, split: StageSplit | None) -> ConfigState:
    """`config`'s state on this rank: its mesh (the stage's, under pp > 1, whose cut `split` is) and
    every parameter's placements (under fsdp: stored sharded over dp, `compiler.fsdp`). A collective
    under pp > 1 (the groups of parameters shared by stages)."""
    axis = {a: i for i, a in enumerate(config.stage_axes)}
    compute = param_placements(roles, list(param_shapes), config.tp, axis.get("tp"), len(axis), config.name)
    specs, fsdp = compute, {}
    if config.fsdp:
        specs = storage_placements(compute, param_shapes, axis["dp"], config.dp)
        fsdp = dict(compute_specs=compute, units=units(list(param_shapes)))
    if config.pp == 1:
        return ConfigState(config, config.device_mesh(device.type), axis, specs, device=device, runner=runner, **fsdp)
    # pp > 1: a (pp, dp, cp, tp) mesh; stage s runs on its (dp, cp, tp) slice, where parameters are placed
    full = config.device_mesh(device.type)
    mesh = full[config.stage_axes[0]] if len(config.stage_axes) == 1 else full[config.stage_axes]
    st = ConfigState(config, mesh, axis, specs, full_mesh=full, stage=int(full.get_coordinate()[0]),
                     device=device, runner=runner, **fsdp)
    # parameters shared by stages (a tied embedding): the copies' gradients are summed over the
    # ranks at the same (dp, tp) coordinate of those stages. Every rank creates every group.
    grid = full.mesh.reshape(config.pp, -1)
    for stages in sorted(set(split.shared.values())):
        for position in range(grid.shape[1]):
            ranks = [int(grid[s][position]) for s in stages]
            group = dist.new_group(ranks)
            if rank in ranks:
                st.copy_groups[stages] = group
    return st


def parameter_layouts(st: ConfigState, param_shapes: dict[str, torch.Size], split: StageSplit | None,
                      kinds: tuple[str, ...] = (), weights: bool = True) -> dict[str, Layout]:
    """distconfig Layouts of every parameter (unless `weights=False`) and of each state kind (same
    layout, keys `state_key(kind, name)`) under `st`'s config; built once (`st.layouts`)."""
    if st.layouts is None and st.full_mesh is not None:
        # pp > 1: a parameter lives only on its stage's (dp, cp, tp) sub-mesh of the (pp, dp, cp, tp) mesh
        # (a shared parameter: a copy on each of its stages, a "copy" axis of Replicate() over them)
        grid, axes = st.full_mesh.mesh, tuple(st.mesh.mesh_dim_names)
        st.layouts = {}
        for n, shape in param_shapes.items():
            stages, placements = split.param_stages[n], tuple(from_torch(p) for p in st.param_specs[n])
            if len(stages) == 1:
                mesh = Mesh(grid[stages[0]].tolist(), axes)
            else:
                mesh, placements = Mesh(grid[list(stages)].tolist(), ("copy", *axes)), (Replicate(), *placements)
            st.layouts[n] = Layout(tuple(shape), mesh, placements)
    if st.layouts is None:
        mesh = Mesh(st.mesh.mesh.tolist(), tuple(st.mesh.mesh_dim_names))
        st.layouts = {n: Layout(tuple(shape), mesh, tuple(from_torch(p) for p in st.param_specs[n]))
                      for n, shape in param_shapes.items()}
    out = dict(st.layouts) if weights else {}
    for kind in kinds:
        out.update({state_key(kind, n): layout for n, layout in st.layouts.items()})
    return out


def layouts_on(config: DistConfig, devices, roles: TPRoles, param_shapes: dict[str, torch.Size]) -> dict[str, Layout]:
    """{parameter name: Layout} under a pp = 1 `config` laid out on `devices` (any ids): pure (as
    `make_config_state` places them: fsdp's shards too)."""
    if config.pp > 1:
        raise ValueError(f"layouts_for supports pp = 1 configs, got {config.name!r} (pp={config.pp})")
    devices = [int(d) for d in devices]
    if config.world_size != len(devices):
        raise ValueError(f"config {config.name!r} needs {config.world_size} devices, got {len(devices)}: {devices}")
    mesh = config.compute_mesh(devices)
    tp_dim = mesh.axis_index("tp") if "tp" in mesh.axis_names else None
    placements = param_placements(roles, list(param_shapes), config.tp, tp_dim, mesh.ndim, config.name)
    if config.fsdp:
        placements = storage_placements(placements, param_shapes, mesh.axis_index("dp"), config.dp)
    return {n: Layout(tuple(shape), mesh, tuple(from_torch(p) for p in placements[n]))
            for n, shape in param_shapes.items()}


def split_size(n: int, parts: int, index: int) -> int:
    """Rows of part `index` when n rows are split by torch.tensor_split into `parts`."""
    return n // parts + (1 if index < n % parts else 0)

