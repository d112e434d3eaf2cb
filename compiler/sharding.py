"""What sharding propagation decides, as values: per op the placements its inputs need and its
output gets (`Decision`, `GraphSharding` for one graph and shape), and the shape-free record of
them that later shapes replay (`ShardingDecisions`); with the questions asked of a decided graph
(does a rank's program read its coordinate, does it mix rows across dp ranks).

The plan half of lowering: `compiler.propagate` makes these, `compiler.lower` executes them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from . import _dtensor as dt
from .tp_rules import VIEW_OPS
from .uniform import uniform_dims

aten = torch.ops.aten


_LIKE_OPS = {aten.ones_like.default, aten.zeros_like.default, aten.full_like.default, aten.empty_like.default}

# Ops whose result depends on no input value: their placement is free (a local chunk of a fresh tensor).
_FRESH_OPS = _LIKE_OPS | {aten.new_zeros.default, aten.new_empty.default, aten.new_full.default,
                          aten.new_ones.default, aten.zeros.default, aten.full.default, aten.empty.memory_format,
                          aten.ones.default, aten.scalar_tensor.default}

class ShardingError(ValueError):
    """An op a config cannot run as its inputs are sharded (DTensor has no strategy for them), or
    could not execute as decided; the message (`unshardable`) names the config, the graph node, its
    module and source line, its inputs' placements and what to do."""


def unshardable(config: str, node: fx.Node, problem: str, placements: list, fix: str) -> ShardingError:
    """The one wording of an op a config cannot run: which config, which op of which module and
    line, what went wrong, its inputs' placements (one tuple per input, a placement per mesh dim),
    and `fix`, what to do."""
    return ShardingError(
        f"{config or 'this config'!r} cannot run graph node {node.name!r} ({node.target}) in {module_of(node)}, "
        f"from {source_line(node)}: {problem}; input placements: {placements}. {fix}")


def module_of(node: fx.Node) -> str:
    """The module a node was traced in, as `path (Class)` (the innermost of its `nn_module_stack`)."""
    path, kind = list((node.meta.get("nn_module_stack") or {"": ("", None)}).values())[-1]
    if not path:  # the root: the tracer's wrapper of the model (`signature.LossModule`)
        return "the model's own forward"
    name = getattr(kind, "__name__", None) or str(kind).rsplit(".", 1)[-1]
    return f"{path} ({name})"

def source_line(node: fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    # the user's frame is the last "File ..." line not inside torch
    frames = [
        (lines[i], lines[i + 1] if i + 1 < len(lines) else "") for i, ln in enumerate(lines) if ln.startswith("File ")
    ]
    frames = [f for f in frames if "/torch/" not in f[0]] or frames
    return f"{frames[-1][0]}: {frames[-1][1]}" if frames else "(no source line recorded)"

@dataclass
class Decision:
    kind: str  # "const" | "drop" | "getitem" | "op" | "placeholder"
    value: Any = None
    tensor_nodes: list = field(default_factory=list)
    in_specs: list = field(default_factory=list)
    want_specs: list = field(default_factory=list)
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    out_spec: Any = None  # spec (or tuple of specs) the op produces
    reduce_to: Any = None  # spec after the eager Partial reduction, if any
    # chosen by DTensor's strategy search with the op's own arguments: its placements alone say what
    # to do at another input shape (`ShardingDecisions`), no search needed
    replayable: bool = False
    encoded: Any = field(default=..., repr=False, compare=False)  # `_encoded(self)`, once known (...: not yet)

    @property
    def spec(self):
        return self.reduce_to if self.reduce_to is not None else self.out_spec

def _is_tensor_node(a) -> bool:
    return isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)

def _has_partial(spec) -> bool:
    return isinstance(spec, dt.DTensorSpec) and any(p.is_partial() for p in spec.placements)

def _view_source(node: fx.Node) -> fx.Node:
    while isinstance(node, fx.Node) and node.target in VIEW_OPS:
        node = node.args[0]
    return node

@dataclass
class GraphSharding:
    decisions: dict[fx.Node, Decision]
    output_specs: list
    keep_partial: frozenset = frozenset()  # nodes whose Partial values stay unreduced
    replayed: int = 0  # decisions taken from `ShardingDecisions` instead of DTensor's search
    searched: tuple[str, ...] = ()  # nodes DTensor's strategy search decided (their decisions are replayable)

    def placements(self) -> ShardingDecisions:
        """What was decided, without shapes: per searched op, the placements it wants its tensor
        inputs in and the placements it produces."""
        ops = {node.name: _encoded(d) for node, d in self.decisions.items() if d.kind == "op" and d.replayable}
        ops = {k: v for k, v in ops.items() if v is not None}
        return ShardingDecisions(ops, frozenset(n.name for n in self.keep_partial),
                                 ones={node.name: singletons(d.in_specs, d.out_spec)
                                       for node, d in self.decisions.items() if node.name in ops})


def singletons(in_specs, out_spec) -> tuple:
    """The dims of size 1 of each input spec and of the output spec(s): what a decision's replay at
    another shape must find the same (`ShardingDecisions.ones`)."""
    def ones(spec):
        return None if spec is None else tuple(i for i, size in enumerate(spec.shape) if size == 1)

    outs = tuple(ones(o) for o in out_spec) if isinstance(out_spec, (tuple, list)) else ones(out_spec)
    return tuple(ones(s) for s in in_specs), outs

def _encoded(d: Decision) -> tuple | None:
    """A replayable decision's placements as plain values (`ShardingDecisions.ops`), or None when
    they hold a _StridedShard that is not written relative to an input (`_relative_strided`)."""
    if d.encoded is not ...:
        return d.encoded
    # one output: its placements (a tuple); several: a list of those (None: not a tensor)
    out = [None if o is None else o.placements for o in d.out_spec] \
        if isinstance(d.out_spec, (tuple, list)) else d.out_spec.placements
    encoded = dt.encode_placements((tuple(w.placements for w in d.want_specs), out))
    d.encoded = _relative_strided(d) if _mentions(encoded, ("SS",)) else encoded
    return d.encoded

def reads_coordinate(sharding: GraphSharding, graph: fx.Graph, mesh_dim: int, extra: tuple = ()) -> bool:
    """Could this rank's program for `sharding` depend on its coordinate on mesh dim `mesh_dim`?

    Lowering reads a rank's coordinate only to take its own piece of a value: a redistribution into
    a Shard (or _StridedShard) on that dim (which chunk, and with uneven shards its size), a
    vocab-parallel _MaskPartial there (its index offset), and seeded random ops (DTensor's RNG
    offsets). Three such pieces are the same on every rank: an even piece of a fresh tensor (zeros,
    full: every chunk holds the same values), an even piece of a whole value along a dim whose
    slices are all equal (`uniform.uniform_dims`: HF Llama's attention mask, cut into each dp rank's
    rows), and an even reduce-scatter (the collective picks the chunk). Without any other, ranks
    that differ only on `mesh_dim` and have the same local shapes lower the same program, so one of
    them lowers it for all (data parallelism's ranks, whose batch pieces are their own inputs).
    `extra`: (have, want) spec pairs the output plan redistributes."""
    uniform = uniform_dims(graph)

    def reads(have, want, source=None) -> bool:
        if not isinstance(have, dt.DTensorSpec) or not isinstance(want, dt.DTensorSpec):
            return False
        a, b = have.placements[mesh_dim], want.placements[mesh_dim]
        if isinstance(a, dt.MaskPartial) or isinstance(b, dt.MaskPartial):
            return True
        if a == b or not isinstance(b, (dt.Shard, dt.StridedShard)):
            return False
        even = isinstance(b, dt.Shard) and want.shape[b.dim] % want.mesh.size(mesh_dim) == 0
        same_pieces = source is not None and (
            _is_fresh(source) or (a.is_replicate() and b.dim in uniform.get(source, ())))
        return not (even and (a.is_partial() or same_pieces))

    if any(n.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())
           for n in graph.nodes):
        return True
    for d in sharding.decisions.values():
        if d.kind != "op":
            continue
        if any(reads(h, w, n) for n, h, w in zip(d.tensor_nodes, d.in_specs, d.want_specs)):
            return True
        if reads(d.out_spec, d.reduce_to) or any(
                reads(o, o) for o in (d.out_spec if isinstance(d.out_spec, (tuple, list)) else (d.out_spec,))):
            return True
    return any(reads(h, w) for h, w in extra)

def mixes_rows(sharding: GraphSharding, mesh_dim: int) -> tuple[str, ...]:
    """Source lines of the ops whose values combine rows of different ranks along mesh dim
    `mesh_dim` (data parallelism's) other than by summing: a batch-sharded value gathered there
    (Shard -> Replicate or another Shard), or a value pending an average over it (a batch mean).

    Each rank lowers its program with the batch it holds times dp as the global batch, so those ops
    are exact only when every dp rank holds the same number of rows. Summing (gradients, the loss's
    numerator and count) is exact for any split."""
    def gathers(have, want) -> bool:
        if not isinstance(have, dt.DTensorSpec) or not isinstance(want, dt.DTensorSpec):
            return False
        a, b = have.placements[mesh_dim], want.placements[mesh_dim]
        return a.is_shard() and a != b

    def averages(spec) -> bool:
        specs = spec if isinstance(spec, (tuple, list)) else (spec,)
        return any(isinstance(s, dt.DTensorSpec) and s.placements[mesh_dim].is_partial()
                   and getattr(s.placements[mesh_dim], "reduce_op", "sum") != "sum" for s in specs)

    lines = []
    for node, d in sharding.decisions.items():
        if d.kind == "op" and (any(gathers(h, w) for h, w in zip(d.in_specs, d.want_specs))
                               or averages(d.out_spec) or gathers(d.out_spec, d.reduce_to)):
            lines.append(f"{node.name} ({node.target}) from {source_line(node)}")
    return tuple(lines)

def _mentions(encoded, kinds: tuple[str, ...]) -> bool:
    """Does an encoded decision hold a placement of one of `kinds` ("SS", "SSin", ...)? A placement
    (or marker) is a tuple led by its kind's name; anything else nested is walked, without recursion
    (this runs for every op of every lowering)."""
    stack = [encoded]
    while stack:
        e = stack.pop()
        if (type(e) is tuple or type(e) is list) and e:  # encoded: plain tuples and lists only
            if type(e[0]) is str:
                if e[0] in kinds:
                    return True
            else:
                stack.extend(e)
    return False

def _same_strided(p, q) -> bool:
    return isinstance(p, dt.StridedShard) and isinstance(q, dt.StridedShard) and (p.dim, p.split_factor) == (
        q.dim, q.split_factor)

def _relative_strided(d: Decision):
    """A _StridedShard's split factor is the product of the dims folded in front of the sharded one
    (the batch, when [B, H, T, d] is viewed as [B*H, T, d]): a shape, so it is not written down.
    What is: an input kept in the _StridedShard it arrives in ("SSin", k), and an output strided like
    input k on a dim of the same size ("SSof", k), as a batched matmul or an element-wise op on the
    flattened heads gives. Anything else involving one (None) is searched again at every shape."""
    if isinstance(d.out_spec, (tuple, list)):
        return None
    want = []
    for k, (have, w) in enumerate(zip(d.in_specs, d.want_specs)):
        row = []
        for i, p in enumerate(w.placements):
            if isinstance(p, dt.StridedShard):
                if not _same_strided(p, have.placements[i]):
                    return None
                row.append(("SSin", k))
            else:
                row.append(dt.encode_placements(p))
        want.append(tuple(row))
    out = []
    for i, p in enumerate(d.out_spec.placements):
        if isinstance(p, dt.StridedShard):
            k = next((k for k, w in enumerate(d.want_specs) if _same_strided(p, w.placements[i])
                      and w.shape[p.dim] == d.out_spec.shape[p.dim]), None)
            if k is None:
                return None
            out.append(("SSof", k))
        else:
            out.append(dt.encode_placements(p))
    return (tuple(want), tuple(out))

def _absolute_strided(placements, in_specs: list):
    """`_relative_strided`'s markers resolved against the specs the inputs arrive in now: the
    placements to replay and the (output dim, input index) pairs whose sizes must still agree; None
    when an input no longer arrives strided."""
    want_rel, out_rel = placements
    if not _mentions(placements, ("SSin", "SSof")):
        return placements, ()
    want = []
    for k, row in enumerate(want_rel):
        resolved = []
        for i, e in enumerate(row):
            if isinstance(e, tuple) and e and e[0] == "SSin":
                p = in_specs[k].placements[i]
                if not isinstance(p, dt.StridedShard):
                    return None
                e = dt.encode_placements(p)
            resolved.append(e)
        want.append(tuple(resolved))
    out, checks = [], []
    for i, e in enumerate(out_rel):
        if isinstance(e, tuple) and e and e[0] == "SSof":
            k = e[1]
            e = want[k][i]
            checks.append((e[1], k))
        out.append(e)
    return (tuple(want), tuple(out)), tuple(checks)

@dataclass(frozen=True)
class ShardingDecisions:
    """A config's sharding decisions for one graph, apart from shapes: node name -> (placements of
    its tensor inputs, placements of its output). The graph is symbolic in batch and sequence, and
    these placements do not depend on them, so lowering the graph for another input shape replays
    them (a fake run per op for the new global shapes) instead of running DTensor's strategy search
    again. A view whose size DTensor rewrote into its output's local shape gets that local shape at
    the new size (`tp_rules.SIZED_VIEW_OPS`); other ops whose arguments DTensor rewrites for its choice, and ops
    with a _StridedShard (whose split factor is a shape), are propagated anew. Plain
    values: picklable, kept per config in memory and in the persistent cache (`hotswitch.compiler.cache`).

    `dp_shared`: whether the program the search lowered read no dp coordinate (`reads_coordinate`),
    so that its dp ranks shared it; a rank given these decisions expects the same and waits for the
    shared program instead of replaying them first (None: not known, or no dp)."""

    ops: dict[str, tuple]
    keep_partial: frozenset[str]
    dp_shared: bool | None = None
    # node name -> the dims of size 1 of its tensor inputs and output(s) where it was decided: DTensor
    # treats a size-1 dim apart (flattening [1, s] sharded on s is Shard, [4, s] a _StridedShard), so
    # a decision is replayed only where the same dims are 1 (`singletons`)
    ones: dict[str, tuple] = field(default_factory=dict)

def _is_fresh(node: fx.Node) -> bool:
    node = _view_source(node)
    return isinstance(node, fx.Node) and node.target in _FRESH_OPS

