"""The public API: `compile(model, example_inputs, configs)` -> CompiledModel.

A CompiledModel holds one traced LogicGraph, the parameter layouts of every DistConfig, this rank's
ExecGraphs (compiled for the example shapes up front, for other input shapes on first use and
cached), and the local shards of the active config's parameters and gradients.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hotswitch.compiler import _dtensor as dt
from hotswitch.compiler.cache import default_cache
from hotswitch.compiler.handoff import handing_off
from hotswitch.compiler.reduce import BUCKET_BYTES
from hotswitch.compiler.signature import ModelCall
from hotswitch.compiler.stages import StageSplit, split_stages
from hotswitch.compiler.tp_rules import TPRoles, infer_tp_roles
from hotswitch.compiler.trace import LogicGraph
from hotswitch.distconfig import DistConfig, Layout, Topology, chunk_span, parse_configs
from hotswitch.distributed.device import comm_tensor, runtime_device
from hotswitch.runtime import weights as W
from hotswitch.runtime.backend import GraphRunner
from hotswitch.runtime.config_state import ConfigState, layouts_on, make_config_state, parameter_layouts
from hotswitch.runtime.inputs import InputSharding, checked_cp_layout
from hotswitch.runtime.meta_init import INIT, hf_model_of
from hotswitch.runtime.pipeline import SCHEDULES, StepStats, reduction_for, run_step
from hotswitch.runtime.programs import Programs
from hotswitch.runtime.shared import JobOnce, SharedCache, trace_once
from hotswitch.runtime.switching import Switcher
from hotswitch.switch.executor import SwitchStats
from hotswitch.switch.order import OrderPlan
from hotswitch.switch.planner import SwitchPlan
from hotswitch.switch.state import StateKind, split_key


class CompiledModel:
    def __init__(self, model: torch.nn.Module, example_inputs, configs, *, strict: bool = True,
                 topology: Topology | None = None, lazy: bool = False, progress=None,
                 logic: LogicGraph | None = None, cp_layout: str = "contiguous", backend: str = "eager",
                 dynamic: bool | None = None, grad_bucket_bytes: int | None = None, weights=None):
        rng = torch.get_rng_state()  # weights="init" draws from here (tracing must not move it)
        if grad_bucket_bytes is not None and (isinstance(grad_bucket_bytes, bool)
                                              or not isinstance(grad_bucket_bytes, int) or grad_bucket_bytes < 1):
            raise ValueError(f"grad_bucket_bytes must be a positive number of bytes (DDP's bucket_cap_mb * 2**20), "
                             f"got {grad_bucket_bytes!r}; None keeps the default, {BUCKET_BYTES >> 20} MiB")
        if not dist.is_initialized():
            raise RuntimeError("hotswitch.compile needs torch.distributed: call dist.init_process_group first "
                               "(gloo on CPU, nccl on GPU), on every rank")
        configs = parse_configs(configs)  # DistConfigs, "dp2tp2sp" or "dp=2,tp=2,sp", or "dp4;tp4sp": one grammar
        source = W.check_source(weights, model)  # before tracing: a meta model without weights fails at once
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
        checked_cp_layout(cp_layout)  # (before tracing: a misspelt layout fails at once)
        self.topology = topology or Topology.from_env(self.world_size)
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
        self._inputs = InputSharding(self.call, self._sequence_inputs, logic.split_loss, cp_layout, self.world_size,
                                     self.rank)
        self.trace_seconds = time.perf_counter() - t0
        if self.logic_source != "given":
            report(f"{self.logic_source} in {self.trace_seconds:.1f} s: {len(self.logic.joint.graph.nodes)} nodes, "
                   f"{len(self.logic.param_names)} parameters")
        self.roles: TPRoles = infer_tp_roles(
            self.logic.forward.graph, self.logic.param_names, len(self.logic.buffer_names)
        )
        # buffers are replicated: whole on every rank (a meta model's computed by their modules' init)
        self._buffers = W.computed_buffers(model, self.logic.buffer_names, self.device,
                                           init=weights if source == "init_fn" else INIT)
        self._state_keys = list(model.state_dict().keys())
        hf = hf_model_of(model)  # save_pretrained writes its names, and its config
        self._hf_prefix, self._hf_config = (hf[0], getattr(hf[1], "config", None)) if hf else ("", None)
        self.last_load: W.LoadReport | None = None  # how this rank's weights were last read (`load_weights`)
        self._splits: dict[int, StageSplit] = {}  # pp -> the LogicGraph cut into pp stages
        self._state_dtypes: dict[str, dict[str, torch.dtype]] = {}  # attached kind -> dtype per parameter
        self.pipeline_schedule = "1f1b"  # forward_backward's default schedule for pp > 1 ("1f1b" | "gpipe")
        self.last_step: StepStats | None = None
        self._programs = Programs(
            logic, self._cache, buffers=lambda: self._buffers, input_dtypes=[x.dtype for x in self._example_inputs],
            sequence_inputs=self._sequence_inputs, split=self._split, strict=strict, dynamic=dynamic,
            bucket_bytes=self.grad_bucket_bytes, report=report)
        self._switcher = Switcher(self)
        self._states: dict[str, ConfigState] = {}
        for c in configs:  # (a pp > 1 config cuts the model now: one that cannot be cut fails at compile time)
            self._states[c.name] = make_config_state(
                c, self.roles, self.logic.param_shapes, rank=self.rank, device=self.device, runner=self._runner.kernels,
                split=self._split(c.pp) if c.pp > 1 else None)
        self._local: dict[str, torch.Tensor] = {}
        self._grads: dict[str, torch.Tensor] | None = None
        self.grad_dtype: torch.dtype | None = None  # gradient accumulators' dtype; None: the parameter's
        self._param_states: dict[str, dict[str, torch.Tensor]] = {}
        self._active = configs[0].name
        # each rank keeps (reads, initializes) only its pieces of the first config: see runtime.weights
        if source in (INIT, "init_fn"):
            torch.set_rng_state(rng)
        if source != "model":
            report(f"loading the weights ({source})")
        self.load_weights(weights, model)
        shapes = tuple(tuple(x.shape) for x in self._example_inputs)
        for c in configs if not lazy else ():
            self.exec_graph(c.name, shapes)

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
            self._inputs.check_split(st, shapes)
        local = st.local_batch_shapes(shapes, self._sequence_inputs)
        return self._programs.get(st, local, train=True, reduce=st.config.pp == 1,
                                  cp_length=st.cp_length(shapes, self._sequence_inputs)).joint

    def switch(self, name: str, algorithm: str = "greedy", weights: dict[str, torch.Tensor] | None = None
               ) -> SwitchStats:
        """Activate config `name`: weights, accumulated gradients and every attached per-parameter
        state move to its layout by the cached plan. Atomic: on any failure every rank stays in the
        previous config. Call on every rank.

        The weights do not move when they are already there: prefetched (`prefetch(name)`), or given
        as `weights`, this rank's shards in `name`'s layout (the Trainer keeps its base's weights through a
        step). Only gradients and attached states then move."""
        return self._switcher.switch(name, algorithm, weights)

    def prefetch(self, name: str, algorithm: str = "greedy") -> None:
        """Start moving the weights into config `name`'s layout in the background (a thread, on a
        process group of its own) while the active config computes; the next `switch(name)` waits for
        them and moves only the gradients and attached states. The weights must not change meanwhile
        (`set_local_params` discards the prefetch). This rank then holds two layouts of the weights.
        Call on every rank."""
        self._switcher.prefetch(name, algorithm)

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
        return self._switcher.hand_off_grads(name, algorithm)

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
        return self._switcher.full_tensors(self.state(kind))

    def shard_like_params(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's pieces of full per-parameter tensors, in the active config's layout."""
        return self._pieces(self._states[self._active], full)

    def plan_switch(self, source: str, destination: str, algorithm: str = "greedy",
                    with_grads: bool = False, states: tuple[str, ...] = (), weights: bool = True) -> SwitchPlan:
        """The plan moving weights (unless `weights=False`), gradients and attached states from one
        config's layout to another's. Pure: no communication; every rank computes the same plan;
        cached per pair."""
        return self._switcher.plan_switch(source, destination, algorithm, with_grads, states, weights)

    def plan_order(self, names, base: str | None = None) -> OrderPlan:
        """The cheapest cycle through `names` (from and back to `base`, default the first), priced by
        the plans' estimated seconds; the first switch of a step moves weights only."""
        return self._switcher.plan_order(names, base)

    @property
    def cp_layout(self) -> str:
        """How `shard_inputs` lays the sequence out over cp ranks (see CP_LAYOUTS)."""
        return self._inputs.cp_layout

    @cp_layout.setter
    def cp_layout(self, layout: str) -> None:
        self._inputs.cp_layout = layout

    def shard_inputs(self, *args, **kwargs):
        """This rank's part of a global batch: every tensor input's dim 0 split over the data-parallel
        axis (torch.tensor_split sizes) and, under context parallelism, the sequence dim (dim 1) of
        every input that has one over the cp axis, as `cp_layout` says (CP_LAYOUTS). Mirrors the call:
        positional inputs give a tuple (`cm.forward_backward(*cm.shard_inputs(*batch))`), keyword
        inputs a dict (`cm.forward_backward(**cm.shard_inputs(**batch))`); non-tensor inputs pass through."""
        return self._inputs.shard(self._states[self._active], args, kwargs)

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
        handoff = self._switcher.pending_hand_off
        if handoff is not None and (handoff.ran or micro_batches != 1 or st.config.pp > 1):
            self._switcher.settle_hand_off()  # these gradients change after it was armed: moved by the switch instead
            handoff = None
        if micro_batches != 1 or st.config.pp > 1:
            with self._attention(st, local_inputs):
                return self._pipelined(st, local_inputs, micro_batches, schedule, grad_scale, train=True)
        shapes = self._inputs.global_shapes(st, local_inputs)
        self._inputs.check_split(st, shapes)
        st.last_shapes = shapes
        gm = self._step_program(st, local_inputs, shapes, train=True)
        names = self.logic.param_names
        handed: set[str] = set()  # gradients the ExecGraph's hooks added (and handed off) already

        def final(indices: tuple[int, ...], grads: tuple[torch.Tensor, ...]) -> None:
            mine = [names[k] for k in indices]
            self._add_grads(dict(zip(mine, grads)), grad_scale)
            handed.update(mine)
            handoff.final(mine)

        run = self._runner(gm, f"{st.config.name}'s training step")
        with self._attention(st, local_inputs), handing_off(final) if handoff is not None else contextlib.nullcontext():
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
            with torch.no_grad(), self._attention(st, local_inputs):
                return self._pipelined(st, local_inputs, 1, None, 1.0, train=False)
        shapes = self._inputs.global_shapes(st, local_inputs)
        self._inputs.check_split(st, shapes)
        gm = self._step_program(st, local_inputs, shapes, train=False)
        with torch.no_grad(), self._attention(st, local_inputs):
            return self._runner(gm, f"{st.config.name}'s forward")(*self._local_params(), *self._buffers,
                                                                   *local_inputs)[0]

    def _step_program(self, st: ConfigState, local_inputs, shapes: tuple, *, train: bool) -> fx.GraphModule:
        """The program of one pp = 1 call on `local_inputs` (of a global batch of `shapes`), its
        reduction inside; refused where uneven rows meet an op that mixes them (`checked_rows`)."""
        program = self._programs.get(st, tuple(tuple(x.shape) for x in local_inputs), train=train, reduce=True,
                                     cp_length=st.cp_length(shapes, self._sequence_inputs))
        return self._inputs.checked_rows(st, program, self._inputs.uneven(st, shapes)).joint

    def _attention(self, st: ConfigState, local_inputs):
        """Under cp, `document_attention` on a sequence shard fetches the keys and values other cp
        ranks hold (`runtime.cp_attention`); elsewhere it runs on the local data as on one device.
        Where cp does not divide the length, the cp ranks' positions per row differ: it is told them."""
        cp = st.config.cp
        if cp == 1:
            return contextlib.nullcontext()
        from hotswitch.kernels.attention import local_implementation
        from hotswitch.runtime.cp_attention import ContextParallelAttention

        length = st.cp_length(self._inputs.global_shapes(st, local_inputs), self._sequence_inputs)
        lengths = None if length is None else tuple(chunk_span(length, cp, r)[1] for r in range(cp))
        return local_implementation(ContextParallelAttention(self.process_group(st.config.name, "cp"), lengths))

    def _on_device(self, local_inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Inputs moved to the device this rank computes on (a CPU batch on an NCCL job, say)."""
        return tuple(x if x.device == self.device else x.to(self.device, non_blocking=True) for x in local_inputs)

    def graph_inputs(self, *local_inputs: torch.Tensor) -> list[torch.Tensor]:
        """What `exec_graph(active)` takes, in order: this rank's parameter shards, the buffers, then
        `local_inputs` (for running or compiling the graph by hand, as the profiler does). pp = 1."""
        return [*self._local_params(), *self._buffers, *local_inputs]

    def zero_grad(self) -> None:
        self._switcher.settle_hand_off()
        self._grads = None

    def accumulate_grads(self, grads: dict[str, torch.Tensor]) -> None:
        """Add gradients given as this rank's shards in the active layout (ones set aside earlier
        in the same step, say) to the accumulated ones."""
        self._switcher.settle_hand_off()
        self._add_grads(grads, 1.0)

    def set_local_params(self, local: dict[str, torch.Tensor]) -> None:
        """Replace this rank's parameter shards in the active layout (after an optimizer step);
        a prefetch of the old weights is dropped."""
        self._switcher.take_prefetch(None)
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
        return layouts_on(config, devices, self.roles, self.logic.param_shapes)

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
        full = self._switcher.full_tensors(self._local if params is None else params)
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
        return self._switcher.full_tensors(self._grads)

    def load_weights(self, weights, model: torch.nn.Module | None = None, *, dtype: torch.dtype | None = None
                     ) -> dict[str, torch.Tensor]:
        """Replace the weights (in the active config's layout) by `weights`: a Hugging Face
        save_pretrained directory or a torch.distributed.checkpoint directory (each rank reads only
        its pieces), "init" or an init function (initializing `model`, one module at a time), None
        (`model`'s own values: the compiled model), or "empty" (see `hotswitch.runtime.weights`).
        Buffers the source holds are replaced too. Returns
        this rank's pieces in `dtype` (default: the parameters'; fp32 masters, say). A collective: call
        on every rank, between steps. `last_load` says what was read."""
        pieces, buffers, self.last_load = W.load(self, weights, model, dtype)
        self._switcher.take_prefetch(None)
        self._local = {n: p.to(self.logic.param_dtypes[n]) for n, p in pieces.items()}
        for name, value in buffers.items():
            self._buffers[self.logic.buffer_names.index(name)] = value
        if weights != W.EMPTY:
            W.check_buffers(self.logic.buffer_names, self._buffers, weights)
        return pieces

    def save_pretrained(self, directory, config=None, *, params: dict[str, torch.Tensor] | None = None,
                        max_shard_bytes: int = 2 << 30) -> None:
        """Write the weights as a Hugging Face checkpoint that `from_pretrained` reads on one process:
        safetensors files of at most `max_shard_bytes` each, written by the ranks that gathered their
        tensors (each tensor to one rank, never the whole model to one), the index and `config.json`
        (`config`, default the Hugging Face model's own) by rank 0. Names are the Hugging Face model's
        (a wrapper's prefix dropped); a tied weight is written once, as `save_pretrained` does.
        `params`: other shards in the active layout (fp32 masters). A collective: call on every rank."""
        from hotswitch.runtime.saving import save_pretrained

        save_pretrained(self, directory, config if config is not None else self._hf_config,
                        params=self._local if params is None else params, max_shard_bytes=max_shard_bytes)

    def save_checkpoint(self, directory, *, params: dict[str, torch.Tensor] | None = None) -> None:
        """Write the weights (and persistent buffers) as a torch.distributed.checkpoint, each rank its
        shards, under the names of `model.state_dict()`: `hs.compile(..., weights=directory)` loads it
        into any config, `torch.distributed.checkpoint.format_utils.dcp_to_torch_save` into one file.
        `params`: other shards in the active layout. A collective: call on every rank."""
        from hotswitch.runtime.saving import save_checkpoint

        save_checkpoint(self, directory, params=self._local if params is None else params)

    def compile_seconds(self, name: str) -> float:
        st = self._state(name)
        return sum(st.compile_seconds.values()) + st.fit_seconds

    # ------------------------------------------------------------------------------------ internals
    def _state(self, name: str) -> ConfigState:
        if name not in self._states:
            raise ValueError(f"unknown config {name!r}: the compiled configs are {list(self._states)}; pass one of "
                             "these names, or compile again with this config added to `configs`")
        return self._states[name]

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
        return parameter_layouts(st, self.logic.param_shapes, self._splits.get(st.config.pp), kinds, weights)

    def _local_params(self) -> list[torch.Tensor]:
        return [self._local[n] for n in self.logic.param_names]

    def _pieces(self, st: ConfigState, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: self._slice(st, n, full[n]) for n in self._held(st)}

    def _slice(self, st: ConfigState, name: str, full: torch.Tensor) -> torch.Tensor:
        return full[self._box(st, name)].to(self.device, copy=True)

    def _box(self, st: ConfigState, name: str) -> tuple[slice, ...]:
        """This rank's piece of parameter `name` under `st`, one slice per dim (DTensor's rule, uneven
        shards included): what `_slice` keeps of a full tensor, and what a checkpoint reader reads."""
        meta = torch.empty(self.logic.param_shapes[name], dtype=self.logic.param_dtypes[name], device="meta")
        shape, offset = dt.local_shape_and_offset(dt.make_spec(st.mesh, st.param_specs[name], meta))
        return tuple(slice(o, o + s) for o, s in zip(offset, shape))

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
        # (micro-batches share the batch's sequence: where cp cuts it unevenly, its global length)
        cp_length = st.cp_length(self._inputs.global_shapes(st, local_inputs), self._sequence_inputs) \
            if st.config.cp > 1 else None
        programs = [self._inputs.checked_rows(st, self._programs.get(st, tuple(tuple(x.shape) for x in mb), train=train,
                                                         reduce=False, cp_length=cp_length), uneven) for mb in micro]
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


def compile(model: torch.nn.Module, example_inputs, configs, *, strict: bool = True,
            topology: Topology | None = None, lazy: bool = False, progress=None,
            logic: LogicGraph | None = None, cp_layout: str = "contiguous", backend: str = "eager",
            dynamic: bool | None = None, grad_bucket_bytes: int | None = None, weights=None) -> CompiledModel:
    """Trace `model` once and compile it for every config.

    `model`: forward returns a scalar mean loss, or an object or dict with a `loss` entry (Hugging
    Face models given labels; `use_cache=False` is passed where forward takes it). `example_inputs`:
    a *global* batch, as a tuple of positional inputs or a dict of keyword arguments
    (`dict(input_ids=ids, labels=labels)`); later calls give the same names (see `shard_inputs`).
    `configs`: DistConfigs or strings ("dp2tp2sp" or "dp=2,tp=2,sp"), each over all ranks.

    Call on every rank after `dist.init_process_group`, with identical weights (or `weights`) on every rank. The
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
    `weights`: where the weights come from (`hotswitch.runtime.weights`): None, the model's own
    values (identical on every rank); for a model built under `torch.device("meta")`, "init" (its
    own initialization, equal to one device's with the same seed: `runtime.meta_init`), a function
    of a module (`model.apply(init_fn)`'s), or a path: a Hugging Face save_pretrained directory or a
    torch.distributed.checkpoint directory. Each rank then holds only its pieces of the first config.
    """
    return CompiledModel(model, example_inputs, configs, strict=strict, topology=topology, lazy=lazy, progress=progress,
                         logic=logic, cp_layout=cp_layout, backend=backend, dynamic=dynamic,
                         grad_bucket_bytes=grad_bucket_bytes, weights=weights)
