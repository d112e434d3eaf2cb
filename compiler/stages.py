"""Pipeline stages: cutting a LogicGraph into `pp` stage graphs, and each stage's joint graph.

**Where to cut.** A transformer is a stack of repeated blocks (the children of an `nn.ModuleList`:
`layers.0`, `layers.1`, ...), and between two blocks only the residual stream is live. So stages are
contiguous runs of blocks, read off `node.meta["nn_module_stack"]` of the forward graph (the first
module-path component that is a list index names a node's block). Parameter-dependent nodes outside
every block go to the first stage if they come before the first block (embeddings) and to the last
stage otherwise (final norm, LM head, loss). A topological cut with an arbitrary cost would also
work, but block boundaries are where the live set is smallest, and they are what Megatron, torchtitan
and the cluster model (`hotswitch.switch.cluster.split_stages`) cut at.

**Balance.** Each block costs its share of the forward FLOPs (at the example shapes, from
`torch.utils.flop_counter`'s formulas) plus its share of the parameters, equally weighted: FLOPs set a
stage's time, parameters its memory (weights, gradients and optimizer state). The embedding is counted
in the first block's stage and the head and loss in the last one's. The split minimises the largest
stage, and among the splits that reach it takes the most even one (least sum of squares), as
`hotswitch.cluster.split_stages` does.

**What crosses a boundary.** Only values computed from parameters: they are sent point to point
(a value produced in stage 0 and used in stage 2 passes through stage 1). Everything that depends on
no parameter - position ids, RoPE tables, masks, label counts, sizes - is recomputed by every stage
that needs it from the model inputs, which every rank of a pipeline has (the caller gives each rank
its data-parallel shard of the batch). So each stage graph takes (its params, all buffers, all model
inputs, activations in) and returns (activations out, loss denominator), the last stage (num, den).

**Shared parameters.** A parameter used in several stages (GPT-2's LM head tied to the token
embedding) gets a copy in each of them, as Megatron-LM keeps the word embeddings in the first and the
last stage: each stage's graph computes its part of the gradient, and the runtime sums the copies'
gradients after the step's reduction, so the copies stay equal under any elementwise optimizer.

**Joint graphs per stage.** A stage's joint graph is traced like the LogicGraph's (make_fx of an
interpreter over the stage's forward with autograd, core ATen, functionalized, CSE'd), with the
upstream gradients of the activations it sends as extra inputs, and returns
(forward outputs..., grad per stage parameter..., grad per activation in...). It is traced with the
forward graph's own fake tensors, so its batch and sequence dims are the same symbols as the model
inputs' (sequence parallelism finds the sequence dim of a received activation that way).
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.utils.flop_counter import flop_registry

from hotswitch.distconfig import balanced_split

from ._torch import OpOverload, detect_fake_mode, graph_module, pytree, size_hint
from .regions import block_of
from .trace import (
    LogicGraph,
    _no_duck_sizing,
    stitched_or_none,
    tidy_joint,
    traced_joint,
)

aten = torch.ops.aten



@dataclass
class Stage:
    """One pipeline stage of a LogicGraph.

    forward: (params..., buffers..., inputs..., acts_in...) -> (acts_out..., den) or, last, (num, den)
    """

    index: int
    forward: fx.GraphModule
    param_names: list[str]
    acts_in: list[str]  # names of the forward-graph nodes received from the previous stage
    acts_out: list[str]  # names of the forward-graph nodes sent to the next stage
    blocks: tuple[str, ...]
    cost: float  # share of the model's cost (FLOPs and parameters), 0..1
    is_last: bool
    joint: fx.GraphModule | None = field(default=None, repr=False)  # traced on first use

    @property
    def num_params(self) -> int:
        return len(self.param_names)


@dataclass
class StageSplit:
    pp: int
    stages: list[Stage]
    param_stages: dict[str, tuple[int, ...]]  # the stages holding each parameter (several when shared)
    blocks: list[str]

    @property
    def shared(self) -> dict[str, tuple[int, ...]]:
        """Parameters used by more than one stage (a tied embedding and LM head): each of those
        stages keeps a copy, and their gradients are summed across the copies (Megatron)."""
        return {n: s for n, s in self.param_stages.items() if len(s) > 1}


def _flops(node: fx.Node) -> int:
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return 0
    fn = flop_registry.get(node.target.overloadpacket)
    if fn is None:
        return 0
    meta = lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a  # noqa: E731
    try:
        value = fn(
            *pytree.tree_map(meta, node.args), **pytree.tree_map(meta, dict(node.kwargs)), out_val=node.meta.get("val")
        )
        return size_hint(value)
    except Exception:  # noqa: BLE001 - a cost estimate; an op whose formula fails counts nothing
        return 0


class _Partition:
    """The analysis shared by all stages of one split: which nodes depend on parameters, where
    each goes, and how sizes are read off the model inputs."""

    def __init__(self, logic: LogicGraph):
        self.logic = logic
        self.nodes = list(logic.forward.graph.nodes)
        phs = [n for n in self.nodes if n.op == "placeholder"]
        p, b = logic.num_params, len(logic.buffer_names)
        self.params, self.buffers, self.inputs = phs[:p], phs[p:p + b], phs[p + b:]
        self.output = next(n for n in self.nodes if n.op == "output")
        # input symbol -> (input placeholder, dim): sizes of activations are read off the inputs
        self.symbols: dict[sympy.Symbol, tuple[fx.Node, int]] = {}
        for ph in self.inputs:
            val = ph.meta.get("val")
            if isinstance(val, torch.Tensor):
                for d, s in enumerate(val.shape):
                    if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol):
                        self.symbols.setdefault(s.node.expr, (ph, d))
        self.dep: set[fx.Node] = set(self.params)
        for n in self.nodes:
            if (
                n.op == "call_function"
                and not self._size_from_inputs(n)
                and any(a in self.dep for a in n.all_input_nodes)
            ):
                self.dep.add(n)

    def _size_from_inputs(self, node: fx.Node) -> bool:
        """A size query whose value is a function of the model inputs' sizes (recomputable anywhere)."""
        if node.target is not aten.sym_size.int:
            return False
        val = node.meta.get("val")
        if isinstance(val, int):
            return True
        return isinstance(val, torch.SymInt) and val.node.expr.free_symbols <= set(self.symbols)

    def inputs_of(self, node: fx.Node) -> list[fx.Node]:
        if self._size_from_inputs(node):
            val = node.meta.get("val")
            expr = val.node.expr if isinstance(val, torch.SymInt) else sympy.Integer(val)
            return sorted({self.symbols[s][0] for s in expr.free_symbols}, key=self.nodes.index)
        return node.all_input_nodes


def split_stages(logic: LogicGraph, pp: int) -> StageSplit:
    """Cut `logic.forward` into `pp` stage graphs at block boundaries (see the module doc)."""
    part = _Partition(logic)
    nodes, dep = part.nodes, part.dep
    blocks: list[str] = []
    where: dict[fx.Node, object] = {}  # dep node -> block name, or "pre" / "post"
    for n in nodes:
        if n not in dep or n.op == "placeholder":
            continue
        b = block_of(n)
        if b is not None and b not in blocks:
            blocks.append(b)
        where[n] = b if b is not None else ("pre" if not blocks else "post")
    if pp > 1 and len(blocks) < pp:
        found = f"{len(blocks)} ({', '.join(blocks)})" if blocks else "none"
        raise ValueError(f"pp={pp} stages need at least {pp} repeated blocks (children of an nn.ModuleList) to cut "
                         f"between; this model has {found}. Use pp <= {max(len(blocks), 1)}")
    n_blocks = max(len(blocks), 1)
    index = {b: i for i, b in enumerate(blocks)}
    flops = [0.0] * n_blocks
    params = [0.0] * n_blocks
    unit = lambda w: 0 if w == "pre" else n_blocks - 1 if w == "post" else index[w]  # noqa: E731
    for n, w in where.items():
        flops[unit(w)] += _flops(n)
    param_users: dict[str, set[int]] = {}
    for name, ph in zip(logic.param_names, part.params):
        users = [u for u in ph.users if u in where]
        units = {unit(where[u]) for u in users}
        params[min(units) if units else 0] += logic.param_shapes[name].numel()
    total_f, total_p = sum(flops) or 1.0, sum(params) or 1.0
    costs = [0.5 * f / total_f + 0.5 * p / total_p for f, p in zip(flops, params)]
    bounds = balanced_split(costs, pp) if pp > 1 else ((0, n_blocks),)
    stage_of_unit = {u: s for s, (a, b) in enumerate(bounds) for u in range(a, b)}

    stage: dict[fx.Node, int] = {}
    for n in nodes:
        if n in where:
            s = stage_of_unit[unit(where[n])]
            s = max([s] + [stage[a] for a in part.inputs_of(n) if a in stage])
            stage[n] = s
    for name, ph in zip(logic.param_names, part.params):
        param_users[name] = {stage[u] for u in ph.users if u in stage}
    # a parameter used by several stages (a tied embedding and LM head) has a copy in each
    param_stages = {name: tuple(sorted(u)) if u else (0,) for name, u in param_users.items()}
    out_leaves = pytree.tree_leaves(part.output.args[0])
    num = out_leaves[0]
    if num in stage:
        stage[num] = pp - 1  # the loss is computed on the last stage (it is there already unless it ...)
    # activations crossing boundaries: a value of stage a used in stage t > a travels a -> a+1 -> ... -> t
    crossing: list[set[fx.Node]] = [set() for _ in range(pp)]  # crossing[t]: received by stage t
    for n in nodes:
        if n not in stage:
            continue
        last_use = max([stage[u] for u in n.users if u in stage] + [stage[n]])
        if n is num or n in out_leaves:
            last_use = pp - 1
        for t in range(stage[n] + 1, last_use + 1):
            crossing[t].add(n)
    order = {n: i for i, n in enumerate(nodes)}
    stages = []
    for s in range(pp):
        acts_in = sorted(crossing[s], key=order.get)
        acts_out = sorted(crossing[s + 1], key=order.get) if s + 1 < pp else []
        stage_params = [name for name in logic.param_names if s in param_stages[name]]
        gm = _stage_graph(part, s, stage, acts_in, acts_out, stage_params, is_last=s == pp - 1)
        a, b = bounds[s]
        stages.append(Stage(s, gm, stage_params, [n.name for n in acts_in], [n.name for n in acts_out],
                            tuple(blocks[a:b]), sum(costs[a:b]), s == pp - 1))
    return StageSplit(pp, stages, param_stages, blocks)


def _stage_graph(part: _Partition, s: int, stage: dict[fx.Node, int], acts_in, acts_out, stage_params,
                 is_last: bool) -> fx.GraphModule:
    logic = part.logic
    out_leaves = pytree.tree_leaves(part.output.args[0])
    num, den = (out_leaves + [None])[:2]
    wanted = list(out_leaves) if is_last else list(acts_out) + ([den] if den is not None else [])
    local = {n for n, t in stage.items() if t == s}
    received = set(acts_in)
    # everything needed: this stage's nodes, and the parameter-free nodes they (and the outputs) read
    keep: set[fx.Node] = set()
    stack = [n for n in wanted] + list(local)
    while stack:
        n = stack.pop()
        if n in keep or n in received or n.op == "placeholder":
            continue
        assert n not in stage or stage[n] == s, f"stage {s} needs {n.name} of stage {stage.get(n)} without receiving it"
        keep.add(n)
        stack.extend(part.inputs_of(n))
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}

    def placeholder(node: fx.Node, name: str) -> None:
        env[node] = g.placeholder(name)
        env[node].meta = dict(node.meta)

    by_name = dict(zip(logic.param_names, part.params))
    for name in stage_params:
        placeholder(by_name[name], by_name[name].name)
    for ph in part.buffers + part.inputs:
        placeholder(ph, ph.name)
    for n in acts_in:
        placeholder(n, f"recv_{n.name}")
    for n in part.nodes:
        if n not in keep:
            continue
        if part._size_from_inputs(n) and any(a not in env for a in n.all_input_nodes):
            env[n] = _size_node(g, part, n, env)
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[n] for n in wanted))
    g.eliminate_dead_code()
    return fx.GraphModule(logic.forward, g)  # writes the code, once


def _size_node(g: fx.Graph, part: _Partition, node: fx.Node, env) -> fx.Node:
    """A size of an activation this stage does not have, rebuilt from the inputs' sizes."""
    val = node.meta["val"]
    expr = val.node.expr if isinstance(val, torch.SymInt) else sympy.Integer(val)

    def build(e):
        if e.is_Integer:
            return int(e)
        if e.is_Symbol:
            ph, d = part.symbols[e]
            n = g.call_function(aten.sym_size.int, (env[ph], d))
            n.meta["val"] = ph.meta["val"].shape[d]
            return n
        op = {sympy.Mul: operator.mul, sympy.Add: operator.add}.get(type(e))
        assert op is not None, f"size expression {e} of {node.name}: only sums and products of input sizes are rebuilt"
        args = [build(a) for a in e.args]
        out = args[0]
        for a in args[1:]:
            out = g.call_function(op, (out, a))
        return out

    out = build(expr)
    if isinstance(out, fx.Node):
        out.meta = {**dict(node.meta), "val": val}
    return out


def stage_joint(logic: LogicGraph, stage: Stage) -> fx.GraphModule:
    """The stage's joint graph (see the module doc), traced once and kept on the Stage.

    (params..., buffers..., inputs..., acts_in..., grads of acts_out...) ->
        (forward outputs..., grad per stage param..., grad per act_in...)
    """
    if stage.joint is not None:
        return stage.joint
    fwd = stage.forward
    phs = [n for n in fwd.graph.nodes if n.op == "placeholder"]
    vals = [ph.meta["val"] for ph in phs]
    fake_mode = detect_fake_mode(vals)
    assert fake_mode is not None, "the forward graph carries no fake tensors"
    n_p, n_b, n_i = stage.num_params, len(logic.buffer_names), logic.num_inputs
    with fake_mode:
        params = [
            torch.empty(logic.param_shapes[n], dtype=logic.param_dtypes[n]).requires_grad_(
                logic.param_dtypes[n].is_floating_point
            )
            for n in stage.param_names
        ]
    buffers, inputs = vals[n_p:n_p + n_b], vals[n_p + n_b:n_p + n_b + n_i]
    acts = [v.detach().requires_grad_(v.is_floating_point()) for v in vals[n_p + n_b + n_i:]]
    out_vals = [n.meta["val"] for n in pytree.tree_leaves(next(n for n in fwd.graph.nodes if n.op == "output").args[0])]
    sent = out_vals[:len(stage.acts_out)]
    grads_out = [torch.empty_like(v) for v in sent if v.is_floating_point()]
    is_last = stage.is_last

    def joint(params, buffers, inputs, acts, grads_out):
        outs = _run_stage(fwd, fwd.graph, [*params, *buffers, *inputs, *acts])
        wrt = [t for t in list(params) + list(acts) if t.requires_grad]
        if is_last:
            targets, seeds = [outs[0]], None
        else:
            pairs = [
                (o, g)
                for o, g in zip([o for o in outs[: len(sent)] if o.is_floating_point()], grads_out)
                if o.requires_grad
            ]
            targets, seeds = [o for o, _ in pairs], [g for _, g in pairs]
        grads = (
            torch.autograd.grad(targets, wrt, grad_outputs=seeds, allow_unused=True)
            if targets and wrt
            else [None] * len(wrt)
        )
        it = iter(grads)
        full = [next(it) if t.requires_grad else None for t in list(params) + list(acts)]
        full = [torch.zeros_like(t) if g is None else g for t, g in zip(list(params) + list(acts), full)]
        return (*outs, *full)

    trace = functools.partial(traced_joint, within=lambda: [_no_duck_sizing()])
    # the stage's blocks traced once per distinct block and stitched (`compiler.regions`), or whole
    n_a = len(acts)
    leaves = [*(p.requires_grad for p in params), *(False,) * (n_b + n_i), *(a.requires_grad for a in acts)]
    sent_floating = [k for k, v in enumerate(sent) if v.is_floating_point()]
    gm = stitched_or_none(
        fwd, groups=(("params", n_p), ("buffers", n_b), ("inputs", n_i), ("acts", n_a), ("grads_out", len(grads_out))),
        takes_grad=tuple(leaves), grads_of=(*range(n_p), *range(n_p + n_b + n_i, n_p + n_b + n_i + n_a)),
        loss=0 if is_last else None, seeded=() if is_last else tuple(sent_floating), run=_run_stage, trace=trace,
        fake_mode=fake_mode)
    if gm is None:
        gm = trace(joint, params, list(buffers), list(inputs), acts, grads_out)
    gm = tidy_joint(gm, n_p + n_b)
    stage.joint = gm
    return gm


def _run_stage(gm: fx.GraphModule, graph: fx.Graph, args: list):
    """A stage's (or one of its regions') forward, its nodes' source lines and module paths handed on."""
    with fx_traceback.preserve_node_meta():
        return fx.Interpreter(gm, graph=graph).run(*args)


def split_forward_backward(gm: fx.GraphModule, num_seeds: int, forward_outputs: tuple[int, ...]):
    """Cut a lowered stage joint graph into the forward and backward programs a schedule interleaves.

    The last `num_seeds` placeholders are the gradients received from the next stage. The backward
    program is every node that depends on them; the forward program is the rest. The forward
    returns (its outputs at `forward_outputs`..., saved...), the backward takes (saved..., seeds...)
    and returns the remaining outputs, in order. `saved` are the forward values the backward reads
    (AOTAutograd's partition without its recomputation heuristics). Collectives stay whole: a
    collective and its wait fall on the same side. Returns (forward, backward, number saved).
    """
    nodes = list(gm.graph.nodes)
    phs = [n for n in nodes if n.op == "placeholder"]
    seeds = phs[len(phs) - num_seeds:] if num_seeds else []
    out = next(n for n in nodes if n.op == "output")
    leaves = list(out.args[0])
    back: set[fx.Node] = set(seeds)
    for n in nodes:
        if n.op not in ("placeholder", "output") and any(a in back for a in n.all_input_nodes):
            back.add(n)
    assert not any(isinstance(leaves[i], fx.Node) and leaves[i] in back for i in forward_outputs), \
        "a forward output depends on a gradient from the next stage"
    backward_idx = [i for i in range(len(leaves)) if i not in forward_outputs]
    saved: list[fx.Node] = []
    for n in nodes:
        if n in back or n.op == "output":
            continue
        if any(u in back for u in n.users) or any(leaves[i] is n for i in backward_idx):
            saved.append(n)

    fwd_graph, env = fx.Graph(), {}
    for n in nodes:
        if n in back or n.op == "output":
            continue
        env[n] = fwd_graph.node_copy(n, lambda a: env[a])
    fwd_graph.output(tuple([_arg(leaves[i], env) for i in forward_outputs] + [env[n] for n in saved]))
    fwd_graph.eliminate_dead_code()
    fwd = graph_module(gm, fwd_graph)

    bwd_graph, benv = fx.Graph(), {}
    for n in saved:
        benv[n] = bwd_graph.placeholder(f"saved_{n.name}")
        benv[n].meta = dict(n.meta)
    for n in nodes:
        if n in seeds:
            benv[n] = bwd_graph.placeholder(n.name)
            benv[n].meta = dict(n.meta)
        elif n in back:
            benv[n] = bwd_graph.node_copy(n, lambda a: benv[a])
    bwd_graph.output(tuple(_arg(leaves[i], benv) for i in backward_idx))
    bwd_graph.eliminate_dead_code()
    bwd = graph_module(gm, bwd_graph)
    return fwd, bwd, len(saved)


def _arg(a, env):
    return env[a] if isinstance(a, fx.Node) else a
