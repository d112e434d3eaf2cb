"""The public API: `compile(model, example_inputs, configs)` -> CompiledModel.

A CompiledModel holds one traced LogicGraph, the parameter layouts of every DistConfig, this rank's
ExecGraphs (compiled for the example shapes up front, for other input shapes on first use and
cached), and the local shards of the active config's parameters and gradients.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hotswitch.compiler import _dtensor as dt
from hotswitch.compiler.cache import default_cache
from hotswitch.compiler.garbage import collector_paused
from hotswitch.compiler.handoff import handing_off
from hotswitch.compiler.lengths import CannotFit, LengthFit
from hotswitch.compiler.program import (
    StageMesh,
    StageProgram,
    completed,
    fit_key,
    fit_programs,
    load_fit,
    lower_program,
    program_at,
    store_fit,
)
from hotswitch.compiler.reduce import BUCKET_BYTES
from hotswitch.compiler.sharding import ShardingDecisions
from hotswitch.compiler.signature import ModelCall
from hotswitch.compiler.stages import StageSplit, split_stages
from hotswitch.compiler.tp_rules import TPRoles, infer_tp_roles, param_placements
from hotswitch.compiler.trace import LogicGraph
from hotswitch.distconfig import DistConfig, Layout, Mesh, Replicate, Topology, from_torch, parse_configs
from hotswitch.distributed.device import comm_tensor, runtime_device, synchronize
from hotswitch.runtime.backend import GraphRunner
from hotswitch.runtime.pipeline import SCHEDULES, StepStats, reduction_for, run_step
from hotswitch.runtime.shared import JobOnce, SharedCache, trace_once
from hotswitch.switch.executor import BackgroundMove, GradientHandoff, SwitchAborted, SwitchStats, execute_plan
from hotswitch.switch.order import OrderPlan, plan_order
from hotswitch.switch.planner import PlanCache, SwitchPlan, TensorMove
from hotswitch.switch.state import StateKind, split_key, state_key

# second lengths a config's rows sample before every length is lowered (`LengthFamily.unfit`)
_SECOND_LENGTHS = 3


@dataclass
class LengthFamily:
    """A config's programs (its stage's on this rank, under pp > 1) at one local shape but the sequence
    length: the first lowered and a second (a sample, `CompiledModel._second_length`, or lowered in
    full where sampling failed), then their fit (`compiler.lengths`), or why they do not fit."""

    # (length, program); the second's program is dropped once fitted (a sample's graph: nothing reads it again)
    lowered: list[tuple[int, StageProgram | None]] = field(default_factory=list)
    fit: LengthFit | None = None
    refused: str | None = None  # why no length is fitted: every one is lowered
    # second lengths sampled that did not fit (length, why), each then its own program: after
    # `_SECOND_LENGTHS` of them the family is refused (an uneven length refuses; the next may fit)
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
    # (local shapes but the sequence length, train, reduce) -> its programs' lengths (see _fitted)
    lengths: dict[tuple, LengthFamily] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where this rank computes
    runner: str | None = None  # the backend whose fused attention kernels its programs get (StageMesh.runner)

    @property
    def where(self) -> StageMesh:
        """The stage's mesh and placements, as the compiler's lowering takes them."""
        return StageMesh(self.mesh, self.axis, self.config.dp, self.config.sp, self.param_specs, self.config.name,
                         self.device, cp=self.config.cp, runner=self.runner)


class CompiledModel:
    def __init__(self, model: torch.nn.Module, example_inputs, configs, *, strict: bool = True,
                 topology: Topology | None = None, lazy: bool = False, progress=None,
                 logic: LogicGraph | None = None, cp_layout: str = "contiguous", backend: str = "eager",
                 dynamic: bool | None = None, grad_bucket_bytes: int | None = None):
        if grad_bucket_bytes is not None and (isinstance(grad_bucket_bytes, bool)
                                              or not isinstance(grad_bucket_bytes, int) or grad_bucket_bytes < 1):
            raise ValueError(f"grad_bucket_bytes must be a positive number of bytes (DDP's bucket_cap_mb * 2**20), "
                             f"got {grad_bucket_bytes!r}; None keeps the default, {BUCKET_BYTES >> 20} MiB")
        if not dist.is_initialized():
            raise RuntimeError("hotswitch.compile needs torch.distributed: call dist.init_process_group first "
                               "(gloo on CPU, nccl on GPU), on every rank")
        configs = parse_configs(configs)  # DistConfigs, "dp2tp2sp" or "dp=2,tp=2,sp", or "dp4;tp4sp": one grammar
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        # where shards, gradients and switch buffers live: the process group's device (gloo: cpu,
        # nccl: this rank's GPU); see hotswitch.distributed.device
        self.device = runtime_device()
        for c in configs:
            c.check_world_size(self.world_size)
            if c.world_size != self.world_size:
                raise ValueError(f"config {c.name!r} uses {c.world_size} of the {self.world_size} processes; "
                                 f"every config must use all of them (set dp*tp*pp = {self.world_size})")
        self.strict = strict
        self.cp_layout = cp_layout
        self.topology = topology or Topology.from_env(self.world_size)
        self._plans = PlanCache()
        self.last_switch: SwitchStats | None = None
        self._configs = tuple(configs)
        if dynamic is not None and not isinstance(dynamic, bool):
            raise ValueError(f"dynamic must be None, True or False, got {dynamic!r}")
        self.dynamic = dynamic  # how new sequence lengths are compiled: see `compile`
        self.grad_bucket_bytes = BUCKET_BYTES if grad_bucket_bytes is None else grad_bucket_bytes
        self._report = report = progress or (lambda message: None)
        t0 = time.perf_counter()
        # sharding decisions and the LogicGraph: computed by one rank for all, and kept on disk for
        # later processes (HOTSWITCH_CACHE=0: off)
        disk = default_cache()
        self._cache = SharedCache(disk, JobOnce())
        # how ExecGraphs run: op by op, or compiled by Inductor on first use (its caches beside ours)
        self._runner = GraphRunner(backend, disk.directory if disk is not None else None, report, once=JobOnce(),
                                   device=self.device)
        # `logic`: this model's LogicGraph from an earlier compile (elastic changes re-compile, not re-trace)
        self.logic_source = "given"  # or "traced" (by this rank), "loaded" (this process, the cache or a rank had it)
        if logic is None:
            report("tracing the model (torch.export, core ATen, joint forward + backward graph)")
            logic, self.logic_source = trace_once(model, example_inputs, self._cache)
        self.logic: LogicGraph = logic
        self._sequence_inputs = logic.sequence_inputs()  # per input: is dim 1 the sequence (cp splits it)
        self.call: ModelCall = self.logic.call or ModelCall.of(model, example_inputs)
        self._example_inputs = self.call.flatten_example(example_inputs)  # its tensors, in the graphs' order
        self._warned_unsharded = False
        self.trace_seconds = time.perf_counter() - t0
        if self.logic_source != "given":
            report(f"{self.logic_source} in {self.trace_seconds:.1f} s: {len(self.logic.joint.graph.nodes)} nodes, "
                   f"{len(self.logic.param_names)} parameters")
        self.roles: TPRoles = infer_tp_roles(
            self.logic.forward.graph, self.logic.param_names, len(self.logic.buffer_names)
        )
        tensors = {
            **dict(model.named_buffers(remove_duplicate=False)),
            **dict(model.named_parameters(remove_duplicate=False)),
        }
        self._buffers = [tensors[n].detach().to(self.device, copy=True) for n in self.logic.buffer_names]
        self._state_keys = list(model.state_dict().keys())
        self._splits: dict[int, StageSplit] = {}  # pp -> the LogicGraph cut into pp stages
        self._state_dtypes: dict[str, dict[str, torch.dtype]] = {}  # attached kind -> dtype per parameter
        self.pipeline_schedule = "1f1b"  # forward_backward's default schedule for pp > 1 ("1f1b" | "gpipe")
        self.last_step: StepStats | None = None
        self._states: dict[str, ConfigState] = {c.name: self._make_state(c) for c in configs}
        self._local: dict[str, torch.Tensor] = {}
        self._grads: dict[str, torch.Tensor] | None = None
        self.grad_dtype: torch.dtype | None = None  # gradient accumulators' dtype; None: the parameter's
        self._param_states: dict[str, dict[str, torch.Tensor]] = {}
        self._global_shapes: dict[tuple, tuple] = {}
        # config -> DTensor propagation results shared by that config's lowerings. Not across configs:
        # two configs' meshes can compare equal (same ranks) yet own different process groups, and a
        # result carries its mesh, so the collectives it leads to would name the other config's group
        self._propagation_memo: dict[str, dict] = {}
        self._prefetch: BackgroundMove | None = None  # the next config's weights, moving in the background
        self._prefetch_group = None  # its process group (made on first use): apart from the ExecGraphs'
        self._hand_off: GradientHandoff | None = None  # gradients moving into the next config during a backward
        self._hand_off_groups = None  # its process groups (made on first use; see GradientHandoff)
        shapes = tuple(tuple(x.shape) for x in self._example_inputs)
        for c in configs if not lazy else ():
            self.exec_graph(c.name, shapes)
        # ranks start from identical full weights: each keeps its pieces under the first config
        self._local = self._pieces(
            self._states[configs[0].name], {n: tensors[n].detach() for n in self.logic.param_names}
        )
        self._active = configs[0].name

    # ------------------------------------------------------------------------------- public surface
    @property
    def configs(self) -> tuple[DistConfig, ...]:
        return self._configs

    @property
    def backend(self) -> str:
        """How ExecGraphs run: "eager" or "inductor" (see hotswitch.runtime.backend)."""
        return self._runner.backend

    @property
    def graph_runner(self) -> GraphRunner:
        """The backend's bookkeeping: graphs compiled, seconds spent compiling, graphs left eager."""
        return self._runner

    @property
    def active(self) -> str:
        return self._active

    def exec_graph(self, name: str, shapes: tuple | None = None) -> fx.GraphModule:
        """This rank's training ExecGraph for config `name` (for the given or last-used input shapes).

        With pp > 1: this rank's stage's lowered joint graph for one micro-batch of the global
        `shapes` (the gradient reduction is a separate program, run once per step)."""
        st = self._state(name)
        shapes = tuple(
            tuple(s) for s in (shapes or st.last_shapes or tuple(tuple(x.shape) for x in self._example_inputs))
        )
        st.last_shapes = shapes
        if st.config.pp == 1:
            self._check_split(st, shapes)
        return self._program(st, self._local_shapes(st, shapes), train=True, reduce=st.config.pp == 1).joint

    def switch(self, name: str, algorithm: str = "greedy", weights: dict[str, torch.Tensor] | None = None
               ) -> SwitchStats:
        """Activate config `name`: weights, accumulated gradients and every attached per-parameter
        state move to its layout by the cached plan. Atomic: on any failure every rank stays in the
        previous config. Call on every rank.

        The weights do not move when they are already there: prefetched (`prefetch(name)`), or given
        as `weights`, this rank's shards in `name`'s layout (the Trainer keeps its base's weights through a
        step). Only gradients and attached states then move."""
        st = self._state(name)
        prefetched = self._take_prefetch(name)
        t0 = time.perf_counter()
        handed = self._take_hand_off(name)
        if name == self._active:
            return SwitchStats(name, name, algorithm, 0.0, 0, 0)
        overlapped, sent, received, handed_off = 0.0, 0, 0, 0
        if weights is None and prefetched is not None:
            (weights, sent, received), overlapped = prefetched
        if weights is not None:
            self._check_weights(name, weights)
        kinds = self._moving_kinds()
        new = {}
        if handed is not None:  # the gradients left during the last backward: what arrived is theirs
            grads, s, r, handed_off = handed
            new.update({state_key(StateKind.GRAD, n): g for n, g in grads.items()})
            sent, received = sent + s, received + r
            kinds = tuple(k for k in kinds if k != StateKind.GRAD)
        move_weights = weights is None
        if move_weights or kinds:
            plan = self.plan_switch(self._active, name, algorithm=algorithm, with_grads=StateKind.GRAD in kinds,
                                    states=tuple(k for k in kinds if k != StateKind.GRAD), weights=move_weights)
            old = dict(self._local) if move_weights else {}
            for kind in kinds:
                old.update({state_key(kind, n): t for n, t in self._kind(kind).items()})
            src, dst = self._layouts(self._active, kinds, move_weights), self._layouts(name, kinds, move_weights)
            moved, s, r = execute_plan(plan, old, src, dst, self.rank, dtypes={m: self._dtype(m) for m in dst},
                                       device=self.device)
            new.update(moved)
            sent, received = sent + s, received + r
        if weights is not None:
            new.update(weights)
        # under pp > 1 a rank holds only its stage's parameters: the others are absent from `new`
        self._local = {n: new[n] for n in self.logic.param_names if n in new}
        if self._grads is not None:
            self._grads = {n: new[state_key(StateKind.GRAD, n)] for n in self.logic.param_names
                           if state_key(StateKind.GRAD, n) in new}
        for kind in self._param_states:
            self._param_states[kind] = {n: new[state_key(kind, n)] for n in self.logic.param_names
                                        if state_key(kind, n) in new}
        synchronize(self.device)  # the received buffers are unpacked (CUDA queues the work) before the clock
        self.last_switch = SwitchStats(
            self._active, st.config.name, algorithm, time.perf_counter() - t0, sent, received, overlapped, handed_off
        )
        self._active = name
        return self.last_switch

    def prefetch(self, name: str, algorithm: str = "greedy") -> None:
        """Start moving the weights into config `name`'s layout in the background (a thread, on a
        process group of its own) while the active config computes; the next `switch(name)` waits for
        them and moves only the gradients and attached states. The weights must not change meanwhile
        (`set_local_params` discards the prefetch). This rank then holds two layouts of the weights.
        Call on every rank."""
        self._state(name)
        self._take_prefetch(None)
        if name == self._active:
            return
        if self._prefetch_group is None:  # a collective: every rank makes it at its first prefetch
            self._prefetch_group = dist.new_group(list(range(self.world_size)))
        plan = self.plan_switch(self._active, name, algorithm=algorithm)
        dst = self._layouts(name)
        self._prefetch = BackgroundMove(name, plan, dict(self._local), self._layouts(self._active), dst, self.rank,
                                        self._prefetch_group, dtypes={m: self._dtype(m) for m in dst},
                                        device=self.device)

    def hand_off_grads(self, name: str, algorithm: str = "greedy") -> bool:
        """Move the gradients into config `name`'s layout during the next forward_backward: its
        ExecGraph hands each reduction bucket's gradients off once they are final (`compiler.handoff`),
        so they travel while the rest of the backward runs; the following `switch(name)` waits for them
        and moves only the rest (the weights unless given or prefetched, attached states). Same numbers
        as a switch after the backward. The gradients must not change in between: whatever touches
        them first (another forward_backward, `accumulate_grads`, `zero_grad`, a switch elsewhere)
        completes the hand-off and drops it, and a later switch moves them as usual. Returns False,
        arming nothing, where it does not apply: `name` is active, the active config is pipelined,
        the plan relays or sends nothing, or the job runs on NCCL (point-to-point messages during a
        backward have not run on a GPU yet: there the switch moves the gradients after it, as
        before). Call on every rank."""
        self._state(name)
        self._settle_hand_off()
        if name == self._active or self._states[self._active].config.pp > 1 or dist.get_backend() != "gloo":
            return False
        plan = self.plan_switch(self._active, name, algorithm=algorithm, with_grads=True, weights=False)
        if not GradientHandoff.supports(plan):
            return False
        if self._hand_off_groups is None:  # collectives: every rank makes them at its first hand-off
            self._hand_off_groups = tuple(dist.new_group(list(range(self.world_size))) for _ in range(2))
        grads = (StateKind.GRAD,)
        src, dst = self._layouts(self._active, grads, False), self._layouts(name, grads, False)
        self._hand_off = GradientHandoff(
            name, plan, list(self.logic.param_names), {n: state_key(StateKind.GRAD, n) for n in self.logic.param_names},
            src, dst, self.rank, self._hand_off_groups, dtypes={m: self._dtype(m) for m in dst},
            accumulated=lambda: self._grads or {}, device=self.device,
            group_bytes=self.grad_bucket_bytes // 4)
        return True

    def _take_hand_off(self, name: str):
        """The gradients handed off into `name` during the last forward_backward as (grads, sent,
        received, sent during that backward), or None; a hand-off elsewhere (or not run yet) is
        completed and dropped."""
        pending = self._hand_off
        if pending is None or pending.destination != name or not pending.ran:
            self._settle_hand_off()
            return None
        self._hand_off = None
        return (*pending.finish(), pending.bytes_during_backward)

    def _settle_hand_off(self) -> None:
        """Complete a pending hand-off and drop what it moved (every rank has its messages under way)."""
        pending, self._hand_off = self._hand_off, None
        if pending is not None:
            with contextlib.suppress(SwitchAborted):
                pending.finish()

    def _take_prefetch(self, name: str | None):
        """The finished prefetch into `name` as ((weights, sent, received), seconds), or None; a
        prefetch into another config is waited for and dropped (its transfers are under way on
        every rank)."""
        pending, self._prefetch = self._prefetch, None
        if pending is None:
            return None
        out = pending.result()
        return (out, pending.seconds) if pending.destination == name else None

    def _check_weights(self, name: str, weights: dict[str, torch.Tensor]) -> None:
        layouts = self._layouts(name)
        for n in self._held(self._states[name]):
            want = tuple(layouts[n].local_shape(self.rank))
            if n not in weights or tuple(weights[n].shape) != want:
                got = tuple(weights[n].shape) if n in weights else "nothing"
                raise ValueError(f"switch({name!r}, weights=...): {n} needs this rank's shard of shape {want}, "
                                 f"got {got}")

    def attach_state(self, kind: str, local: dict[str, torch.Tensor]) -> None:
        """Attach per-parameter state (fp32 master weights, optimizer moments, ...) given as this
        rank's shards in the active config's layout; from now on it moves with every switch.

        Under a pipeline config a rank gives only its stage's parameters' shards. When any config has
        pp > 1 this is a collective (call on every rank): ranks learn the dtypes of shards they may
        receive later."""
        if kind == StateKind.GRAD or ":" in kind:
            raise ValueError(f"state kind {kind!r} is reserved or contains ':'; pick another name such as 'exp_avg'")
        missing = set(self._local) - set(local)
        if missing:
            raise ValueError(
                f"state {kind!r} lacks entries for {sorted(missing)[:3]}...: give one tensor per parameter "
                "this rank holds (all of them, or under pp > 1 those of its stage)"
            )
        for n in self._local:
            if tuple(local[n].shape) != tuple(self._local[n].shape):
                raise ValueError(
                    f"state {kind!r} of {n} has shape {tuple(local[n].shape)}, but this rank's shard of the "
                    f"parameter under {self._active!r} has shape {tuple(self._local[n].shape)}"
                )
        self._param_states[kind] = {n: local[n] for n in self._local}
        dtypes = {n: t.dtype for n, t in self._param_states[kind].items()}
        if any(c.pp > 1 for c in self._configs):  # a rank receiving a parameter it never held must know its dtype
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, dtypes)
            dtypes = {n: d for g in gathered for n, d in g.items()}
        self._state_dtypes[kind] = dtypes

    def state(self, kind: str) -> dict[str, torch.Tensor]:
        """This rank's shards of an attached per-parameter state, in the active layout."""
        if kind not in self._param_states:
            raise ValueError(f"no state {kind!r} attached; attached: {sorted(self._param_states)}")
        return dict(self._param_states[kind])

    def detach_state(self, kind: str) -> dict[str, torch.Tensor]:
        return self._param_states.pop(kind)

    def full_state(self, kind: str) -> dict[str, torch.Tensor]:
        """An attached state gathered to full tensors (a collective: call on every rank)."""
        return self._full(self.state(kind))

    def shard_like_params(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's pieces of full per-parameter tensors, in the active config's layout."""
        return self._pieces(self._states[self._active], full)

    def plan_switch(self, source: str, destination: str, algorithm: str = "greedy",
                    with_grads: bool = False, states: tuple[str, ...] = (), weights: bool = True) -> SwitchPlan:
        """The plan moving weights (unless `weights=False`), gradients and attached states from one
        config's layout to another's. Pure: no communication; every rank computes the same plan;
        cached per pair."""
        self._state(source), self._state(destination)
        kinds = ((StateKind.GRAD,) if with_grads else ()) + tuple(states)

        def moves():
            src, dst = self._layouts(source, kinds, weights), self._layouts(destination, kinds, weights)
            return [TensorMove(n, tuple(src[n].global_shape), self._itemsize(n), src[n], dst[n]) for n in src]

        return self._plans.get((source, kinds, weights), (destination, kinds, weights), moves, self.topology,
                               algorithm)

    def plan_order(self, names, base: str | None = None) -> OrderPlan:
        """The cheapest cycle through `names` (from and back to `base`, default the first), priced by
        the plans' estimated seconds; the first switch of a step moves weights only."""
        for n in names:
            self._state(n)
        return plan_order(
            list(names), lambda a, b, first: self.plan_switch(a, b, with_grads=not first).estimated_seconds, base=base
        )

    @property
    def cp_layout(self) -> str:
        """How `shard_inputs` lays the sequence out over cp ranks (see CP_LAYOUTS)."""
        return self._cp_layout

    @cp_layout.setter
    def cp_layout(self, layout: str) -> None:
        if layout not in CP_LAYOUTS:
            raise ValueError(f"unknown cp_layout {layout!r}; choose one of {', '.join(CP_LAYOUTS)}")
        self._cp_layout = layout

    def shard_inputs(self, *args, **kwargs):
        """This rank's part of a global batch: every tensor input's dim 0 split over the data-parallel
        axis (torch.tensor_split sizes) and, under context parallelism, the sequence dim (dim 1) of
        every input that has one over the cp axis, as `cp_layout` says (CP_LAYOUTS). Mirrors the call:
        positional inputs give a tuple (`cm.forward_backward(*cm.shard_inputs(*batch))`), keyword
        inputs a dict (`cm.forward_backward(**cm.shard_inputs(**batch))`); non-tensor inputs pass through."""
        if args and kwargs:
            raise ValueError("shard_inputs takes the inputs either positionally or by keyword, not both, so that it "
                             "can return them in the same form (a tuple or a dict)")
        global_inputs = self.call.flatten(args, kwargs, what="shard_inputs")
        st = self._states[self._active]
        dp = st.config.dp
        index = self._coordinate(st, "dp")
        self._check_split(st, tuple(tuple(x.shape) for x in global_inputs))  # batch >= dp, cp divides lengths
        along_seq = dict(zip(map(id, global_inputs), self._sequence_inputs))
        cp, cp_index = st.config.cp, self._coordinate(st, "cp")
        tokens = None  # this cp rank's tokens (flat indices into the dp shard's rows), for a placed layout
        if cp > 1 and self.cp_layout != "contiguous":
            names = dict(zip(map(id, global_inputs), self.call.tensor_names))
            ids = next((x for x in global_inputs if names[id(x)] == "document_ids"), None)
            if ids is None:
                raise ValueError(f"cp_layout={self.cp_layout!r} moves tokens, which is exact only when attention reads "
                                 "document ids and positions: give the model a `document_ids` input "
                                 "(hotswitch.models.PackedCausalLMLoss with document_ids_of(position_ids)), or use "
                                 "cp_layout='contiguous'")
            tokens = _cp_tokens(self.cp_layout, ids.tensor_split(dp, dim=0)[index] if dp > 1 else ids, cp, cp_index)

        def split(x):
            if not isinstance(x, torch.Tensor):
                return x
            local = x.tensor_split(dp, dim=0)[index] if dp > 1 else x
            if cp > 1 and along_seq.get(id(x), False):
                if tokens is not None:
                    return local.flatten(0, 1)[tokens].view(local.shape[0], -1, *local.shape[2:])
                return local.chunk(cp, dim=1)[cp_index].contiguous()  # contiguous: the program views its inputs
            return local

        local = tuple(split(x) for x in global_inputs)
        self._global_shapes[(self._active, tuple(tuple(x.shape) for x in local))] = tuple(
            tuple(x.shape) for x in global_inputs
        )
        return self.call.map_tensors(split, args, kwargs)

    def forward_backward(self, *args, grad_scale: float = 1.0, micro_batches: int = 1, schedule: str | None = None,
                         **kwargs) -> torch.Tensor:
        """Loss of the global batch; gradients (DP-reduced) accumulate on the local shards.

        The inputs are this rank's part of the batch (`shard_inputs`), positional or by keyword as
        the example inputs were (a missing or extra input is an error naming the expected ones).

        `grad_scale` multiplies this call's gradients before they are added, so that micro-batches
        of a larger batch can be weighted by their share of its loss denominator (token count).
        Accumulators are kept in `grad_dtype` (fp32 accumulation of bf16 gradients) when it is set.

        `micro_batches=k` cuts the local batch into k micro-batches along dim 0 (torch.tensor_split
        sizes); their gradients accumulate and the returned loss and the gradients equal one call on
        the whole batch (loss numerators and denominators are summed, then divided once). Under
        pp > 1 they are the pipeline's micro-batches, run in `schedule` ("1f1b" or "gpipe"; default
        `self.pipeline_schedule`); under pp = 1 they run one after the other. Either way the
        data-parallel gradient reduction runs once, after the last micro-batch. With pp > 1 every
        rank returns the loss (one scalar all-reduce over the pipeline axis).
        """
        local_inputs = self._on_device(self.call.flatten(args, kwargs, what="forward_backward"))
        st = self._states[self._active]
        handoff = self._hand_off
        if handoff is not None and (handoff.ran or micro_batches != 1 or st.config.pp > 1):
            self._settle_hand_off()  # these gradients change after it was armed: moved by the switch instead
            handoff = None
        if micro_batches != 1 or st.config.pp > 1:
            with self._attention(st):
                return self._pipelined(st, local_inputs, micro_batches, schedule, grad_scale, train=True)
        shapes = self._global_input_shapes(st, local_inputs)
        self._check_split(st, shapes)
        st.last_shapes = shapes
        gm = self._checked_rows(st, self._program(st, tuple(tuple(x.shape) for x in local_inputs), train=True,
                                                  reduce=True), self._uneven(st, shapes)).joint
        names = self.logic.param_names
        handed: set[str] = set()  # gradients the ExecGraph's hooks added (and handed off) already

        def final(indices: tuple[int, ...], grads: tuple[torch.Tensor, ...]) -> None:
            mine = [names[k] for k in indices]
            self._add_grads(dict(zip(mine, grads)), grad_scale)
            handed.update(mine)
            handoff.final(mine)

        run = self._runner(gm, f"{st.config.name}'s training step")
        with self._attention(st), handing_off(final) if handoff is not None else contextlib.nullcontext():
            outs = run(*self._local_params(), *self._buffers, *local_inputs)
        if handoff is not None:
            handoff.ran = True
        # the rest (all of them unarmed; under Inductor, whose graphs have no hooks): the switch sends those
        self._add_grads({n: g for n, g in zip(names, outs[1:]) if n not in handed}, grad_scale)
        return outs[0].detach()

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        """Forward only: the loss of the global batch (inputs as for forward_backward)."""
        local_inputs = self._on_device(self.call.flatten(args, kwargs, what="the compiled model's call"))
        st = self._states[self._active]
        if st.config.pp > 1:
            with torch.no_grad(), self._attention(st):
                return self._pipelined(st, local_inputs, 1, None, 1.0, train=False)
        shapes = self._global_input_shapes(st, local_inputs)
        self._check_split(st, shapes)
        gm = self._checked_rows(st, self._program(st, tuple(tuple(x.shape) for x in local_inputs), train=False,
                                                  reduce=True), self._uneven(st, shapes)).joint
        with torch.no_grad(), self._attention(st):
            return self._runner(gm, f"{st.config.name}'s forward")(*self._local_params(), *self._buffers,
                                                                   *local_inputs)[0]

    def _attention(self, st: ConfigState):
        """Under cp, `document_attention` on a sequence shard fetches the keys and values other cp
        ranks hold (`runtime.cp_attention`); elsewhere it runs on the local data as on one device."""
        if st.config.cp == 1:
            return contextlib.nullcontext()
        from hotswitch.kernels.attention import local_implementation
        from hotswitch.runtime.cp_attention import ContextParallelAttention

        return local_implementation(ContextParallelAttention(self.process_group(st.config.name, "cp")))

    def _on_device(self, local_inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Inputs moved to the device this rank computes on (a CPU batch on an NCCL job, say)."""
        return tuple(x if x.device == self.device else x.to(self.device, non_blocking=True) for x in local_inputs)

    def graph_inputs(self, *local_inputs: torch.Tensor) -> list[torch.Tensor]:
        """What `exec_graph(active)` takes, in order: this rank's parameter shards, the buffers, then
        `local_inputs` (for running or compiling the graph by hand, as the profiler does). pp = 1."""
        return [*self._local_params(), *self._buffers, *local_inputs]

    def zero_grad(self) -> None:
        self._settle_hand_off()
        self._grads = None

    def accumulate_grads(self, grads: dict[str, torch.Tensor]) -> None:
        """Add gradients given as this rank's shards in the active layout (ones set aside earlier
        in the same step, say) to the accumulated ones."""
        self._settle_hand_off()
        self._add_grads(grads, 1.0)

    def set_local_params(self, local: dict[str, torch.Tensor]) -> None:
        """Replace this rank's parameter shards in the active layout (after an optimizer step);
        a prefetch of the old weights is dropped."""
        self._take_prefetch(None)
        for n in self._local:  # every parameter; under pp > 1 those of this rank's stage
            if n not in local or tuple(local[n].shape) != tuple(self._local[n].shape):
                got = tuple(local[n].shape) if n in local else "nothing"
                raise ValueError(
                    f"set_local_params: {n} needs this rank's shard of shape {tuple(self._local[n].shape)} "
                    f"under {self._active!r}, got {got}"
                )
        self._local = {n: local[n] for n in self._local}

    def layouts(self, name: str) -> dict[str, Layout]:
        """{parameter name: distconfig Layout} under config `name` (pure: no communication)."""
        self._state(name)
        return self._layouts(name)

    def layouts_for(self, config: DistConfig, devices) -> dict[str, Layout]:
        """{parameter name: Layout} under `config` laid out on `devices` (any ids, e.g. the ranks of
        another process group): pure, for configs this model was not compiled for (elastic changes).
        Only pp = 1 configs."""
        if config.pp > 1:
            raise ValueError(f"layouts_for supports pp = 1 configs, got {config.name!r} (pp={config.pp})")
        devices = [int(d) for d in devices]
        if config.world_size != len(devices):
            raise ValueError(f"config {config.name!r} needs {config.world_size} devices, got {len(devices)}: {devices}")
        mesh = config.compute_mesh(devices)
        placements = param_placements(
            self.roles,
            self.logic.param_names,
            config.tp,
            mesh.axis_index("tp") if "tp" in mesh.axis_names else None,
            mesh.ndim,
            config.name,
        )
        return {n: Layout(tuple(self.logic.param_shapes[n]), mesh, tuple(from_torch(p) for p in placements[n]))
                for n in self.logic.param_names}

    def as_dtensors(self, local: dict[str, torch.Tensor], config: str | None = None,
                    mesh: DeviceMesh | None = None) -> dict[str, DTensor]:
        """Per-parameter shards in the layout of `config` (default the active one) as DTensors (no
        communication), e.g. for a torch.distributed.checkpoint save or a resharding load; `mesh`
        replaces the config's own mesh by an equal one (DTensor redistributes only within a mesh).
        Under pp > 1 the shards of this rank's stage, on its stage mesh."""
        st = self._state(config or self._active)
        mesh = mesh or st.mesh
        return {n: dt.from_local(t, mesh, st.param_specs[n], self.logic.param_shapes[n]) for n, t in local.items()}

    def local_shapes(self, config: str) -> dict[str, tuple[int, ...]]:
        """{parameter: shape of this rank's shard} under `config` (only the parameters it holds)."""
        layouts = self._layouts(config)
        return {n: layouts[n].local_shape(self.rank) for n in self.held(config)}

    def held(self, config: str) -> list[str]:
        """The parameters this rank holds a piece of under `config`: all, or under pp > 1 its stage's."""
        return self._held(self._state(config))

    def device_mesh(self, config: str) -> DeviceMesh:
        """The DeviceMesh this rank computes on under `config` (under pp > 1: its stage's (dp, tp) mesh)."""
        return self._state(config).mesh

    def placements(self, config: str) -> dict[str, tuple]:
        """{parameter: torch placements on `device_mesh(config)`}."""
        return dict(self._state(config).param_specs)

    def process_group(self, name: str, axis: str):
        """The process group of this rank along mesh axis `axis` ('dp', 'tp', or 'pp': this rank's
        pipeline) of config `name`; None when the config has no such axis (a group of one)."""
        st = self._state(name)
        if axis == "pp":
            return st.full_mesh.get_group("pp") if st.full_mesh is not None else None
        return st.mesh.get_group(st.axis[axis]) if axis in st.axis else None

    @property
    def local_params(self) -> dict[str, torch.Tensor]:
        return dict(self._local)

    @property
    def local_grads(self) -> dict[str, torch.Tensor] | None:
        return None if self._grads is None else dict(self._grads)

    def full_state_dict(
        self, canonical: bool = False, params: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """{name: full tensor}, the keys of model.state_dict() (tied weights under every name).

        `params` replaces the active weights by other shards in the active layout (e.g. fp32 masters).
        """
        full = self._full(self._local if params is None else params)
        if canonical:
            return full
        out = {}
        for key in self._state_keys:
            if key in full:
                out[key] = full[key]
            elif key in self.logic.aliases:
                out[key] = full[self.logic.aliases[key]]
            elif key in self.logic.buffer_names:
                out[key] = self._buffers[self.logic.buffer_names.index(key)]
        return out

    def full_grads(self) -> dict[str, torch.Tensor]:
        """{name: full gradient}, the keys of model.named_parameters(); zeros before any backward."""
        if self._grads is None:
            return {
                n: torch.zeros(self.logic.param_shapes[n], dtype=self.logic.param_dtypes[n], device=self.device)
                for n in self.logic.param_names
            }
        return self._full(self._grads)

    def compile_seconds(self, name: str) -> float:
        st = self._state(name)
        return sum(st.compile_seconds.values()) + st.fit_seconds

    # ------------------------------------------------------------------------------------ internals
    def _state(self, name: str) -> ConfigState:
        if name not in self._states:
            raise ValueError(f"unknown config {name!r}: the compiled configs are {list(self._states)}; pass one of "
                             "these names, or compile again with this config added to `configs`")
        return self._states[name]

    def _make_state(self, config: DistConfig) -> ConfigState:
        axis = {a: i for i, a in enumerate(config.stage_axes)}
        specs = param_placements(self.roles, self.logic.param_names, config.tp, axis.get("tp"), len(axis), config.name)
        if config.pp == 1:
            return ConfigState(config, config.device_mesh(self.device.type), axis, specs, device=self.device,
                               runner=self._runner.kernels)
        # pp > 1: a (pp, dp, cp, tp) mesh; stage s runs on its (dp, cp, tp) slice, where parameters are placed
        self._split(config.pp)  # cut the model now: a model that cannot be cut fails at compile time
        full = config.device_mesh(self.device.type)
        mesh = full[config.stage_axes[0]] if len(config.stage_axes) == 1 else full[config.stage_axes]
        st = ConfigState(config, mesh, axis, specs, full_mesh=full, stage=int(full.get_coordinate()[0]),
                         device=self.device, runner=self._runner.kernels)
        # parameters shared by stages (a tied embedding): the copies' gradients are summed over the
        # ranks at the same (dp, tp) coordinate of those stages. Every rank creates every group.
        grid = full.mesh.reshape(config.pp, -1)
        for stages in sorted(set(self._splits[config.pp].shared.values())):
            for position in range(grid.shape[1]):
                ranks = [int(grid[s][position]) for s in stages]
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    st.copy_groups[stages] = group
        return st

    def _split(self, pp: int) -> StageSplit:
        """The LogicGraph cut into `pp` pipeline stages (pure and deterministic: the same on every rank)."""
        if pp not in self._splits:
            if not self.logic.split_loss:
                raise ValueError(
                    f"pp={pp}: pipeline stages weight micro-batches by their token counts, so the model must "
                    "return its loss as a sum divided by a count (e.g. F.cross_entropy(..., "
                    "reduction='mean') or loss_sum / num_tokens); use pp=1 for this model"
                )
            self._splits[pp] = split_stages(self.logic, pp)
        return self._splits[pp]

    def _held(self, st: ConfigState) -> list[str]:
        """The parameters this rank holds a piece of under `st`: all, or under pp > 1 its stage's."""
        if st.full_mesh is None:
            return list(self.logic.param_names)
        return list(self._splits[st.config.pp].stages[st.stage].param_names)

    def _moving_kinds(self) -> tuple[str, ...]:
        return ((StateKind.GRAD,) if self._grads is not None else ()) + tuple(sorted(self._param_states))

    def _kind(self, kind: str) -> dict[str, torch.Tensor]:
        return self._grads if kind == StateKind.GRAD else self._param_states[kind]

    def _itemsize(self, name: str) -> int:
        """Bytes per element of a switched tensor ('param' or 'kind:param')."""
        return self._dtype(name).itemsize

    def _dtype(self, name: str) -> torch.dtype:
        """The dtype of a switched tensor ('param' or 'kind:param'), the same on every rank (also on
        ranks that hold no piece of it under pp > 1: planning must agree everywhere)."""
        kind, param = split_key(name)
        if kind and kind != StateKind.GRAD and kind in self._param_states:
            if param in self._state_dtypes.get(kind, {}):
                return self._state_dtypes[kind][param]
            return self._param_states[kind][param].dtype
        if kind == StateKind.GRAD and self._grads is not None:
            if param in self._grads:
                return self._grads[param].dtype
            return self.grad_dtype or self.logic.param_dtypes[param]
        return self.logic.param_dtypes[param]

    def _layouts(self, name: str, kinds: tuple[str, ...] = (), weights: bool = True) -> dict[str, Layout]:
        """distconfig Layouts of every parameter (unless `weights=False`) and of each state kind
        (same layout) under `name`."""
        st = self._states[name]
        if st.layouts is None and st.full_mesh is not None:
            # pp > 1: a parameter lives only on its stage's (dp, cp, tp) sub-mesh of the (pp, dp, cp, tp) mesh
            # (a shared parameter: a copy on each of its stages, a "copy" axis of Replicate() over them)
            split, grid, axes = self._splits[st.config.pp], st.full_mesh.mesh, tuple(st.mesh.mesh_dim_names)
            st.layouts = {}
            for n in self.logic.param_names:
                stages, placements = split.param_stages[n], tuple(from_torch(p) for p in st.param_specs[n])
                if len(stages) == 1:
                    mesh = Mesh(grid[stages[0]].tolist(), axes)
                else:
                    mesh, placements = Mesh(grid[list(stages)].tolist(), ("copy", *axes)), (Replicate(), *placements)
                st.layouts[n] = Layout(tuple(self.logic.param_shapes[n]), mesh, placements)
        if st.layouts is None:
            mesh = Mesh(st.mesh.mesh.tolist(), tuple(st.mesh.mesh_dim_names))
            st.layouts = {
                n: Layout(tuple(self.logic.param_shapes[n]), mesh, tuple(from_torch(p) for p in st.param_specs[n]))
                for n in self.logic.param_names
            }
        out = dict(st.layouts) if weights else {}
        for kind in kinds:
            out.update({state_key(kind, n): layout for n, layout in st.layouts.items()})
        return out

    def _coordinate(self, st: ConfigState, axis_name: str) -> int:
        if axis_name not in st.axis:
            return 0
        return st.mesh.get_coordinate()[st.axis[axis_name]]

    def _global_input_shapes(self, st: ConfigState, local_inputs) -> tuple:
        key = (st.config.name, tuple(tuple(x.shape) for x in local_inputs))
        if key not in self._global_shapes:
            # Inputs sharded by the caller: learn the global batch once per shape (a tiny all-gather),
            # and whether the data-parallel peers were all given the same rows.
            mine = comm_tensor([float(local_inputs[0].shape[0]), _digest(local_inputs)], torch.float64)
            gathered = [torch.zeros_like(mine) for _ in range(self.world_size)]
            dist.all_gather(gathered, mine)
            groups = self._groups(st, "dp")
            dp_peers = next(g for g in groups if self.rank in g)
            batch = sum(int(gathered[r][0]) for r in dp_peers)
            # said by the first rank of a dp group whose ranks all got the same inputs (all ranks know which)
            alike = [g[0] for g in groups if len(g) > 1 and all(bool((gathered[r] == gathered[g[0]]).all()) for r in g)]
            if alike and min(alike) == self.rank:
                self._warn_unsharded(st, int(mine[0]))
            cp = st.config.cp
            self._global_shapes[key] = tuple(
                (batch, x.shape[1] * cp, *x.shape[2:]) if cp > 1 and along_seq else (batch, *x.shape[1:])
                for x, along_seq in zip(local_inputs, self._sequence_inputs))
        return self._global_shapes[key]

    def _warn_unsharded(self, st: ConfigState, rows: int) -> None:
        """Every data-parallel peer got the same inputs: most likely the global batch, not this rank's
        part. Still exact (the mean over dp copies of a batch is its mean), but each rank computes the
        whole batch, and the graphs are lowered for a dp times larger one. Said once per model, by one rank."""
        if self._warned_unsharded:
            return
        self._warned_unsharded = True
        call = "**cm.shard_inputs(**batch)" if self.call.names and not self.call.names[0].startswith("args[") \
            else "*cm.shard_inputs(*batch)"
        warnings.warn(
            f"hotswitch: the {st.config.dp} data-parallel ranks of {st.config.name!r} were given the same inputs "
            f"({rows} rows each): that looks like the global batch, not each rank's part of it. Pass "
            f"cm.forward_backward({call}): shard_inputs splits the batch over the dp ranks. As given, every rank "
            f"computes all {rows} rows (a global batch of {rows * st.config.dp}, lowered again for that shape)",
            stacklevel=4)

    @staticmethod
    def _groups(st: ConfigState, axis_name: str) -> list[list[int]]:
        """The mesh's groups along `axis_name` (ranks whose coordinates differ on that axis alone), each
        a list of ranks in the axis's order; every rank its own group when the mesh has no such axis."""
        mesh = st.mesh.mesh
        if axis_name not in st.axis:
            return [[r] for r in mesh.flatten().tolist()]
        return mesh.movedim(st.axis[axis_name], -1).reshape(-1, mesh.size(st.axis[axis_name])).tolist()

    def _check_split(self, st: ConfigState, shapes: tuple) -> None:
        """An uneven data-parallel split is exact only for a loss written as sum / count; context
        parallelism splits the sequence evenly."""
        cp = st.config.cp
        for shape, along_seq in zip(shapes, self._sequence_inputs if cp > 1 else ()):
            if along_seq and shape[1] % cp:
                raise ValueError(
                    f"{st.config.name!r} splits the sequence over cp={cp} ranks, but the inputs have {shape[1]} "
                    f"positions: use a sequence length divisible by {cp} (pad the rows), or a config without cp"
                )
        batch, dp = shapes[0][0], st.config.dp
        if batch < dp:
            raise ValueError(
                f"a global batch of {batch} cannot be split over the dp={dp} ranks of {st.config.name!r}: use a "
                f"batch of at least {dp} rows (also for the example inputs), or a config with smaller dp"
            )
        if dp > 1 and batch % dp and not self.logic.split_loss:
            raise ValueError(
                f"a global batch of {batch} does not split evenly over dp={dp}, and the model's loss is not "
                "a sum divided by a count, so an uneven split cannot be weighted exactly: use a batch "
                f"divisible by {dp}, or return loss_sum / num_tokens"
            )

    @staticmethod
    def _checked_rows(st: ConfigState, program: StageProgram, uneven: str | None) -> StageProgram:
        """`program`, unless the dp ranks hold different numbers of rows (`uneven` says how) and it
        combines rows across them other than by a sum (`compiler.sharding.mixes_rows`): each rank lowered
        it for its own rows times dp, so its collectives would disagree in size (gloo aborts the
        process) or average wrongly. Every rank raises the same error, before any collective."""
        if uneven and program.mixes_rows:
            dp = st.config.dp
            more = f" (and {len(program.mixes_rows) - 1} more)" if len(program.mixes_rows) > 1 else ""
            raise ValueError(
                f"{st.config.name!r} combines rows of different data-parallel ranks other than by a sum, at "
                f"{program.mixes_rows[0]}{more}: a batch statistic, or the batch gathered. That is exact only when "
                f"the dp={dp} ranks hold equally many rows, and {uneven}. Use a batch divisible by {dp}, or a "
                "config without data parallelism")
        return program

    @staticmethod
    def _uneven(st: ConfigState, shapes: tuple) -> str | None:
        batch, dp = shapes[0][0], st.config.dp
        return f"a global batch of {batch} does not split evenly" if dp > 1 and batch % dp else None

    def _local_params(self) -> list[torch.Tensor]:
        return [self._local[n] for n in self.logic.param_names]

    def _pieces(self, st: ConfigState, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: self._slice(st, n, full[n]) for n in self._held(st)}

    def _slice(self, st: ConfigState, name: str, full: torch.Tensor) -> torch.Tensor:
        spec = dt.make_spec(st.mesh, st.param_specs[name], full)
        shape, offset = dt.local_shape_and_offset(spec)
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
        return full[index].to(self.device, copy=True)

    def _full(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        st = self._states[self._active]
        if st.full_mesh is not None:
            return self._gather(local)
        out = {}
        for n in self.logic.param_names:
            if all(p.is_replicate() for p in st.param_specs[n]):
                out[n] = local[n].clone()
            else:
                out[n] = dt.from_local(local[n], st.mesh, st.param_specs[n], self.logic.param_shapes[n]).full_tensor()
        return out

    # ------------------------------------------------------------------ pipeline parallelism, micro-batches
    def _gather(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full tensors on every rank from pieces that live on pipeline stages' sub-meshes: a switch
        plan into a layout where every rank holds everything, run by the executor (one batched
        exchange). A collective: call on every rank."""
        mine = {n: str(t.dtype).removeprefix("torch.") for n, t in local.items()}
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, mine)  # ranks without a piece learn the dtype
        dtypes = {n: getattr(torch, d) for g in gathered for n, d in g.items()}
        src = self._layouts(self._active)
        everyone = Mesh(list(range(self.world_size)), ("world",))
        dst = {n: Layout(tuple(self.logic.param_shapes[n]), everyone, (Replicate(),)) for n in self.logic.param_names}
        key = tuple(sorted((n, d.itemsize) for n, d in dtypes.items()))
        plan = self._plans.get(
            (self._active, "pieces"),
            ("everyone", key),
            lambda: [
                TensorMove(n, tuple(self.logic.param_shapes[n]), dtypes[n].itemsize, src[n], dst[n])
                for n in self.logic.param_names
            ],
            self.topology,
        )
        new, _, _ = execute_plan(plan, local, src, dst, self.rank, dtypes=dtypes, device=self.device)
        return {n: t.clone() if t is local.get(n) else t for n, t in new.items()}

    def _local_shapes(self, st: ConfigState, shapes: tuple) -> tuple:
        """This rank's part of a global batch of `shapes`: its data-parallel rows and, under context
        parallelism, its share of the sequence."""
        dp, index, cp = st.config.dp, self._coordinate(st, "dp"), st.config.cp
        return tuple((_split_size(s[0], dp, index), s[1] // cp, *s[2:]) if cp > 1 and along_seq
                     else (_split_size(s[0], dp, index), *s[1:])
                     for s, along_seq in zip(shapes, self._sequence_inputs))

    @collector_paused()  # a lowering, or loading one from the cache (see compiler.garbage)
    def _program(self, st: ConfigState, local_shapes: tuple, *, train: bool, reduce: bool) -> StageProgram:
        """This rank's lowered programs for local (micro-)batches of `local_shapes`, lowered on first
        use and cached: the whole model with the DP reduction inside (`reduce`, pp = 1) or this rank's
        stage with the reduction deferred (micro-batches, pp > 1). See hotswitch.compiler.program."""
        key = (tuple(tuple(s) for s in local_shapes), train, reduce)
        if key not in st.programs:
            what = f"{st.config.name} for local {'micro-batches' if not reduce else 'inputs'} {list(key[0][0])}" + (
                "" if train else " (forward only)") + (f", stage {st.stage}" if st.full_mesh is not None else "")
            program = self._fitted(st, key)
            if program is None:
                program = self._second_length(st, key, what)
            if program is not None and program.fitted is not None:
                how = f"fitted from lengths {program.fitted[0]} and {program.fitted[1]}"
            elif program is not None:  # (why not fitted: said as it was refused)
                how = f"{program.replayed} placements replayed; no fit in the length"
            else:
                self._report(f"lowering {what}")
                program = self._lower(st, key)
                if program.loaded:
                    how = "loaded: the compile cache or another dp rank had it"
                else:
                    how = f"{program.replayed} placements replayed" if program.replayed else "placements searched"
                    how += f" in {program.propagate_seconds:.1f} s"
                self._learn_length(st, key, program)
            self._report(f"lowered {what} in {program.seconds:.1f} s ({how})")
            st.programs[key] = program
            st.compile_seconds[key] = program.seconds
            if self.dynamic:
                self._fit_now(st, key)
        return st.programs[key]

    def _lower(self, st: ConfigState, key: tuple, sample: bool = False) -> StageProgram:
        """Lower (or load) the program of `key` (see `_program`); `sample`: one only read as a graph,
        for a length fit (`compiler.program.lower_program`)."""
        (local_shapes, train, reduce), graph = key, (key[1], st.stage)
        stage = self._split(st.config.pp).stages[st.stage] if st.full_mesh is not None else None
        program = lower_program(self.logic, stage, st.where, self._buffers, local_shapes,
                                [x.dtype for x in self._example_inputs], train=train, reduce=reduce,
                                strict=self.strict, memo=self._propagation_memo.setdefault(st.config.name, {}),
                                decided=st.decisions.get(graph), cache=self._cache, sample=sample,
                                bucket_bytes=self.grad_bucket_bytes)
        st.decisions.setdefault(graph, program.decisions)
        return program

    def _by_length(self, key: tuple) -> tuple[tuple, int] | None:
        """(the program key with the sequence length left out, the length), or None when the inputs
        do not share one length."""
        shapes, train, reduce = key
        lengths = {s[1] for s, along_seq in zip(shapes, self._sequence_inputs) if along_seq}
        if len(lengths) != 1:
            return None
        family = tuple((s[0], None, *s[2:]) if along_seq else s for s, along_seq in zip(shapes, self._sequence_inputs))
        return (family, train, reduce), lengths.pop()

    def _learn_length(self, st: ConfigState, key: tuple, program: StageProgram) -> None:
        """After lowering a program (the whole model's, or this rank's stage's): the first at its shapes
        but the length is kept, for `_second_length` to sample the next and fit the two (and a second,
        where that sample did not lower, for `_fitted` to fit when a third length comes)."""
        found = self._by_length(key)
        if found is not None:
            family = st.lengths.setdefault(found[0], LengthFamily())
            if len(family.lowered) < 2:
                family.lowered.append((found[1], program))

    def _fitted(self, st: ConfigState, key: tuple) -> StageProgram | None:
        """The program for `key` written from the fit of two earlier lengths (`compiler.lengths`); None:
        fewer than two lowered yet, they do not fit, the fit does not hold at this length, or
        `dynamic=False`."""
        found = self._by_length(key)
        family = st.lengths.get(found[0]) if found is not None else None
        if self.dynamic is False or family is None or family.refused is not None or \
                (family.fit is None and len(family.lowered) < 2):
            return None
        try:
            return program_at(self._length_fit(st, family), family.lowered[0][1], found[1], key[0])
        except CannotFit as e:
            if family.refused is not None:
                self._report(f"{st.config.name}: every sequence length is lowered ({e})")
            else:
                self._report(f"{st.config.name}: length {found[1]} is lowered ({e})")
            return None

    def _second_length(self, st: ConfigState, key: tuple, what: str) -> StageProgram | None:
        """The program for `key` at a second sequence length of its rows, as the fit of the first and
        this one: this length is lowered as a sample (its decisions replayed, its graph only, as
        `dynamic=True` lowers half the first length), fitted with the first, and its program written
        from the fit like every later length's, so that neither this length nor the next writes,
        compiles or files a program of its own. Where they do not fit, the sample is completed into this
        length's program, and the next new length is sampled in its place (an uneven length does not
        fit; an even one after it may), `_SECOND_LENGTHS` in all. Ranks that differ only in their dp
        coordinate and ran one first program between them (its decisions say so) sample and fit once:
        the first to get here does, the others wait for its fit ("shared length fit"). None: not a
        second length (or `dynamic=False`), or the sample did not lower (the full lowering says why)."""
        found = self._by_length(key)
        family = st.lengths.get(found[0]) if found is not None else None
        if self.dynamic is False or family is None or len(family.lowered) != 1 or family.fit is not None or \
                family.refused is not None:
            return None
        t0, fit_seconds = time.perf_counter(), st.fit_seconds
        first_length, first = family.lowered[0]
        shared = first.decisions is not None and first.decisions.dp_shared
        kind = "shared length fit" if shared else "length fit"
        filed = fit_key(self._cache, first, first_length, found[1], kind)
        sample = None
        if not self._cached_fit(st, family, filed, kind):  # (a shared fit's: ours to make, put or fail)
            self._report(f"lowering {what}")
            try:
                sample = self._lower(st, key, sample=True)
            except Exception:  # noqa: BLE001 - lowered again in full, which raises what is wrong
                if shared and filed is not None:
                    self._cache.failed(filed)  # the other dp ranks lower it themselves (and raise the same)
                return None
            if shared and filed is not None and not sample.decisions.dp_shared:
                # this length's program reads the dp coordinate (uneven rows, say): so does its fit
                self._cache.failed(filed)
                filed = None
            family.lowered.append((found[1], sample))
            try:
                self._length_fit(st, family, (filed, kind))
            except CannotFit as e:  # this length is its sample's program
                self._report(f"{st.config.name}: every sequence length is lowered ({e})" if family.refused else
                             f"{st.config.name}: length {found[1]} is lowered ({e}); the next is tried")
        st.fit_seconds = fit_seconds  # (all of it this length's: its program's seconds)
        program = self._fitted(st, key)
        if program is None and sample is not None:  # refused: its own program, from its sample
            program = completed(sample)
        return None if program is None else replace(program, seconds=time.perf_counter() - t0)

    def _length_fit(self, st: ConfigState, family: LengthFamily,
                    filed: tuple[str | None, str] | None = None) -> LengthFit:
        """The fit of `family`'s two lowered programs, computed once, or loaded where an earlier
        process filed it in the compile cache. `filed`: (key, kind) where the cache has been looked in
        already (`_second_length`), to file it there. CannotFit: the second is dropped, and the next
        new length is sampled in its place; after `_SECOND_LENGTHS` of them every length is lowered
        (`family.refused`)."""
        if family.fit is None:
            (length_a, first), (length_b, second) = family.lowered
            key, kind = filed or (fit_key(self._cache, first, length_a, length_b), "length fit")
            if filed is None and self._cached_fit(st, family, key):
                return family.fit
            claimed = key is not None and kind == "shared length fit"  # other dp ranks wait for it
            t0 = time.perf_counter()
            try:
                family.fit = fit_programs(self.logic, first, length_a, second, length_b)
            except BaseException as e:
                if isinstance(e, CannotFit):
                    family.lowered.pop()  # (its own program already: a sample completed, or lowered in full)
                    family.unfit.append((length_b, str(e)))
                    if len(family.unfit) >= _SECOND_LENGTHS:
                        family.refused = str(e)
                if claimed:
                    self._cache.failed(key)  # they fit for themselves (and are refused alike)
                raise
            finally:
                st.fit_seconds += time.perf_counter() - t0
            if key is not None and not store_fit(self._cache, key, family.fit, st.where, kind) and claimed:
                self._cache.failed(key)
            family.lowered[1] = (length_b, None)  # about 21,000 objects at 8 layers, for the collector to walk
        return family.fit

    def _cached_fit(self, st: ConfigState, family: LengthFamily, key: str | None, kind: str = "length fit") -> bool:
        """Did the compile cache hold, under `key` (`fit_key`; None: nowhere to look), the fit of
        `family`'s first program? (It is then `family.fit`.)"""
        if key is None:
            return False
        t0 = time.perf_counter()
        family.fit = load_fit(self._cache, key, family.lowered[0][1], st.where, kind)
        st.fit_seconds += time.perf_counter() - t0
        family.fit_loaded = family.fit is not None
        return family.fit_loaded

    def _fit_now(self, st: ConfigState, key: tuple) -> None:
        """`dynamic=True`: after the first program at some rows (`key`), the program at half its
        length (its decisions replayed) and the fit of the two, so that no later length at these rows
        is lowered. Where that fails the lengths are lowered one by one, as with `dynamic=False`."""
        found = self._by_length(key)
        family = st.lengths.get(found[0]) if found is not None else None
        if family is None or len(family.lowered) != 1 or family.fit is not None or family.refused is not None:
            return  # not a program in the length, or its rows are fitted (or being fitted) already
        length = found[1]
        if length % 2:
            family.refused = f"the first length, {length}, is odd: no second length to fit with was chosen"
        elif self._cached_fit(st, family, fit_key(self._cache, family.lowered[0][1], length, length // 2)):
            self._report(f"{st.config.name}: fitted in the sequence length from lengths {length // 2} and {length} "
                         "(loaded: the compile cache had the fit)")
            return
        else:
            half = tuple((s[0], length // 2, *s[2:]) if along_seq else s
                         for s, along_seq in zip(key[0], self._sequence_inputs))
            try:
                # read as a graph only, and not kept: a step at this length runs a program written from the fit
                sample = self._lower(st, (half, key[1], key[2]), sample=True)
                st.fit_seconds += sample.seconds
                family.lowered.append((length // 2, sample))
                self._length_fit(st, family)
            except Exception as e:  # noqa: BLE001 - a half the sharding does not divide, say: no fit, no harm
                family.refused = family.refused or f"{type(e).__name__}: {e}"
        if family.refused is None:
            self._report(f"{st.config.name}: fitted in the sequence length from lengths {length // 2} and {length}")
            return
        # asked for and not given: said where it is seen without a progress callback too, by one rank
        # where every rank refuses alike (an odd example length), by each that refused otherwise
        message = f"{st.config.name}: dynamic=True, but every sequence length is lowered ({family.refused})"
        self._report(message)
        if not length % 2 or not dist.is_initialized() or dist.get_rank() == 0:
            warnings.warn(f"hotswitch: {message}", stacklevel=2)

    def _pipelined(self, st: ConfigState, local_inputs, micro_batches, schedule, grad_scale: float, train: bool):
        """One step as micro-batches (and pipeline stages): see forward_backward and hotswitch.pipeline."""
        k = micro_batches
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"micro_batches must be a positive int, got {k!r}")
        schedule = schedule or self.pipeline_schedule
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")
        rows = comm_tensor([local_inputs[0].shape[0], -local_inputs[0].shape[0]], torch.int64)
        if k > 1 or st.config.dp > 1:  # ranks' batches may differ (uneven data parallelism): all refuse, or none
            dist.all_reduce(rows, op=dist.ReduceOp.MIN)
        fewest, most = rows[0].item(), -rows[1].item()
        if fewest < k:
            raise ValueError(f"a batch of {fewest} rows (the smallest data-parallel part) cannot be cut into {k} "
                             f"micro-batches: use micro_batches <= {fewest} or a larger batch")
        if not self.logic.split_loss:
            raise ValueError("micro-batches are weighted by their token counts, so the model must return its loss as a "
                             "sum divided by a count (e.g. a mean cross-entropy); call with micro_batches=1")
        pp = st.config.pp
        micro = list(zip(*(x.tensor_split(k, dim=0) for x in local_inputs)))
        uneven = f"they hold {fewest} to {most} rows" if most != fewest else None
        programs = [self._checked_rows(st, self._program(st, tuple(tuple(x.shape) for x in mb), train=train,
                                                         reduce=False), uneven) for mb in micro]
        assert all(
            p.deferred_specs[i].placements == programs[0].deferred_specs[i].placements
            for p in programs
            for i in range(len(p.deferred_specs))
        ), "micro-batch shapes changed a gradient's layout"
        held = self._held(st)
        prev_rank = next_rank = None
        if st.full_mesh is not None:
            grid = st.full_mesh.mesh.reshape(pp, -1)
            pos = (grid[st.stage] == self.rank).nonzero()[0].item()
            prev_rank = int(grid[st.stage - 1][pos]) if st.stage > 0 else None
            next_rank = int(grid[st.stage + 1][pos]) if st.stage < pp - 1 else None
        sums, stats = run_step(programs, [self._local[n] for n in held], self._buffers, micro, stage=st.stage,
                               num_stages=pp, prev_rank=prev_rank, next_rank=next_rank, schedule=schedule,
                               accumulate_dtype=self.grad_dtype if train else None, device=self.device,
                               run=lambda gm, what: self._runner(gm, f"{st.config.name}'s {what}"))
        self.last_step = stats
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if train or programs[0].is_last:
            outs = self._runner(reduction_for(st, programs[0], sums), f"{st.config.name}'s gradient reduction")(*sums)
            if programs[0].is_last:
                loss = outs[0].detach().to(torch.float32) if st.full_mesh is not None else outs[0].detach()
            if train:
                grads = dict(zip(held, outs[1:]))
                self._sum_copies(st, grads)
                self._add_grads(grads, grad_scale)
        if st.full_mesh is not None:  # every rank returns the loss (fp32): the last stage has it
            dist.all_reduce(loss, group=st.full_mesh.get_group("pp"))
        return loss

    def _sum_copies(self, st: ConfigState, grads: dict[str, torch.Tensor]) -> None:
        """A parameter with a copy on several stages (a tied embedding and LM head) gets the sum of
        the copies' gradients on each: one all-reduce per set of sharing stages (Megatron's
        embedding group), after the data-parallel reduction."""
        if st.full_mesh is None:
            return
        shared = self._splits[st.config.pp].shared
        for stages, group in st.copy_groups.items():
            names = [n for n in grads if shared.get(n) == stages]
            flat = torch.cat([grads[n].reshape(-1) for n in names])
            dist.all_reduce(flat, group=group)
            for n, piece in zip(names, flat.split([grads[n].numel() for n in names])):
                grads[n] = piece.view(grads[n].shape)

    def _add_grads(self, grads: dict[str, torch.Tensor], grad_scale: float) -> None:
        """Accumulate reduced gradients (in their parameter layouts) as forward_backward does."""
        if self._grads is None:
            self._grads = {}
        for n, g in grads.items():
            g = g.detach()
            if n not in self._grads:
                self._grads[n] = g.to(self.grad_dtype or g.dtype, copy=True).mul_(grad_scale) if grad_scale != 1.0 \
                    else g.to(self.grad_dtype or g.dtype, copy=True)
            else:
                self._grads[n].add_(g, alpha=grad_scale)


def _digest(tensors) -> float:
    """A cheap fingerprint of input values, to tell whether ranks were given the same rows."""
    total = 0.0
    for x in tensors:
        flat = x.detach().reshape(-1).to(torch.float64)
        total += float((flat * (torch.arange(flat.numel(), dtype=torch.float64, device=flat.device) % 31 + 1)).sum())
    return total


def _split_size(n: int, parts: int, index: int) -> int:
    """Rows of part `index` when n rows are split by torch.tensor_split into `parts`."""
    return n // parts + (1 if index < n % parts else 0)


CP_LAYOUTS = ("contiguous", "zigzag", "document")  # cp_layout: rank i holds the i-th chunk of every row; chunks
# i and 2cp-1-i (causal balance); or documents whole where the balance allows (DCP, `distconfig.tokens`)


def _cp_tokens(layout: str, document_ids: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Flat indices (into the rows of `document_ids`, [rows, T]) of the tokens cp rank `rank` holds,
    T / cp per row's worth, in the order its shard lists them."""
    from hotswitch.distconfig.tokens import Documents, document_placement, zigzag_placement

    docs = Documents.from_ids(document_ids)
    placement = zigzag_placement(docs, cp) if layout == "zigzag" else document_placement(docs, cp, equal_tokens=True)
    tokens = [i for s in placement.segments[rank] for i in placement.flat_index(s)]
    return torch.tensor(sorted(tokens) if layout == "zigzag" else tokens)  # zigzag: row by row


def compile(model: torch.nn.Module, example_inputs, configs, *, strict: bool = True,
            topology: Topology | None = None, lazy: bool = False, progress=None,
            logic: LogicGraph | None = None, cp_layout: str = "contiguous", backend: str = "eager",
            dynamic: bool | None = None, grad_bucket_bytes: int | None = None) -> CompiledModel:
    """Trace `model` once and compile it for every config.

    `model`: forward returns a scalar mean loss, or an object or dict with a `loss` entry (Hugging
    Face models given labels; `use_cache=False` is passed where forward takes it). `example_inputs`:
    a *global* batch, as a tuple of positional inputs or a dict of keyword arguments
    (`dict(input_ids=ids, labels=labels)`); later calls give the same names (see `shard_inputs`).
    `configs`: DistConfigs or strings ("dp2tp2sp" or "dp=2,tp=2,sp"), each over all ranks.

    Call on every rank after `dist.init_process_group`, with identical weights on every rank. The
    first config is active afterwards. `lazy=True` lowers
    each config's ExecGraph on its first use instead of now (switching needs only the layouts);
    `progress(message)` is called as each phase starts ("tracing", "compiling dp4", ...).
    `cp_layout` ("contiguous", "zigzag", "document"; CP_LAYOUTS): how cp configs lay the sequence out;
    the last two move tokens and need a model whose attention reads `document_ids`.
    `backend`: "eager" runs each ExecGraph op by op; "inductor" compiles it with Inductor on its first
    run (kept with the program; a graph Inductor refuses runs eagerly, with a warning saying why).
    `dynamic`, as torch.compile's, says how sequence lengths other than the first are compiled
    (`hotswitch.compiler.lengths`): None, the first new length (at the same rows) replays the
    first's sharding decisions as a sample (its graph only) and fits the two programs, and it and
    every later length are written from the fit; True, each program's rows are fitted in the length
    at once (their first lowering is followed by a sample at half its length and the fit), so no
    new length lowers anything; False, every length is lowered (replayed), never fitted. Where the
    programs do not fit (an uneven length, a size not affine in the length), every length is lowered.
    `grad_bucket_bytes`: the size of the buckets in which data-parallel gradients are all-reduced, each
    issued as soon as its last gradient is computed (DDP's `bucket_cap_mb`; default 25 MiB, as DDP's).
    """
    return CompiledModel(model, example_inputs, configs, strict=strict, topology=topology, lazy=lazy, progress=progress,
                         logic=logic, cp_layout=cp_layout, backend=backend, dynamic=dynamic,
                         grad_bucket_bytes=grad_bucket_bytes)
