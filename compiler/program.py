"""The one lowering path: a (stage of a) LogicGraph and a config's placements -> this rank's programs.

Every ExecGraph is lowered here, whatever the config: a pp = 1 config's whole model is the one
stage of its pipeline (`stage=None`). `lower_program` builds the placeholder specs (parameters in
their config's placements, buffers replicated, model inputs sharded on the batch dim over dp,
activations received from a neighbouring stage in the layout that stage sends), propagates
shardings (`propagate.propagate_graph`) and traces this rank's program (`lower.lower`). Two outputs:

- `reduce=True` (pp = 1 only): one graph that ends with the data-parallel gradient reduction
  (bucketed), the division by the global loss denominator and every gradient in its parameter's
  layout: what one `forward_backward` call runs.
- `reduce=False`: loss parts and gradients left unreduced, so micro-batches (and pipeline stages)
  sum them and one `reduce.lower_reduction` program reduces once per step; not the last stage:
  cut into a forward and a backward program (`stages.split_forward_backward`).

Uneven data-parallel batches: each rank propagates with its own local batch times dp (the virtual
global batch). Data parallelism moves no activation across the dp axis (only sums of losses and
gradients), so each rank's own graph is exact, and so are the reductions.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, replace

import sympy
import torch
import torch.fx as fx

from . import _dtensor as dt
from ._torch import pytree, with_code
from .cache import CompileCache
from .fsdp import GatherPlan
from .garbage import collector_paused
from .lengths import CannotFit, LengthFit, affine_in_length, fit
from .logic_io import dumps_fit, dumps_program, graph_text, loads_fit, loads_program
from .lower import lower
from .propagate import propagate_graph
from .recompute import recomputed
from .reduce import BUCKET_BYTES, OutputPlan, StageOutputPlan
from .sharding import ShardingDecisions, mixes_rows, reads_coordinate
from .stages import Stage, split_forward_backward, stage_joint
from .tp_rules import param_views
from .trace import LogicGraph

__all__ = ["StageMesh", "StageProgram", "completed", "constants_digest", "fit_programs", "lower_program",
           "program_at"]


@dataclass(frozen=True)
class StageMesh:
    """Where a stage computes: the DeviceMesh of its (dp, cp, tp) axes, the axis name -> mesh dim map,
    the data-parallel degree, whether sequence parallelism is on, and each parameter's placements;
    `cp`: the context-parallel degree (every input's dim 1, the sequence, is sharded over "cp")."""

    mesh: dt.DeviceMesh
    axis: dict[str, int]
    dp: int
    sp: bool
    param_placements: dict[str, tuple]
    name: str = ""  # the config's name, for the graphs' metadata and error messages
    device: torch.device = torch.device("cpu")  # where the program runs: its factory ops allocate there
    cp: int = 1
    # what runs the programs ("eager" or "inductor"): their attention is written as the device's fused
    # kernels when they are lowered (`attention.fuse_attention`); None: left to run time
    runner: str | None = None
    # fsdp (`compiler.fsdp`): the placements parameters are stored in where they differ from
    # `param_placements` (the ones they compute in), and each parameter's unit
    param_storage: dict[str, tuple] | None = None
    units: dict[str, str] | None = None
    recompute: str = "none"  # activation recomputation (`compiler.recompute`)


@dataclass
class StageProgram:
    """This rank's lowered programs for one stage and one local micro-batch shape.

    reduce=True: `joint` (params, buffers, inputs) -> (loss, *grads in parameter layouts), or the
    loss alone without `train`. reduce=False, training, not the last stage: forward (params,
    buffers, inputs, acts in) -> (acts out..., den, saved...), backward (saved..., grads of acts out)
    -> (param grads..., grads of acts in...). reduce=False, last stage (or pp = 1): forward ->
    (num, den, param grads..., grads of acts in...). Forward only: (acts out..., den) or, last, (num, den).
    """

    joint: fx.GraphModule  # the whole lowered graph, before the forward/backward cut
    forward: fx.GraphModule
    backward: fx.GraphModule | None
    train: bool
    is_last: bool
    n_acts_out: int
    n_losses: int  # 2 (num, den) on the last stage, 1 (den) elsewhere
    n_params: int
    send_grads: tuple[bool, ...]  # per act in: is a gradient sent back for it (floating point)
    recv_acts: list[tuple[tuple[int, ...], torch.dtype]]
    recv_grads: list[tuple[tuple[int, ...], torch.dtype]]
    deferred_specs: list  # DTensorSpecs of (losses..., param grads...) as the program returns them
    param_specs: list  # DTensorSpecs of the stage's parameters
    seconds: float = 0.0  # lowering in all
    propagate_seconds: float = 0.0  # of which deciding placements (DTensor's strategy search, or a replay)
    decisions: ShardingDecisions | None = None  # the placements decided, apart from shapes
    replayed: int = 0  # ops whose placements were replayed from earlier decisions
    loaded: bool = False  # the ExecGraph was not traced here: the compile cache or another dp rank had it
    # ops that combine rows of different dp ranks other than by a sum (`sharding.mixes_rows`): exact only
    # when every dp rank holds the same number of rows
    mixes_rows: tuple[str, ...] = ()
    replayed_all: bool = False  # every decision replayed from another shape's, none searched again
    fitted: tuple[int, int] | None = None  # not lowered: written from the programs at these two lengths (`program_at`)
    cache_key: str | None = None  # where the compile cache keeps it (None: nowhere): what its length fit is filed under

    def with_passes(self, gm: fx.GraphModule) -> StageProgram:
        """This program with `gm` (a program of its stage and shapes) as its joint program, and as its
        forward and backward: cut apart for a training stage that receives gradients (not the last),
        else `gm` and None (`stages.split_forward_backward`)."""
        forward, backward = gm, None
        if self.train and self.recv_grads:
            forward, backward, _ = split_forward_backward(gm, len(self.recv_grads),
                                                          tuple(range(self.n_acts_out + self.n_losses)))
        return replace(self, joint=gm, forward=forward, backward=backward)


def _concrete(size, values: dict) -> int:
    if isinstance(size, torch.SymInt):
        return int(sympy.sympify(size.node.expr).subs(values))
    return int(size)


def _canonical(decisions: ShardingDecisions) -> str:
    """The decisions as text that is the same in every process (a frozenset's order is not)."""
    return repr((sorted(decisions.ops.items()), sorted(decisions.keep_partial)))


def constants_digest(graph: fx.Graph) -> str:
    """A digest of the tensors a graph reads as attributes: its code names them, the program holds
    them (part of every key naming a program: the compile cache's, the Inductor runner's)."""
    h = hashlib.sha256()
    for n in graph.nodes:
        if n.op == "get_attr":
            value = getattr(graph.owning_module, n.target)
            h.update(n.target.encode())
            if isinstance(value, torch.Tensor):
                h.update(repr((value.dtype, tuple(value.shape))).encode())
                h.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _leaves(graph: fx.Graph) -> list[fx.Node]:
    out = next(n for n in graph.nodes if n.op == "output")
    return pytree.tree_leaves(out.args[0])


def _plan_redistributions(plan, output_specs: list) -> tuple:
    """The (have, want) spec pairs the end of a program redistributes: gradients, once reduced, into
    their parameters' layouts; a stage's sent values into the neighbour's."""
    if isinstance(plan, StageOutputPlan):
        return tuple((output_specs[i], want) for i, want in plan.sent)
    reduced = [dt.spec(s.mesh, tuple(dt.Replicate() if p.is_partial() else p for p in s.placements),
                              s.tensor_meta) for s in output_specs[plan.num_losses:]]
    return tuple(zip(reduced, plan.param_specs))


@collector_paused()
def lower_program(logic: LogicGraph, stage: Stage | None, where: StageMesh, buffers: list[torch.Tensor],
                  local_shapes: tuple, input_dtypes: list[torch.dtype], *, train: bool, reduce: bool = False,
                  strict: bool = True, memo: dict | None = None, decided: ShardingDecisions | None = None,
                  cache: CompileCache | None = None, sample: bool = False,
                  bucket_bytes: int = BUCKET_BYTES, cp_length: int | None = None) -> StageProgram:
    """Lower one stage (None: the whole model) for local micro-batches of `local_shapes` (this rank's
    rows) on `where.mesh`. `cp_length`: the global sequence length where cp does not divide it (the
    cp ranks' local lengths then differ; otherwise the global length is the local one times cp).
    `memo`: a propagation cache owned by the caller (see `_dtensor.propagation`; it also keeps the
    redistributions `lower` traced);
    `decided`: the same graph's decisions under the same placements at another shape, replayed
    instead of searched (the program's `decisions` are what to pass next time); `cache`: the compile cache
    as the runtime consults it (`SharedCache`: get / put / keeps / key / failed / report, on disk and
    between ranks), consulted for the decisions when `decided` is None (filled after a
    search) and for this rank's program ("program"; "shared program" for one every dp rank lowers alike).
    `sample`: a program only read as a graph (the second of a length fit, `fit_programs`): its code is
    not written (until it is run, if ever), it is not filed in the cache, nor cut into its passes.
    `bucket_bytes`: the size of the data-parallel gradient reduction's buckets (one all-reduce each)."""
    t0 = time.perf_counter()
    if reduce and stage is not None:
        raise ValueError("reduce=True lowers a whole model (stage=None); pipeline stages defer their reduction")
    if stage is None:
        gm, param_names, n_out, is_last = (logic.joint if train else logic.forward), logic.param_names, 0, True
        forward_outputs = 2 if logic.split_loss else 1
    else:
        gm = stage_joint(logic, stage) if train else stage.forward
        param_names, n_out, is_last = stage.param_names, len(stage.acts_out), stage.is_last
        forward_outputs = n_out + (2 if is_last else 1)
    # fsdp: parameters stored sharded; what the backward reads of them it gathers again (`recomputed`)
    storage = where.param_storage or {}
    sharded = frozenset(i for i, n in enumerate(param_names) if n in storage)
    graph = (recomputed(gm, where.recompute, forward_outputs, sharded) if train else gm).graph
    mesh, axis, dp, cp = where.mesh, where.axis, where.dp, where.cp
    ndim = mesh.ndim
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    n_p, n_b, n_i = len(param_names), len(buffers), logic.num_inputs
    inputs = phs[n_p + n_b:n_p + n_b + n_i]
    boundary = phs[n_p + n_b + n_i:]
    # context parallelism shards every input's sequence dim (dim 1) over "cp"
    cp_inputs = [cp > 1 and along_seq for along_seq in logic.sequence_inputs()]
    virtual = [(s[0] * dp, cp_length or s[1] * cp, *s[2:]) if along_seq else (s[0] * dp, *s[1:])
               for s, along_seq in zip(local_shapes, cp_inputs)]
    values, batch_syms, seq_sym = {}, set(), None
    for ph, shape in zip(inputs, virtual):
        val = ph.meta["val"]
        for d, s in enumerate(val.shape):
            if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol):
                values[s.node.expr] = shape[d]
                if d == 0:
                    batch_syms.add(s.node.expr)
                if d == 1 and seq_sym is None and val.dim() >= 2:
                    seq_sym = s.node.expr

    def boundary_spec(val) -> dt.DTensorSpec:
        shape = tuple(_concrete(s, values) for s in val.shape)
        placements = [dt.Replicate()] * ndim
        if dp > 1 and "dp" in axis and val.dim() and isinstance(val.shape[0], torch.SymInt) \
                and val.shape[0].node.expr.free_symbols & batch_syms:
            placements[axis["dp"]] = dt.Shard(0)
        seq = [d for d, s in enumerate(val.shape) if isinstance(s, torch.SymInt) and s.node.expr == seq_sym]
        if where.sp and "tp" in axis and seq:
            placements[axis["tp"]] = dt.Shard(seq[0])
        if cp > 1 and seq:
            placements[axis["cp"]] = dt.Shard(seq[0])
        return dt.make_spec(mesh, placements, torch.empty(shape, dtype=val.dtype, device="meta"))

    specs = [dt.make_spec(mesh, where.param_placements[n],
                          torch.empty(logic.param_shapes[n], dtype=logic.param_dtypes[n], device="meta"))
             for n in param_names]
    # fsdp: the parameters arrive (and their gradients leave) in the placements they are stored in
    stored_specs = [dt.spec(mesh, tuple(storage[n]), s.tensor_meta) if n in storage else s
                    for n, s in zip(param_names, specs)]
    gathers = None
    if storage:
        gathers = GatherPlan(tuple((i, where.units[n], stored_specs[i], specs[i]) for i, n in enumerate(param_names)
                                   if stored_specs[i].placements != specs[i].placements), axis["dp"])
    specs += [dt.make_spec(mesh, (dt.Replicate(),) * ndim, b.to("meta")) for b in buffers]
    for shape, dtype, along_seq in zip(virtual, input_dtypes, cp_inputs):
        placements = [dt.Replicate()] * ndim
        if dp > 1 and "dp" in axis:
            placements[axis["dp"]] = dt.Shard(0)
        if along_seq:
            placements[axis["cp"]] = dt.Shard(1)
        specs.append(dt.make_spec(mesh, placements, torch.empty(shape, dtype=dtype, device="meta")))
    specs += [boundary_spec(ph.meta["val"]) for ph in boundary]
    n_acts_in = len(stage.acts_in) if stage is not None else 0
    # a training stage that receives gradients (not the last) is cut into a forward and a backward
    # after lowering; those get their attention kernels at run time, per part
    cut = train and not reduce and len(boundary) > n_acts_in
    kernels = where.runner if not cut else None  # the backend this program's attention kernels are for
    attention = (where.device, kernels == "inductor") if kernels is not None else None
    key = None
    what = (graph_text(graph), tuple(mesh.mesh.shape), mesh.mesh_dim_names, dp, cp, where.sp, strict,
            [dt.encode_placements(where.param_placements[n]) for n in param_names],
            [(n, dt.encode_placements(storage[n]), where.units[n]) for n in param_names if n in storage],
            [(tuple(b.shape), b.dtype) for b in buffers], list(input_dtypes), ndim)
    if decided is None and cache is not None:
        key = cache.key(*what)
        decided = cache.get(key)
    # this rank's example inputs, on its device (real tensors: make_fx fakes them itself, and DTensor's
    # uneven _StridedShard gather reads index tensors that inputs faked here would make data-dependent)
    local = [torch.empty(dt.local_shape(s), dtype=s.tensor_meta.dtype, device=where.device)
             for s in stored_specs + specs[n_p:]]
    n_losses = 2 if is_last else 1
    deferred = [] if reduce else \
        list(range(n_out, n_out + n_losses)) + (list(range(n_out + n_losses, n_out + n_losses + n_p)) if train else [])
    groups = _group_names(mesh)

    dp_dim = axis.get("dp") if dp > 1 else None

    def program_key(decisions: ShardingDecisions, any_dp: bool = False) -> str:
        # propagation is a function of the graph, the specs and the decisions it replays: so is the
        # program, with this rank's coordinate (`any_dp`: one program for every dp coordinate)
        coordinate = tuple(None if any_dp and i == dp_dim else c for i, c in enumerate(mesh.get_coordinate()))
        shapes = (tuple(map(tuple, local_shapes)), *([cp_length] if cp_length else []))
        return cache.key("program", *what, *shapes, coordinate,
                         train, reduce, logic.split_loss, str(where.device), bucket_bytes,
                         kernels,
                         _canonical(decisions), constants_digest(graph))

    def load(entry):
        try:
            data, encoded_specs, mixed, replayed_all = entry
            return (loads_program(data, groups), [dt.decode_spec(mesh, e) for e in encoded_specs], tuple(mixed),
                    replayed_all)
        except Exception as e:  # noqa: BLE001 - an entry from another torch build, say: lower it again
            cache.report(f"a cached ExecGraph did not load ({type(e).__name__}: {e}); it is lowered again")
            return None, None, (), False

    sharding, propagate_seconds, gm, deferred_specs, mixed, replayed_all = None, 0.0, None, None, (), False
    stored = None  # the key the cache keeps this program under
    if cache is not None and decided is not None:  # this rank's very program, lowered by an earlier process
        for any_dp in ((True, False) if dp_dim is not None else (False,)):
            looked_up = program_key(decided, any_dp)
            entry = cache.get(looked_up, "program")
            if entry is not None:
                gm, deferred_specs, mixed, replayed_all = load(entry)
                stored = looked_up if gm is not None else None
                break
    # graph -> did its last program leave the dp coordinate unread (`reads_coordinate`)? Then one with
    # the same decisions does too: it is looked up, or claimed, before the decisions are replayed
    shared_before = None if memo is None else memo.setdefault("shared programs", {})
    claimed = None
    # (a sample is never published: each rank lowers its own, and none waits for another's)
    if gm is None and cache is not None and decided is not None and dp_dim is not None and not sample \
            and shared_before is not None and shared_before.get(graph, decided.dp_shared):
        claimed = program_key(decided, any_dp=True)
        entry = cache.get(claimed, "shared program")
        if entry is not None:
            gm, deferred_specs, mixed, replayed_all = load(entry)
            stored = claimed if gm is not None else None
            claimed = None  # another rank lowered it; nothing of ours to publish
    loaded = gm is not None
    if loaded:
        decisions = decided  # nothing propagated: the program already holds what the decisions lead to
    else:
        t_propagate = time.perf_counter()
        try:
            try:
                sharding = propagate_graph(graph, mesh, specs, sp_axis=axis.get("tp") if where.sp else None,
                                           cp_axis=axis.get("cp"), seq_symbol=seq_sym,
                                           pinned_nodes=param_views(graph, n_p), strict=strict, memo=memo,
                                           decided=decided, config=where.name)
            except BaseException:
                if key is not None and decided is None:
                    cache.failed(key)
                raise
            propagate_seconds = time.perf_counter() - t_propagate
            decisions = sharding.placements()
            if reduce:
                plan = OutputPlan(split_loss=logic.split_loss, num_losses=2 if logic.split_loss else 1,
                                  param_specs=tuple(stored_specs) if train else (),
                                  **(fsdp_units(param_names, where) if train else {}))
            else:
                out_vals = [n.meta["val"] for n in _leaves(graph)]
                # activations, in the next stage's layout
                sent = [(i, boundary_spec(out_vals[i])) for i in range(n_out)]
                if train:
                    first_grad_in = n_out + n_losses + n_p
                    sent += [(first_grad_in + k, specs[n_p + n_b + n_i + k]) for k in range(n_acts_in)]
                plan = StageOutputPlan(forward_outputs=tuple(range(n_out + n_losses)), sent=tuple(sent))
            # ranks that differ only in their dp coordinate lower the same program unless it reads that
            # coordinate (`sharding.reads_coordinate`): the first to get here lowers it for the others
            one_for_all = cache is not None and dp_dim is not None and not reads_coordinate(
                sharding, graph, dp_dim, _plan_redistributions(plan, sharding.output_specs)) \
                and (gathers is None or gathers.even())
            if dp_dim is not None and cache is not None:
                decisions = replace(decisions, dp_shared=one_for_all)
        except BaseException:
            if claimed is not None:
                cache.failed(claimed)  # the dp ranks waiting for it lower it themselves (and raise the same)
            if key is not None and decided is None:
                cache.failed(key)
            raise
        shared = None
        if shared_before is not None and dp_dim is not None:
            shared_before[graph] = one_for_all
        if claimed is not None:  # ours to lower for the other dp ranks, or to tell them to lower their own
            if one_for_all:
                shared = claimed
            else:
                cache.failed(claimed)
        elif one_for_all and not sample:
            shared = program_key(decided if decided is not None else decisions, any_dp=True)
            entry = cache.get(shared, "shared program")
            if entry is not None:
                gm, deferred_specs, mixed, replayed_all = load(entry)
                loaded = gm is not None
                stored = shared if loaded else None
                shared = None  # nothing to publish: another rank (or an earlier process) lowered it
        if key is not None and decided is None:
            # published once this rank has claimed the shared program it lowers: a dp rank that the
            # decisions tell to wait for one finds it claimed, and does not lower it a second time
            cache.put(key, decisions)
        if gm is None:
            try:
                # with the DP reduction inside, its buckets reduced behind the rest of the backward
                gm = lower(graph, sharding, local, plan, mesh, bucket_bytes, device=where.device,
                           traced=None if memo is None else memo.setdefault("traced", {}), reduce_early=reduce,
                           attention=attention, codeless=sample, fsdp=gathers, config=where.name)
            except BaseException:
                if shared is not None:
                    cache.failed(shared)  # the ranks waiting for it lower it themselves (and raise the same)
                raise
            deferred_specs = [sharding.output_specs[i] for i in deferred]
            mixed = mixes_rows(sharding, dp_dim) if dp_dim is not None else ()
            # (on a one-device mesh, a pipeline stage of its own, every value is whole: nothing to
            # search or replay, and the program is a function of its shapes alone)
            replayed_all = (sharding.replayed > 0 or mesh.size() == 1) and not sharding.searched
            data = None
            if cache is not None and not sample and cache.keeps("shared program" if shared is not None else "program"):
                try:
                    data = dumps_program(gm, {name: i for i, name in enumerate(groups)})
                except Exception:  # noqa: BLE001 - a value pickle cannot write: this program is not cached
                    data = None
            if data is not None:
                entry = (data, [dt.encode_spec(s) for s in deferred_specs], mixed, replayed_all)
                if shared is not None:
                    stored = shared
                    cache.put(shared, entry, "shared program")
                else:
                    stored = program_key(decided if decided is not None else decisions)
                    cache.put(stored, entry, "program")
            elif shared is not None:
                cache.failed(shared)
    # (not the GraphSharding: a third of the objects a lowered program would keep alive, for the
    # garbage collector's full collections to walk; `decisions` holds its placements, plainly)
    gm.meta["hotswitch"] = {"config": where.name, "stage": stage.index if stage is not None else 0,
                            "local_shapes": tuple(local_shapes), "kernels": kernels}
    recv_acts = [(tuple(t.shape), t.dtype) for t in local[n_p + n_b + n_i:n_p + n_b + n_i + n_acts_in]]
    recv_grads = [(tuple(t.shape), t.dtype) for t in local[n_p + n_b + n_i + n_acts_in:]]
    program = StageProgram(
        joint=gm, forward=gm, backward=None, train=train, is_last=is_last, n_acts_out=n_out,
        n_losses=n_losses, n_params=n_p, send_grads=tuple(dtype.is_floating_point for _, dtype in recv_acts),
        recv_acts=recv_acts, recv_grads=recv_grads, deferred_specs=deferred_specs,
        param_specs=stored_specs, propagate_seconds=propagate_seconds,
        decisions=decisions, replayed=sharding.replayed if sharding is not None else 0, loaded=loaded,
        mixes_rows=mixed, replayed_all=replayed_all, cache_key=stored)
    if not sample:  # (a sample's passes are cut when it is `completed`)
        program = program.with_passes(gm)
    return replace(program, seconds=time.perf_counter() - t0)


def fsdp_units(param_names: list[str], where: StageMesh) -> dict:
    """The OutputPlan fields of a program whose gradients are reduce-scattered per fsdp unit: the
    units' parameter indices, the last unit first (the order the backward makes them)."""
    if not where.param_storage:
        return {}
    members: dict[str, list[int]] = {}
    for i, n in enumerate(param_names):
        if n in where.param_storage:
            members.setdefault(where.units[n], []).append(i)
    return {"units": tuple(tuple(m) for m in reversed(members.values())), "dp_dim": where.axis["dp"]}


def completed(sample: StageProgram) -> StageProgram:
    """A program lowered as a `sample` (graph only) made the program of its shapes, where no length
    fit writes it: its code written and, for a stage that receives gradients, cut into its passes.
    Not filed in the compile cache (a sample never is)."""
    t0 = time.perf_counter()
    gm = sample.joint if sample.loaded else with_code(sample.joint)  # (one loaded from the cache has its code)
    return replace(sample.with_passes(gm), seconds=sample.seconds + time.perf_counter() - t0)


def fit_programs(logic: LogicGraph, first: StageProgram, length_a: int, second: StageProgram,
                 length_b: int) -> LengthFit:
    """The programs of one config (or pipeline stage) at the same rows and two sequence lengths as
    one program in the length (`compiler.lengths`), or CannotFit saying why not. The second must
    have been lowered by replaying the first's decisions with none searched again: a program at a
    further length is then what a replay would write there."""
    if not second.replayed_all:
        raise CannotFit(f"the program at length {length_b} did not replay every decision of length {length_a}")
    if first.deferred_specs != second.deferred_specs or first.mixes_rows != second.mixes_rows:
        raise CannotFit("the gradients' layouts differ between the lengths")
    graph = (logic.joint if first.train else logic.forward).graph
    if logic.seq_symbol is None or not affine_in_length(graph, logic.seq_symbol):
        raise CannotFit("a size in the model is not affine in the sequence length")
    return fit(first.joint, length_a, second.joint, length_b)


def _group_names(mesh) -> list[str]:
    """The process group of each of `mesh`'s axes, by name (what a program's collectives name)."""
    return [mesh.get_group(i).group_name for i in range(mesh.ndim)]


def fit_key(cache, first: StageProgram, length_a: int, length_b: int, kind: str = "length fit") -> str | None:
    """Where the compile cache files the fit of `first` (at `length_a`) with its replay at `length_b`:
    a function of the two, as the program's own key is of what lowered it. None where `first` is not
    in the cache or nothing would keep the fit. `kind`: "length fit", or "shared length fit" for one
    that every dp rank of a program shared between them (`ShardingDecisions.dp_shared`) makes alike."""
    if cache is None or first.cache_key is None or not cache.keeps(kind):
        return None
    return cache.key("length fit", first.cache_key, length_a, length_b)


def load_fit(cache, key: str, first: StageProgram, where: StageMesh, kind: str = "length fit") -> LengthFit | None:
    """The fit filed under `key` for `first`, or None (not there; one that does not load is reported
    once and made again)."""
    entry = cache.get(key, kind)
    if entry is None:
        return None
    try:
        return loads_fit(entry, first.joint, _group_names(where.mesh))
    except Exception as e:  # noqa: BLE001 - an entry from another build, say: fit again
        cache.report(f"a cached length fit did not load ({type(e).__name__}: {e}); it is fitted again")
        return None


def store_fit(cache, key: str, fitted: LengthFit, where: StageMesh, kind: str = "length fit") -> bool:
    """File `fitted` under `key` (`fit_key`), where it can be written. False: it cannot be written
    out (a global of its code that does not pickle, say)."""
    data = dumps_fit(fitted, {name: axis for axis, name in enumerate(_group_names(where.mesh))})
    if data is not None:
        cache.put(key, data, kind)
    return data is not None


def program_at(fitted: LengthFit, like: StageProgram, length: int, local_shapes: tuple) -> StageProgram:
    """The program of `fitted` at sequence length `length` (raises CannotFit where it does not
    hold, or where its fused attention kernels are not SDPA's choice there): `like` (one of the two
    fitted) written at that length, its graph when first read (`LengthFit.at`). Not cached: writing
    one (0.013 s for an 8-layer Llama) costs less than writing it to disk, and a later process loads
    the fit with the first program."""
    t0 = time.perf_counter()
    gm = fitted.at(length)
    reason = fitted.kernels_hold(length)  # (values read off the fit: the graph is not written yet)
    if reason is not None:
        raise CannotFit(reason)
    gm.meta["hotswitch"] = {**like.joint.meta["hotswitch"], "local_shapes": tuple(local_shapes)}
    # a stage's boundary: the last placeholders are the activations and the gradients it receives
    received = fitted.placeholder_values(length)
    received = received[len(received) - len(like.recv_acts) - len(like.recv_grads):]
    received = [(tuple(v.shape), v.dtype) for v in received]
    return replace(like.with_passes(gm), recv_acts=received[:len(like.recv_acts)],
                   recv_grads=received[len(like.recv_acts):], seconds=time.perf_counter() - t0,
                   propagate_seconds=0.0, replayed=0, loaded=False, replayed_all=False, fitted=fitted.lengths,
                   cache_key=None)
