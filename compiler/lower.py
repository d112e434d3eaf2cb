"""Lowering: a graph's sharding decisions (`compiler.sharding`, made by `compiler.propagate`) become
this rank's program, built node by node on its local shapes (each op's meta kernel gives them),
every collective an explicit functional-collective node of the GraphModule (DTensor's
redistributions, traced by make_fx and copied in); the program's end (`compiler.reduce`) reduces
the data-parallel gradients in buckets, divides by the loss denominator and puts every gradient
in its parameter's layout. Then the collectives are placed: buckets issued behind the backward,
every wait where its result is first read.
"""
from __future__ import annotations

import operator
import warnings
from collections import Counter
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from . import _dtensor as dt
from . import attention as _attention
from . import handoff
from ._torch import (
    add_node,
    codeless_module,
    codeless_modules,
    copy_node,
    graph_module,
    map_args,
    meta_like,
    pytree,
)
from .fsdp import GatherPlan, gather_unit, prefetch_gathers
from .propagate import _signature, meta_run
from .reduce import (
    BUCKET_BYTES,
    OnProgram,
    OutputPlan,
    StageOutputPlan,
    finish_outputs,
    gradient_buckets,
    output_finisher,
    scattered_units,
)
from .sharding import Decision, GraphSharding, ShardingError, unshardable

aten = torch.ops.aten


def lower(
    graph: fx.Graph,
    sharding: GraphSharding,
    local_inputs: list[torch.Tensor],
    out_plan: OutputPlan | StageOutputPlan,
    mesh: dt.DeviceMesh,
    bucket_bytes: int = BUCKET_BYTES,
    device: torch.device | None = None,
    traced: dict | None = None,
    reduce_early: bool = False,
    attention: tuple[torch.device, bool] | None = None,
    codeless: bool = False,
    fsdp: GatherPlan | None = None,
    config: str = "",
) -> fx.GraphModule:
    """Build this rank's program: local shards in, (loss, *local grads) out, collectives as nodes.

    With a StageOutputPlan: (outputs of the stage graph...) out, sent values in their neighbours'
    layouts and nothing reduced over the data-parallel axis. `device`: where the program runs; the
    LogicGraph's factory ops (masks, positions, zeros) were traced on the model's device and are
    placed there instead. `local_inputs`: examples of this rank's inputs (only their shapes, strides,
    dtypes and device are read). `traced`: a dict the caller owns (one per config, say) that keeps
    the redistributions traced here for its later programs. The collectives wait where their result
    is read (`wait_where_read`) and, with `reduce_early`, the gradient buckets are reduced behind the
    backward (`issue_reductions_early`): both edit the graph before its GraphModule writes the code, once.
    `attention`: (the device the program runs on, for Inductor?): its attention is written as torch's
    fused kernels there (`attention.fuse_attention`), not at run time on a copy of the program.
    `codeless`: the program's code is written when it is first run (a program read as a graph only).
    `fsdp`: parameters whose placeholders hold fsdp shards (`compiler.fsdp`): a unit's are all-gathered
    into the placements they compute in before its first use in each phase, the next unit's
    gather issued behind it (`fsdp.prefetch_gathers`).
    `config`: the config's name, which a node that fails to lower names (`sharding.unshardable`).
    """
    decisions = sharding.decisions
    on_device = placed_on(device)
    finish = output_finisher(graph, sharding, out_plan, mesh, bucket_bytes)
    program = _ProgramBuilder(local_inputs[0].device if local_inputs else device or torch.device("cpu"), traced)
    env: dict[fx.Node, Any] = {}
    moved: dict[tuple, fx.Node] = {}  # (value, placements): one all-gather of a tensor serves all its consumers
    read = _fsdp_reader(graph, program, env, fsdp, mesh) if fsdp is not None else (lambda src, node: env[src])
    inputs = iter(local_inputs)
    for node in graph.nodes:
        try:
            if node.op == "placeholder":
                env[node] = program.placeholder(next(inputs))
                continue
            if node.op == "output":
                leaves = [env[a] for a in pytree.tree_leaves(node.args[0])]
                if isinstance(out_plan, OutputPlan) and OnProgram.takes(leaves):
                    result = finish_outputs(leaves, sharding.output_specs, out_plan, mesh, bucket_bytes,
                                            OnProgram(program, node))
                else:
                    # what the end depends on: the outputs' local and global layouts (a gradient's are its
                    # parameter's), not the sequence length: traced once per config, reused at other lengths
                    key = ("finish", id(mesh), out_plan, tuple(sharding.output_specs), bucket_bytes, device,
                           tuple(_layout(v.meta["val"]) if isinstance(v, fx.Node) else ("const", repr(v))
                                 for v in leaves))
                    result = program.inline(key, lambda *values: finish(list(values)), leaves, node)
                program.output(result)
                add_hand_offs(program.graph, sharding.output_specs, out_plan, bucket_bytes)
                break
            d = decisions[node]
            if d.kind == "drop":
                continue
            if d.kind == "const":
                env[node] = d.value
            elif d.kind == "getitem":
                env[node] = program.getitem(env[node.args[0]], node.args[1], node.args[0])  # a part of its op
            elif _has_mask_partial(d):
                # a vocab-parallel _MaskPartial carries the mask its input redistribution computes to the
                # reduction of the op's output: the three are traced together
                inputs = [read(n, node) for n in d.tensor_nodes]
                try:
                    out = tuple(d.out_spec) if isinstance(d.out_spec, (tuple, list)) else d.out_spec
                    key = ("decision", id(mesh), node.target, tuple(d.in_specs), tuple(d.want_specs), out,
                           d.reduce_to, _signature(d.args), _signature(d.kwargs),
                           tuple(_layout(v.meta["val"]) for v in inputs), device)
                    hash(key)
                except TypeError:  # an argument that cannot be a key: traced every time
                    key = None
                env[node] = program.inline(key, _run_decision(node, d, on_device), inputs, node)
            else:
                tensors = []
                for src, have, want in zip(d.tensor_nodes, d.in_specs, d.want_specs):
                    value = read(src, node)
                    if have.placements != want.placements:
                        key = (src, want.placements)
                        if key not in moved:
                            moved[key] = _filled_piece(program, value, have, want, node) \
                                or program.redistribute(value, have, want, node)
                        value = moved[key]
                    tensors.append(value)
                it = iter(tensors)
                fill = lambda a: next(it) if isinstance(a, dt.DTensorSpec) else a  # noqa: E731
                out = program.call(node.target, map_args(fill, d.args),
                                   on_device(map_args(fill, dict(d.kwargs))), node)
                if d.reduce_to is not None:
                    out = program.redistribute(out, d.out_spec, d.reduce_to, node)
                env[node] = out
        except ShardingError:
            raise
        except Exception as e:  # a redistribution, or the op on local shapes: said with the node it ran for
            raise _not_lowered(node, decisions.get(node), e, config) from e
    if attention is not None:
        _attention.fuse_attention(program.graph, *attention, keep_meta=SOURCE_META)
    if reduce_early:
        issue_reductions_early(program.graph)
        hand_off_early(program.graph)
    wait_where_read(program.graph)
    if fsdp is not None:
        prefetch_gathers(program.graph)
    return program.module(codeless)

def _not_lowered(node: fx.Node, d: Decision | None, error: Exception, config: str) -> ShardingError:
    """A node whose decision failed to execute on this rank's shards (a redistribution, or the op on
    local shapes): our failure, not the model's, said with the node, its placements and the way on."""
    first_line = str(error).splitlines()[0][:200] if str(error) else ""
    problem = f"lowering it failed ({type(error).__name__}: {first_line})"
    if d is None or d.kind != "op":
        return unshardable(config, node, problem, [], "Leave that config out of the configs, and report this.")
    want = [tuple(s.placements) for s in d.want_specs]
    out = d.reduce_to if d.reduce_to is not None else d.out_spec
    out = tuple(out.placements) if isinstance(out, dt.DTensorSpec) else out
    return unshardable(config, node, problem, [tuple(s.placements) for s in d.in_specs],
                       f"The op was to run with its inputs as {want}, giving {out}. Leave "
                       f"{config or 'this config'!r} out of the configs to go on, and report this.")


# tensor-free factories of one value everywhere (their first argument the size): any piece of what
# they make is made by the same call at the piece's size
_FILLED = (aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format)


def makes_piece(target, have, want) -> bool:
    """Is this rank's piece (`want`) of a value made by `target` in `have` made by `target` itself at
    the piece's size? For a replicated fresh tensor of one value (the zeros an NLL loss's backward
    scatters into), where slicing it would make the whole tensor first: under dp8 eight times a
    [tokens x vocabulary] gradient on every rank."""
    return target in _FILLED and all(p.is_replicate() for p in have.placements) \
        and not any(p.is_partial() for p in want.placements)


def _filled_piece(program: _ProgramBuilder, value: fx.Node, have, want, source: fx.Node) -> fx.Node | None:
    """`makes_piece`'s call, or None."""
    if not makes_piece(value.target, have, want):
        return None
    return program.call(value.target, (list(dt.local_shape(want)), *value.args[1:]), dict(value.kwargs), source)


def _fsdp_reader(graph: fx.Graph, program: _ProgramBuilder, env: dict, plan: GatherPlan, mesh):
    """`read(src, node)`: the value `node` reads for its input `src`; an fsdp parameter's is its unit's
    gather of `node`'s phase, emitted when first read there (every node of it tagged "fsdp")."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    members = plan.unit_members()
    unit_of = {placeholders[index]: unit for index, unit, _, _ in plan.params}
    gathered: dict[tuple[fx.Node, str], fx.Node] = {}

    def read(src: fx.Node, node: fx.Node):
        unit = unit_of.get(src)
        if unit is None:
            return env[src]
        phase = node.meta.get("custom", {}).get("phase")
        if (src, phase) not in gathered:
            indices, storage, compute = zip(*members[unit])
            last = next(reversed(program.graph.nodes))
            key = ("fsdp gather", id(mesh), storage, compute)
            outs = program.inline(key, gather_unit(storage, compute, plan.dp_dim),
                                  [env[placeholders[i]] for i in indices], node)
            for n in _nodes_after(program.graph, last):
                n.meta["custom"] = {**n.meta.get("custom", {}), "fsdp": "gather", "unit": unit}
            for i, out in zip(indices, outs):
                gathered[(placeholders[i], phase)] = out
        return gathered[(src, phase)]

    return read


def _nodes_after(graph: fx.Graph, last: fx.Node) -> list[fx.Node]:
    """The nodes appended to `graph` after `last`."""
    out = []
    for n in reversed(graph.nodes):
        if n is last:
            break
        out.append(n)
    return out[::-1]

def add_hand_offs(graph: fx.Graph, specs: list, plan: OutputPlan | StageOutputPlan, bucket_bytes: int) -> None:
    """Before the output of a training program that reduces its gradients (an OutputPlan with
    parameters; graph outputs (loss, *grads)), one `handoff.gradients_final` call per group of
    gradients final together: per reduction bucket of the end (`gradient_buckets`, on the unfinished
    outputs' `specs`), then those no bucket reduces. `hand_off_early` moves them up."""
    if not isinstance(plan, OutputPlan) or not plan.param_specs:
        return
    metas = [torch.empty(dt.local_shape(s), dtype=s.tensor_meta.dtype, device="meta") for s in specs]
    scattered = scattered_units(specs, plan)
    skip = frozenset(i for unit in scattered for i in unit)
    groups = [tuple(i - plan.num_losses for i in bucket if i >= plan.num_losses)
              for buckets in gradient_buckets(metas, specs, plan.num_losses, bucket_bytes, skip).values()
              for bucket in buckets]
    groups += [tuple(i - plan.num_losses for i in unit) for unit in scattered]
    groups = [g for g in groups if g]
    bucketed = {k for g in groups for k in g}
    rest = tuple(k for k in range(len(plan.param_specs)) if k not in bucketed)
    out = next(n for n in graph.nodes if n.op == "output")
    grads = pytree.tree_leaves(out.args[0])[1:]
    for indices in groups + ([rest] if rest else []):
        with graph.inserting_before(out):
            hook = graph.call_function(handoff.gradients_final, (indices, *[grads[k] for k in indices]))
        hook.meta = {k: out.meta[k] for k in SOURCE_META if k in out.meta}
        hook.meta["custom"] = {**hook.meta.get("custom", {}), "phase": "reduce"}

def placed_on(device: torch.device | None):
    """kwargs -> kwargs with a factory op's `device` replaced by `device` (None: left as traced)."""
    if device is None:
        return lambda kwargs: kwargs
    return lambda kwargs: {**kwargs, "device": device} if "device" in kwargs else kwargs

def _has_mask_partial(d: Decision) -> bool:
    specs = [*d.in_specs, *d.want_specs, d.reduce_to,
             *(d.out_spec if isinstance(d.out_spec, (tuple, list)) else (d.out_spec,))]
    return any(isinstance(p, dt.MaskPartial) for s in specs if isinstance(s, dt.DTensorSpec) for p in s.placements)

def _run_decision(node: fx.Node, d: Decision, on_device):
    """`d` executed on local tensors (the ones of `d.tensor_nodes`, in order): its input
    redistributions, the op, its output's reduction."""
    def run(*values):
        tensors = [dt.redistribute(v, have, want) if have.placements != want.placements else v
                   for v, have, want in zip(values, d.in_specs, d.want_specs)]
        it = iter(tensors)
        fill = lambda a: next(it) if isinstance(a, dt.DTensorSpec) else a  # noqa: E731
        out = node.target(*map_args(fill, d.args), **on_device(map_args(fill, dict(d.kwargs))))
        return dt.redistribute(out, d.out_spec, d.reduce_to) if d.reduce_to is not None else out
    return run

# what a node of the program keeps of the LogicGraph node it comes from (what make_fx's
# `preserve_node_meta` copies): its phase, source line and module path
SOURCE_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn", "custom")

class _ProgramBuilder:
    """One rank's ExecGraph, emitted node by node.

    A LogicGraph op becomes one node calling the same op on local values; its `meta["val"]` (the
    local shape, strides and dtype) comes from running the op's meta kernel on meta tensors, tens of
    microseconds, where tracing it through make_fx's proxy and fake-tensor modes took 2-3 ms. Only what
    DTensor executes for us (redistributions, the bucketed reduction at the end) is traced by make_fx,
    each distinct one once per program, and its nodes are copied in. Every `meta["val"]` is a tensor
    on the meta device."""

    def __init__(self, device: torch.device, traced: dict | None = None):
        self.graph = fx.Graph()
        self.device = device  # where the examples for make_fx are made (DTensor reads their device)
        self.attrs: dict[str, torch.Tensor] = {}
        self.traced: dict[Any, tuple] = {} if traced is None else traced
        self.placeholders = 0

    def placeholder(self, example: torch.Tensor) -> fx.Node:
        node = self.graph.placeholder(f"arg{self.placeholders}_1")
        self.placeholders += 1
        node.meta["val"] = meta_like(example)
        return node

    def call(self, target, args, kwargs, source: fx.Node) -> fx.Node:
        val = lambda a: a.meta["val"] if isinstance(a, fx.Node) else a  # noqa: E731
        out = meta_run(target, map_args(val, args), map_args(val, kwargs), self.device)
        node = add_node(self.graph, "call_function", target, tuple(args), dict(kwargs))
        return self._annotate(node, out, source)

    def emit(self, target, args: tuple, val: torch.Tensor, source: fx.Node) -> fx.Node:
        """A node whose value the caller knows (a collective's: its input's shape)."""
        return self._annotate(add_node(self.graph, "call_function", target, args), val, source)

    def getitem(self, value: fx.Node, index: int, source: fx.Node) -> fx.Node:
        node = add_node(self.graph, "call_function", operator.getitem, (value, index))
        return self._annotate(node, value.meta["val"][index], source)

    def redistribute(self, value: fx.Node, have, want, source: fx.Node) -> fx.Node:
        # by the mesh's identity: meshes alike in shape may have other process groups (a new generation)
        key = ("redistribute", id(have.mesh), have, want, _layout(value.meta["val"]), self.device)
        return self.inline(key, lambda t: dt.redistribute(t, have, want), [value], source)

    def inline(self, key, fn, inputs: list, source: fx.Node):
        """`fn(*inputs)` traced by make_fx (once per `key`; None: every time) and copied in; its result
        with nodes of this program in place of the traced ones. Non-tensor inputs are passed as they are."""
        tensors = [a for a in inputs if isinstance(a, fx.Node)]

        def on_tensors(*values):
            it = iter(values)
            return fn(*[next(it) if isinstance(a, fx.Node) else a for a in inputs])

        sub = self.traced[key][0] if key in self.traced else None
        if sub is None:
            examples = [_example(n.meta["val"], self.device) for n in tensors]
            with warnings.catch_warnings(), codeless_modules():  # its nodes are copied; its code is never read
                warnings.simplefilter("ignore")
                sub = make_fx(on_tensors, tracing_mode="fake")(*examples)
            if key is not None:
                self.traced[key] = (sub, fn)  # fn keeps what the key names by identity (the mesh) alive
        env: dict[fx.Node, Any] = {}
        placeholders = iter(tensors)
        result = None
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(placeholders)
            elif n.op == "output":
                result = fx.node.map_arg(n.args[0], lambda a: env[a])
            elif n.op == "get_attr":
                name = f"_constant{len(self.attrs)}"
                self.attrs[name] = getattr(sub, n.target)
                env[n] = self._annotate(self.graph.get_attr(name), n.meta.get("val"), source)
            else:
                env[n] = self._annotate(copy_node(self.graph, n, env.__getitem__), n.meta.get("val"), source)
        return result

    def output(self, result) -> None:
        self.graph.output(result)

    def module(self, codeless: bool = False) -> fx.GraphModule:
        """The program as a GraphModule, its code generated once (`codeless`: when first run, if ever)."""
        root = torch.nn.Module()
        for name, value in self.attrs.items():
            setattr(root, name, value)
        _drop_dead_nodes(self.graph)
        return codeless_module(root, self.graph) if codeless else graph_module(root, self.graph)

    @staticmethod
    def _annotate(node: fx.Node, val, source: fx.Node) -> fx.Node:
        meta = node.meta  # edited in place: assigning a node's attribute runs fx's lookups
        meta.clear()
        meta.update((k, source.meta[k]) for k in SOURCE_META if k in source.meta)
        if val is not None:
            node.meta["val"] = meta_like(val)
        return node

def _drop_dead_nodes(graph: fx.Graph) -> None:
    """`graph.eliminate_dead_code()` for a graph built in order: a node is asked whether it has side
    effects only when nothing reads it (fx asks every node, after linting the whole graph: at 8
    layers a sixth of writing a program's code)."""
    for node in reversed(graph.nodes):
        if not node.users and not node.is_impure():
            graph.erase_node(node)

def _layout(value) -> tuple:
    """What a traced redistribution or end of a program reads of a local value: shape, strides, dtype."""
    if isinstance(value, (tuple, list)):
        return tuple(_layout(v) for v in value)
    return tuple(value.shape), value.stride(), value.dtype

def _example(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor like `meta` on `device` for make_fx to trace with (DTensor's uneven
    _StridedShard gather builds index tensors from real values; faked inputs would make them
    data-dependent)."""
    return torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device=device)

def collectives(gm: fx.GraphModule, phase: str | None = None) -> list[fx.Node]:
    """The collective nodes of an ExecGraph (waits excluded), optionally of one phase."""
    return [n for n in gm.graph.nodes if _is_collective(n)
            and (phase is None or n.meta.get("custom", {}).get("phase") == phase)]

_REDUCTIONS = ("all_reduce", "reduce_scatter")  # a gradient bucket's, an fsdp unit's


def issue_reductions_early(graph: fx.Graph) -> int:
    """DDP's overlap, in the graph: each gradient bucket's all-reduce, with the concatenation and
    views that pack it, moves to right after the last value it carries is computed. It then runs
    on the process group's side (gloo's thread, NCCL's stream) while the backward goes on; its wait
    stays where the result is first read, at the end. Returns how many all-reduces moved. Ranks of
    a group run alike graphs, so they still issue their collectives in one order. Edits `graph` (a
    GraphModule owning it writes its code again on `recompile()`)."""
    moved = 0
    for node in [n for n in graph.nodes if _is_reduce_phase(n) and _is_collective(n)
                 and collective_kind(n) in _REDUCTIONS]:
        chain, stack = set(), [node]
        while stack:  # the node and the packing ops feeding it (never a wait: that would block early)
            n = stack.pop()
            if n in chain:
                continue
            chain.add(n)
            stack += [a for a in n.all_input_nodes if a.op == "call_function" and _is_reduce_phase(a)
                      and not _is_collective(a) and not _is_wait(a)]
        position = {n: i for i, n in enumerate(graph.nodes)}
        anchor = max((a for c in chain for a in c.all_input_nodes if a not in chain), key=position.__getitem__)
        moved += _follow(anchor, sorted(chain, key=position.__getitem__), position)
    return moved

def wait_where_read(graph: fx.Graph) -> int:
    """Each collective's wait moves down to right before the first op that reads its result: a
    traced redistribution waits at once, so nothing ran while the collective was in flight. Now what
    does not need the result (a weight's gradient while its input's gradient is all-reduced, as
    Megatron overlaps them) runs before the wait. Issue order is untouched. Returns how many moved.
    Edits `graph`, as `issue_reductions_early` does."""
    moved = 0
    position = {n: i for i, n in enumerate(graph.nodes)}
    for node in [n for n in graph.nodes if _is_wait(n)]:
        if not node.users:
            continue
        first = min(node.users, key=position.__getitem__)
        if position[first] > position[node] + 1:
            first.prepend(node)
            moved += 1
    return moved

def hand_off_early(graph: fx.Graph) -> int:
    """Each gradient bucket's hand-off call (`compiler.handoff`), with the reduce-phase ops it reads
    (the bucket's wait, split and views, the division by the loss denominator), moves up to right
    after the next bucket's all-reduce is issued: the bucket's reduction still overlaps the backward
    until then, and its gradients can leave while the rest of the backward runs. Collectives are
    never moved, so every rank issues them in the same order as before. Returns how many calls
    moved. Edits `graph`, as `issue_reductions_early` does."""
    moved = 0
    # bucket reductions, in issue order (collectives never move here, so neither does that order)
    issues = [n for n in graph.nodes
              if _is_reduce_phase(n) and _is_collective(n) and collective_kind(n) in _REDUCTIONS]
    for hook in [n for n in graph.nodes if handoff.is_hand_off(n)]:
        position = {n: i for i, n in enumerate(graph.nodes)}
        candidates, stack = set(), [hook]
        while stack:  # the hook and the reduce-phase ops it reads, up to the collectives
            n = stack.pop()
            if n in candidates:
                continue
            candidates.add(n)
            stack += [a for a in n.all_input_nodes if a.op == "call_function" and _is_reduce_phase(a)
                      and not _is_collective(a)]
        outside = [a for c in candidates for a in c.all_input_nodes if a not in candidates]
        anchor = max(outside, key=position.__getitem__, default=None)
        if anchor is None:
            continue
        # behind the next bucket's issue, if one comes before the hook
        later = [n for n in issues if position[anchor] < position[n] < position[hook]]
        if later:
            anchor = later[0]
        chain = sorted((c for c in candidates if position[c] > position[anchor]), key=position.__getitem__)
        moved += _follow(anchor, chain, position)
    return moved

def _follow(anchor: fx.Node, chain: list[fx.Node], position: dict[fx.Node, int]) -> int:
    """Move `chain` (in graph order) to right after `anchor`; 1 if anything moved, 0 if it already
    stood there (or is empty). `position`: each node's index before the move."""
    if not chain or position[chain[0]] == position[anchor] + 1 and all(
            position[b] == position[a] + 1 for a, b in zip(chain, chain[1:])):
        return 0
    for c in chain:
        anchor.append(c)
        anchor = c
    return 1

def _is_reduce_phase(node: fx.Node) -> bool:
    return node.meta.get("custom", {}).get("phase") == "reduce"

def _is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and str(node.target).startswith("_c10d_functional.") and not _is_wait(node)

def _is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and str(node.target).startswith("_c10d_functional.wait_tensor")

def collective_kind(node: fx.Node) -> str:
    """'all_reduce', 'all_gather', 'reduce_scatter', 'all_to_all', ... of a collective node."""
    op = str(node.target).split(".")[1]  # "_c10d_functional.all_reduce.default" -> "all_reduce"
    return op.removesuffix("_into_tensor").removesuffix("_tensor").removesuffix("_single")

def count_collectives(gm: fx.GraphModule, phase: str | None = None) -> Counter:
    """Collective nodes of an ExecGraph by kind (`collective_kind`)."""
    return Counter(collective_kind(node) for node in collectives(gm, phase))

