"""The joint graph traced one region at a time: each distinct repeated block traced once, then copied.

Tracing the joint forward+backward graph (make_fx over the forward, autograd, symbolic shapes) cost
about 0.3 s per transformer block on a 2-core CPU, most of it sympy arithmetic on the symbolic sizes
of every fake tensor it makes: with depth it grew faster than `torch.export` did. A deep model is
mostly one block again and again (the children of an `nn.ModuleList`), and in a joint graph each
copy is the same forward ops and the same backward ops on its own parameters. So, in the spirit of
torch.compile's regional compilation:

1. The forward graph is cut into *regions* (`regions_of`): maximal runs of one block's nodes
   (`stages.block_of`, read off `nn_module_stack`) and the runs between blocks (embeddings, masks,
   RoPE tables, the head and the loss). A region reads values of earlier regions and the graph's
   inputs and hands values on to later regions.
2. A region is traced as a joint graph of its own: (its inputs, those that take a gradient as leaves
   that do; one gradient seed per output that takes one) -> (its outputs, the gradient of each input
   that gets one). Regions of one structure (the same ops, in order, on inputs of the same symbolic
   shapes and dtypes, the same inputs taking gradients) share one trace: an 8-layer Llama is traced
   as 3 regions, not 10.
3. The joint graph is stitched from those traces: every region's forward part in the forward's
   order, then every region's backward part in reverse, each seed the gradient its output received
   from later regions (summed where several read it), each parameter's gradient the sum of its
   regions' parts. A copied block's nodes carry its own module path, so pipeline stages and
   per-block collective counts still find them.

The stitched graph computes what the whole-graph trace computes, op for op (`tests/test_trace.py`
checks the loss and every gradient against it); only a value's gradient summed over several regions
(a tied embedding and LM head) may add its parts in another order. A model without a repeated
block takes the whole-graph trace (`stitched_joint` returns None before tracing anything).
"""
from __future__ import annotations

import operator
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from ._torch import ancestors, codegen, codeless_module, copy_node, lists_codegen

__all__ = ["Region", "block_of", "regions_of", "stitched_joint"]

aten = torch.ops.aten

# "layers.3.attn.q_proj" -> "layers.3"; "model.model.layers.0.mlp" -> "model.model.layers.0"
_BLOCK = re.compile(r"^((?:[^.]+\.)*?\d+)(?=\.|$)")


def block_of(node: fx.Node) -> str | None:
    """The repeated block (a ModuleList child) a node was traced in, or None."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    m = _BLOCK.match(path)
    return m.group(1) if m else None


@dataclass(frozen=True)
class Region:
    """A contiguous run of a forward graph's nodes: one block's, or those between blocks."""

    block: str | None  # the block's module path ("model.layers.3"); None between blocks
    nodes: tuple[fx.Node, ...]
    inputs: tuple[fx.Node, ...]  # nodes outside it that it reads (placeholders, earlier regions'), by first use
    outputs: tuple[fx.Node, ...]  # its nodes read outside it (by later regions, the graph's output), in order


def regions_of(graph: fx.Graph) -> list[Region]:
    """`graph`'s nodes (placeholders and output aside) cut into regions. A node of no block between
    two nodes of the same block (a size read mid-block) belongs to that block."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    blocks = [block_of(n) for n in nodes]
    known = [(i, b) for i, b in enumerate(blocks) if b is not None]
    for (i, b), (j, c) in zip(known, known[1:]):
        if b == c and j > i + 1:
            blocks[i + 1:j] = [b] * (j - i - 1)
    runs: list[tuple[str | None, list[fx.Node]]] = []
    for n, b in zip(nodes, blocks):
        if runs and runs[-1][0] == b:
            runs[-1][1].append(n)
        else:
            runs.append((b, [n]))
    regions = []
    for b, members in runs:
        inside = set(members)
        inputs: dict[fx.Node, None] = {}
        for n in members:
            for a in n.all_input_nodes:
                if a not in inside:
                    inputs.setdefault(a)
        outputs = tuple(n for n in members if any(u not in inside for u in n.users))
        regions.append(Region(b, tuple(members), tuple(inputs), outputs))
    return regions


def _signature(value) -> tuple:
    """What a region's trace reads of an input value: its symbolic shape, strides and dtype."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(map(str, value.shape)), tuple(map(str, value.stride())), value.dtype,
                value.device.type)
    if isinstance(value, torch.SymInt):
        return ("symint", str(value.node.expr))
    return ("value", type(value).__name__, repr(value))


def _ops(region: Region) -> tuple:
    """The region's ops in order, each argument a constant, a position in the region or an input slot."""
    position = {n: i for i, n in enumerate(region.nodes)}
    slot = {n: i for i, n in enumerate(region.inputs)}

    def encode(a):
        if isinstance(a, fx.Node):
            return ("node", position[a]) if a in position else ("input", slot[a])
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(encode(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, encode(v)) for k, v in a.items()))
        if isinstance(a, slice):
            return ("slice", encode(a.start), encode(a.stop), encode(a.step))
        return ("const", type(a).__name__, repr(a))

    return (tuple((n.op, n.target, encode(n.args), encode(n.kwargs)) for n in region.nodes),
            tuple(_signature(n.meta.get("val")) for n in region.inputs),
            tuple(position[o] for o in region.outputs))


@dataclass
class _Template:
    """One region's joint graph, traced once, its nodes split into the forward and the backward part."""

    module: fx.GraphModule
    block: str | None  # the block it was traced for (copies rename module paths from it)
    inputs: list[fx.Node]  # placeholders, one per region input
    seeds: dict[int, fx.Node]  # output index -> the placeholder of its gradient (outputs that take one)
    outputs: list[Any]  # per region output: a node of the graph, or a constant
    grads: dict[int, fx.Node]  # input index -> its gradient (inputs that get one)
    forward: list[fx.Node]  # the nodes the outputs are computed from, in order
    backward: list[fx.Node]  # the rest, in order
    takes_grad: tuple[bool, ...]  # per output: does it take a gradient


def _trace_region(fwd: fx.GraphModule, region: Region, needs_grad: tuple[bool, ...], loss: int | None,
                  run: Callable, trace: Callable, fake_mode) -> _Template:
    """The region's joint graph: (inputs..., seeds...) -> (outputs..., gradients of the inputs that
    get one...). `loss`: the output differentiated with an implicit seed of one (the model's loss
    numerator), where this region computes it."""
    g, env = fx.Graph(), {}
    for i, n in enumerate(region.inputs):
        env[n] = g.placeholder(f"input_{i}")
        env[n].meta = dict(n.meta)
    for n in region.nodes:
        env[n] = g.node_copy(n, env.__getitem__)
    g.output(tuple(env[o] for o in region.outputs))

    def leaf(n: fx.Node, grad: bool):
        return n.meta["val"].detach().clone().requires_grad_(True) if grad else n.meta["val"]

    with fake_mode:
        inputs = [leaf(n, grad) for n, grad in zip(region.inputs, needs_grad)]
        seeded = [k for k, o in enumerate(region.outputs) if k != loss and _floating(o)]
        seeds = [torch.empty_like(region.outputs[k].meta["val"]) for k in seeded]
    found: dict[str, list] = {}

    def joint(inputs, seeds):
        outs = run(fwd, g, inputs)
        takes = [isinstance(o, torch.Tensor) and o.requires_grad for o in outs]
        pairs = [(outs[k], seeds[i]) for i, k in enumerate(seeded) if takes[k]]
        if loss is not None and takes[loss]:
            pairs.append((outs[loss], None))
        wrt = [x for x, grad in zip(inputs, needs_grad) if grad]
        grads = torch.autograd.grad([o for o, _ in pairs], wrt, [s for _, s in pairs], allow_unused=True) \
            if pairs and wrt else [None] * len(wrt)
        it = iter(grads)
        per_input = [next(it) if grad else None for grad in needs_grad]
        found["takes"] = takes
        found["grads"] = [i for i, x in enumerate(per_input) if x is not None]
        return (*outs, *[x for x in per_input if x is not None])

    gm = trace(joint, inputs, seeds)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = list(out.args[0])
    outputs = leaves[:len(region.outputs)]
    forward = ancestors(outputs)
    # a multi-output op's parts stay beside it, as make_fx emits them (one kept for the backward only, a
    # norm's mean, say, is still the forward's)
    forward |= {u for n in forward for u in n.users if u.target is operator.getitem}
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    seed_phs = phs[len(region.inputs):]
    return _Template(
        module=gm, block=region.block, inputs=phs[:len(region.inputs)],
        seeds={k: ph for k, ph in zip(seeded, seed_phs) if found["takes"][k]},
        outputs=outputs, grads=dict(zip(found["grads"], leaves[len(region.outputs):])),
        forward=[n for n in body if n in forward], backward=[n for n in body if n not in forward],
        takes_grad=tuple(found["takes"]))


def _floating(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


class _Stitcher:
    """Copies templates' nodes into one graph: a copied block's module paths renamed, each
    template's constants registered once."""

    def __init__(self, fake_mode):
        self.graph = fx.Graph()
        self.attrs: dict[str, Any] = {}
        self._attr_names: dict[tuple[int, str], str] = {}
        self._stacks: dict[tuple[int, str], dict] = {}
        self.fake_mode = fake_mode

    def copy(self, node: fx.Node, env: dict, template: _Template, block: str | None) -> fx.Node:
        if node.op == "get_attr":
            key = (id(template.module), node.target)
            if key not in self._attr_names:
                self._attr_names[key] = name = f"_region_constant{len(self.attrs)}"
                self.attrs[name] = getattr(template.module, node.target)
            new = self.graph.get_attr(self._attr_names[key])
            new.meta.update(node.meta)
            return new
        new = copy_node(self.graph, node, env.__getitem__)
        stack = node.meta.get("nn_module_stack")
        if stack and block is not None and template.block is not None and block != template.block:
            key = (id(stack), block)
            if key not in self._stacks:
                self._stacks[key] = _renamed(stack, template.block, block)
            new.meta["nn_module_stack"] = self._stacks[key]
        return new

    def add(self, parts: list) -> fx.Node:
        total = parts[0]
        for part in parts[1:]:
            with self.fake_mode:
                val = aten.add.Tensor(total.meta["val"], part.meta["val"])
            total = self.graph.call_function(aten.add.Tensor, (total, part))
            total.meta["val"] = val
        return total

    def zeros(self, like: fx.Node) -> fx.Node:
        with self.fake_mode:
            val = aten.zeros_like.default(like.meta["val"])
        node = self.graph.call_function(aten.zeros_like.default, (like,))
        node.meta["val"] = val
        return node


def _renamed(stack: dict, old: str, new: str) -> dict:
    """An nn_module_stack with the module path `old` (a block) and those under it written under `new`."""
    def rename(path: str) -> str:
        return new + path[len(old):] if path == old or path.startswith(old + ".") else path

    out = {}
    for key, (path, kind) in stack.items():
        renamed = rename(path)
        if renamed != path and key.endswith(path):
            key = key[:len(key) - len(path)] + renamed
        out[key] = (renamed, kind)
    return out


def stitched_joint(fwd: fx.GraphModule, *, groups: tuple[tuple[str, int], ...], takes_grad: tuple[bool, ...],
                   grads_of: tuple[int, ...], loss: int | None, seeded: tuple[int, ...], run: Callable,
                   trace: Callable, fake_mode) -> fx.GraphModule | None:
    """The joint graph of `fwd` stitched from its regions' traces, called and named as make_fx names
    the whole-graph trace's: inputs are `fwd`'s placeholders, in `groups` (name, count: make_fx's
    argument lists), then the gradients of the outputs at `seeded`, in one more group; outputs are
    `fwd`'s, then the gradient of each placeholder at `grads_of` (zeros where it gets none). The
    output at `loss` is differentiated with an implicit seed of one; placeholders where `takes_grad`
    is set are the leaves gradients flow to. None when no region's structure repeats (nothing to
    reuse) or a value that is not a tensor or a size crosses between regions.

    `run(module, graph, inputs)` runs a region's forward (`graph`, whose attributes are `module`'s)
    as the whole-graph trace runs the forward; `trace(fn, inputs, seeds)` traces `fn(inputs, seeds)`
    into a joint GraphModule (decomposed, functional)."""
    regions = regions_of(fwd.graph)
    shapes = [_ops(r) for r in regions]
    if len(set(shapes)) == len(shapes):
        return None
    if not all(isinstance(n.meta.get("val"), (torch.Tensor, torch.SymInt)) for r in regions for n in r.inputs):
        return None  # a tuple (a multi-output op's result) crossing a boundary: traced as one graph
    placeholders = [n for n in fwd.graph.nodes if n.op == "placeholder"]
    results = list(next(n for n in fwd.graph.nodes if n.op == "output").args[0])
    loss_node = results[loss] if loss is not None else None
    if loss_node is not None and (not isinstance(loss_node, fx.Node) or loss_node.op == "placeholder"):
        return None

    # 1. each distinct region traced once, in the forward's order (whether an input takes a
    # gradient is known from the regions before it)
    needs_grad = dict(zip(placeholders, takes_grad))
    templates: dict[tuple, _Template] = {}
    plan: list[tuple[Region, _Template]] = []
    for region, shape in zip(regions, shapes):
        needs = tuple(needs_grad.get(n, False) for n in region.inputs)
        at = region.outputs.index(loss_node) if loss_node in region.outputs else None
        key = (shape, needs, at)
        if key not in templates:
            templates[key] = _trace_region(fwd, region, needs, at, run, trace, fake_mode)
        template = templates[key]
        plan.append((region, template))
        needs_grad.update(zip(region.outputs, template.takes_grad))

    # 2. forward parts in order
    st = _Stitcher(fake_mode)
    env: dict[fx.Node, Any] = {}
    names = [f"{group}_{k + 1}" for group, n in groups for k in range(n)]
    for ph, name in zip(placeholders, names):
        env[ph] = st.graph.placeholder(name)
        env[ph].meta = dict(ph.meta)
    seeds = []
    for k, name in zip(seeded, names[len(placeholders):]):
        seeds.append(st.graph.placeholder(name))
        val = results[k].meta["val"]
        with fake_mode:
            seeds[-1].meta["val"] = torch.empty_like(val)
    copies: list[dict] = []
    for region, t in plan:
        tenv: dict[fx.Node, Any] = dict(zip(t.inputs, (env[n] for n in region.inputs)))
        for n in t.forward:
            tenv[n] = st.copy(n, tenv, t, region.block)
        for o, v in zip(region.outputs, t.outputs):
            env[o] = tenv[v] if isinstance(v, fx.Node) else v
        copies.append(tenv)
    outputs = [env[r] if isinstance(r, fx.Node) else r for r in results]

    # 3. backward parts in reverse, each seeded with what later regions (or the caller) gave its outputs
    grads: dict[fx.Node, list] = defaultdict(list)
    for k, seed in zip(seeded, seeds):
        if needs_grad.get(results[k], False):
            grads[results[k]].append(seed)
    for (region, t), tenv in zip(reversed(plan), reversed(copies)):
        for k, ph in t.seeds.items():
            parts = grads.pop(region.outputs[k], [])
            tenv[ph] = st.add(parts) if parts else st.zeros(env[region.outputs[k]])
        for n in t.backward:
            tenv[n] = st.copy(n, tenv, t, region.block)
        for i, g in t.grads.items():
            grads[region.inputs[i]].append(tenv[g])
    wanted = [placeholders[i] for i in grads_of]
    input_grads = [st.add(grads[p]) if grads.get(p) else st.zeros(env[p]) for p in wanted]
    st.graph.output((*outputs, *input_grads))
    codegen(st.graph, lists_codegen([g for g, _ in groups], [n for _, n in groups], len(outputs) + len(wanted)))
    root = torch.nn.Module()
    for name, value in st.attrs.items():
        setattr(root, name, value)
    return codeless_module(root, st.graph)
