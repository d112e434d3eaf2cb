"""Tracing an nn.Module into a LogicGraph: one single-device, communication-free graph.

`torch.export` (non-strict) gives an ATen forward graph with dynamic batch and sequence dims and
the parameters' fully qualified names. From it we derive, once, a core-ATen *joint* forward+backward
graph with `make_fx` (symbolic shapes, decomposing as it traces): the unit the compiler shards,
because a joint graph lets the same sharding propagation place the collectives of both directions
(DESIGN 4a).

The loss is split as `loss = num / den` when the model ends with a division by a parameter-free
scalar (a mean cross-entropy: sum of token losses / count of target tokens; torch's own mean
cross-entropy is split into those two before decomposing). Then the joint graph is traced in one pass
from the exported graph and the forward is cut out of it; a loss that is a division only once
decomposed has its forward decomposed first, then the joint traced from it. The joint graph then
differentiates `num` only; the runtime reduces `num`, `den` and the gradients together in the data-
parallel gradient buckets and divides once. That keeps the forward of pure DP free of collectives and
makes uneven DP splits (and ignored labels) exact.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.export import Dim, export
from torch.fx.experimental.proxy_tensor import make_fx

from ._torch import (
    OpOverload,
    codeless_modules,
    core_aten_decompositions,
    detect_fake_mode,
    half_precision_math_attention,
    is_mutable,
    meta_state_on,
    pytree,
    with_code,
)
from .attention import AttentionWhole
from .garbage import collector_paused
from .regions import stitched_joint
from .signature import InputError, LossModule, ModelCall

aten = torch.ops.aten

# Ops kept whole because DTensor has a rule for them and their decompositions have none that
# propagates well (autoparallel keeps the same ones), and the MLP's activations, which DTensor
# shards pointwise: decomposed, a bf16 SiLU upcasts and keeps two fp32 copies of the MLP's
# [tokens x intermediate] for its backward (a quarter of a Llama block's activations), fused the
# bf16 input alone.
_KEEP = (aten.native_layer_norm.default, aten.native_layer_norm_backward.default,
         aten._softmax.default, aten._softmax_backward_data.default,
         aten._log_softmax.default, aten._log_softmax_backward_data.default,
         aten.embedding_dense_backward.default,
         aten.silu.default, aten.silu_backward.default, aten.gelu.default, aten.gelu_backward.default)


def decomposition_table() -> dict:
    """Core ATen's decompositions but the ops in `_KEEP`: a copy (make_fx may add to it) of a table
    built once (torch builds its own anew on every call: 0.05 s, twice per trace)."""
    return dict(_decomposition_table())


@functools.lru_cache(maxsize=1)
def _decomposition_table() -> dict:
    table = dict(core_aten_decompositions())
    for op in _KEEP:
        table.pop(op, None)
    return table


def _constant_pads(gm: fx.GraphModule) -> None:
    """`F.pad(x, pad, value=v)` as slices, fills and a concatenation: the C++ kernels of aten.pad and
    aten.constant_pad_nd read the input's sizes as ints, which pins a dynamic batch and sequence to
    the example's sizes (Hugging Face's causal-LM loss pads the labels by one position)."""
    for node in gm.graph.nodes:
        if node.target in (aten.pad.default, aten.constant_pad_nd.default):
            names = ("input", "pad", "mode", "value") if node.target is aten.pad.default else ("input", "pad", "value")
            args = dict(zip(names, node.args), **node.kwargs)
            if args.get("mode", "constant") == "constant":
                node.target = _constant_pad
                node.args, node.kwargs = (args["input"], args["pad"], args.get("value")), {}


def _constant_pad(x: torch.Tensor, pad, value=None) -> torch.Tensor:
    """torch.nn.functional.pad(x, pad, value=value) in ops that keep sizes symbolic."""
    value = 0 if value is None else value
    for i in range(len(pad) // 2):
        dim, before, after = x.dim() - 1 - i, pad[2 * i], pad[2 * i + 1]
        if before < 0:
            x = x.narrow(dim, -before, x.shape[dim] + before)
        if after < 0:
            x = x.narrow(dim, 0, x.shape[dim] + after)
        parts = [x.new_full((*x.shape[:dim], n, *x.shape[dim + 1:]), value) for n in (before,) if n > 0]
        parts.append(x)
        parts += [x.new_full((*x.shape[:dim], n, *x.shape[dim + 1:]), value) for n in (after,) if n > 0]
        x = torch.cat(parts, dim) if len(parts) > 1 else x
    return x


@dataclass
class LogicGraph:
    """A model traced once: forward and joint graphs over (params, buffers, inputs).

    forward: (params..., buffers..., inputs...) -> (num, den) or (loss,)
    joint:   (params..., buffers..., inputs...) -> (num, den?, grad per param...)
    """

    forward: fx.GraphModule
    joint: fx.GraphModule
    param_names: list[str]
    buffer_names: list[str]
    param_shapes: dict[str, torch.Size]
    param_dtypes: dict[str, torch.dtype]
    num_inputs: int
    split_loss: bool  # outputs carry (num, den) rather than the loss itself
    aliases: dict[str, str] = field(default_factory=dict)  # state_dict key -> canonical parameter name
    seq_symbol: object = None  # the sympy symbol of the sequence dim, when the inputs have one
    call: ModelCall | None = None  # how the model is called: input names, constants, where its loss is

    @property
    def num_params(self) -> int:
        return len(self.param_names)

    def sequence_inputs(self) -> tuple[bool, ...]:
        """Per model input: is its dim 1 the sequence (the dim context parallelism shards)?"""
        inputs = [n for n in self.joint.graph.nodes if n.op == "placeholder"][
            self.num_params + len(self.buffer_names):][:self.num_inputs]
        out = []
        for ph in inputs:
            val = ph.meta.get("val")
            dim1 = val.shape[1] if isinstance(val, torch.Tensor) and val.dim() >= 2 else None
            out.append(self.seq_symbol is not None and isinstance(dim1, torch.SymInt)
                       and dim1.node.expr == self.seq_symbol)
        return tuple(out)


def _decompose(gm: fx.GraphModule, fake_inputs: list) -> fx.GraphModule:
    """Core-ATen forward graph of the exported training IR (for a loss `trace` cannot split before
    decomposing; see `_split_mean_cross_entropy`).

    One make_fx pass with our decomposition table over the exported graph, fed the export's own
    fake inputs: their sizes are the export's symbols, so the pass reasons in the shape environment
    export already solved (2 symbols for a [batch, seq] model) instead of building a fresh one
    with a symbol per input dim, which cost 20x more in guard evaluation. Composite ops (matmul,
    linear) decompose in C++ here, where `ExportedProgram.run_decompositions` runs them as Python
    decompositions, about 6x slower. The interpreter hands every node's source line and module path on.
    """
    def run(*args):
        with fx_traceback.preserve_node_meta():
            return fx.Interpreter(gm).run(*args)

    with (
        torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH),
        half_precision_math_attention(),
        warnings.catch_warnings(),
        detect_fake_mode(fake_inputs),
    ):
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        with codeless_modules():  # the caller edits the graph, then writes its code once (`with_code`)
            return make_fx(run, decomposition_table=decomposition_table(), tracing_mode="fake")(*fake_inputs)


def _no_duck_sizing():
    """Symbolic tracing gives equal sizes one symbol by default ("duck sizing"): a sequence of 64
    tokens would share its symbol with a 64-wide weight and be specialized to 64 with it. Every
    input dim gets its own symbol here; parameter dims are folded to constants afterwards."""
    from torch.fx.experimental import _config

    return _config.patch(use_duck_shape=False)


def _fold_static_sizes(gm: fx.GraphModule, num_static: int) -> None:
    """Parameters' and buffers' shapes never change, but symbolic make_fx gave them symbols too:
    replace `sym_size(param, d)` by its value so equal sizes compare equal (CSE, view shapes)."""
    static = set([n for n in gm.graph.nodes if n.op == "placeholder"][:num_static])
    for node in list(gm.graph.nodes):
        if node.target is aten.sym_size.int and node.args[0] in static:
            value = int(node.args[0].meta["val"].shape[node.args[1]])
            for user in list(node.users):
                user.args = pytree.tree_map(lambda a: value if a is node else a, user.args)
                user.kwargs = pytree.tree_map(lambda a: value if a is node else a, user.kwargs)
            gm.graph.erase_node(node)


def _cse(gm: fx.GraphModule) -> fx.GraphModule:
    """Merge identical pure nodes, size arithmetic included: q, k and v projections then view one
    tensor once, so the compiler gathers a sequence-sharded activation once for all three
    (Megatron's single all-gather). fx's CSEPass leaves `operator.mul` on sizes alone, and then
    the three views differ in their size arguments."""
    seen: dict[tuple, fx.Node] = {}
    env: dict[fx.Node, fx.Node] = {}

    def key(a):
        if isinstance(a, fx.Node):
            return ("node", env.get(a, a))
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(key(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, key(v)) for k, v in sorted(a.items())))
        return ("const", type(a).__name__, repr(a))

    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not _pure(node.target):
            continue
        k = (node.target, key(node.args), key(node.kwargs))
        if k in seen:
            node.replace_all_uses_with(seen[k])
            env[node] = seen[k]
            gm.graph.erase_node(node)
        else:
            seen[k] = node
    return gm


def _pure(target) -> bool:
    if isinstance(target, OpOverload):
        return not is_mutable(target) and torch.Tag.nondeterministic_seeded not in target.tags
    return getattr(target, "__module__", None) in ("_operator", "operator") or target in (math.floor, math.ceil)


def _drop_identity_slices(gm: fx.GraphModule) -> None:
    """`x[:]` traces to slice(x, d, 0, INT64_MAX) and its backward to a full slice_scatter: both are
    identities, and DTensor would gather a sharded dim to run them."""
    full = lambda n, i: (n.args[i:i + 3] + (None, None, None))[:3]  # noqa: E731
    for node in list(gm.graph.nodes):
        if node.target is aten.slice.Tensor:
            start, end, step = full(node, 2)
            if start in (0, None) and end in (None, 2**63 - 1) and step in (1, None):
                node.replace_all_uses_with(node.args[0])
        elif node.target is aten.slice_scatter.default:
            start, end, step = full(node, 3)
            src, dst = node.args[1].meta.get("val"), node.args[0].meta.get("val")
            if start in (0, None) and end in (None, 2**63 - 1) and step in (1, None) and src is not None \
                    and dst is not None and src.shape == dst.shape:
                node.replace_all_uses_with(node.args[1])
    gm.graph.eliminate_dead_code()


def _normalize_reduce_dims(gm: fx.GraphModule) -> None:
    """`sum.dim_IntList(x, [])` means "all dims" in core ATen, but DTensor reads [] as "no dims"."""
    for node in gm.graph.nodes:
        if node.target in (aten.sum.dim_IntList, aten.mean.dim) and len(node.args) >= 2 and node.args[1] in ([], ()):
            ndim = node.args[0].meta["val"].dim()
            node.args = (node.args[0], list(range(ndim)), *node.args[2:])


def _squeeze_one_dim(gm: fx.GraphModule) -> None:
    """`squeeze.dims(x, [d])` as `squeeze.dim(x, d)` where DTensor has no rule for the former
    (torch 2.11, the GPU image's torch, has rules for squeeze.dim only; 2.13 has both and keeps the graph)."""
    from . import _dtensor

    if _dtensor.has_rule(aten.squeeze.dims):
        return
    for node in gm.graph.nodes:
        if node.target is aten.squeeze.dims and len(node.args) == 2 and len(node.args[1]) == 1:
            node.target, node.args = aten.squeeze.dim, (node.args[0], node.args[1][0])


def _merge_tied(gm: fx.GraphModule, param_names: list[str], aliases: dict[str, str]) -> None:
    """Tied weights appear once per name in the export signature; keep one parameter per tensor
    (the name model.named_parameters() gives it) so its gradient sums every use."""
    placeholders = dict(zip(param_names, [n for n in gm.graph.nodes if n.op == "placeholder"]))
    for alias, canonical in aliases.items():
        if alias not in placeholders:
            continue
        node = placeholders.pop(alias)
        if canonical in placeholders:
            node.replace_all_uses_with(placeholders[canonical])
            gm.graph.erase_node(node)
            param_names.remove(alias)
        else:  # only the alias was lifted: it becomes the canonical name
            param_names[param_names.index(alias)] = canonical
            placeholders[canonical] = node


def _depends_on(node: fx.Node, sources: set[fx.Node]) -> bool:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in sources:
            return True
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def _split_loss(gm: fx.GraphModule, param_nodes: set[fx.Node]) -> bool:
    """Rewrite `return (num / den,)` into `return (num, den)` when den is a parameter-free scalar."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    (loss,) = out.args[0]
    if loss.meta["val"].dim() != 0:
        raise ValueError(
            f"the model must return a scalar loss (a mean over tokens), an object with .loss or a dict with 'loss'; "
            f"it returned a tensor of shape {tuple(loss.meta['val'].shape)} (logits?). Return the loss, e.g. pass "
            "labels to a Hugging Face model, or wrap it: hotswitch.models.HFCausalLMLoss(model)")
    if loss.target is aten.div.Tensor and isinstance(loss.args[1], fx.Node):
        num, den = loss.args
        if den.meta["val"].dim() == 0 and not _depends_on(den, param_nodes):
            out.args = ((num, den),)
            gm.graph.eliminate_dead_code()
            return True
    return False


_CROSS_ENTROPY_ARGS = ("self", "target", "weight", "reduction", "ignore_index", "label_smoothing")


def _cross_entropy_arguments(args, kwargs) -> dict:
    """`aten.cross_entropy_loss`'s arguments by name, defaults filled in (reduction 1: the mean)."""
    return {"weight": None, "reduction": 1, "ignore_index": -100, "label_smoothing": 0.0,
            **dict(zip(_CROSS_ENTROPY_ARGS, args)), **kwargs}


def _split_mean_cross_entropy(gm: fx.GraphModule) -> bool:
    """Rewrite `return (cross_entropy(logits, labels),)` (mean over the labels that are not
    ignored, no class weights, no smoothing: a Hugging Face model's loss) into `return (summed
    cross-entropy, count of those labels)`: the numerator and denominator its decomposition divides
    (`nll_loss`'s total weight, in the logits' dtype), found before decomposing."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    (loss,) = out.args[0]
    if loss.target is not aten.cross_entropy_loss.default:
        return False
    args = _cross_entropy_arguments(loss.args, loss.kwargs)
    logits, labels, ignore = args["self"], args["target"], args["ignore_index"]
    if args["weight"] is not None or args["reduction"] != 1 or args["label_smoothing"] != 0.0 \
            or not isinstance(labels, fx.Node) or labels.meta["val"].is_floating_point():
        return False
    g = gm.graph
    with g.inserting_before(out):
        summed = g.call_function(aten.cross_entropy_loss.default, (logits, labels, None, 2, ignore, 0.0))  # 2: sum
        counted = g.call_function(aten.ne.Scalar, (labels, ignore))
        count = g.call_function(aten.sum.default, (counted,))
        den = g.call_function(aten._to_copy.default, (count,), {"dtype": logits.meta["val"].dtype})
    for n in (summed, counted, count, den):  # the loss's source line and module path
        n.meta.update({k: v for k, v in loss.meta.items() if k != "val"})
    out.args = ((summed, den),)
    g.erase_node(loss)
    return True


def _forward_of(joint: fx.GraphModule, num_outputs: int) -> fx.GraphModule:
    """The forward graph inside a joint one: every input (parameters, buffers, model inputs) and
    the nodes the first `num_outputs` outputs (the loss's numerator and denominator) are computed
    from, copied with their metadata, in the joint's order."""
    out = next(n for n in joint.graph.nodes if n.op == "output")
    wanted = pytree.tree_leaves(out.args[0])[:num_outputs]
    needed, stack = set(), [w for w in wanted if isinstance(w, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack.extend(n.all_input_nodes)
    g, env = fx.Graph(), {}
    for n in joint.graph.nodes:
        if n.op == "placeholder" or n in needed:
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[w] if isinstance(w, fx.Node) else w for w in wanted))
    return fx.GraphModule(joint, g)


def _param_nodes(gm: fx.GraphModule, num_params: int) -> set[fx.Node]:
    """The placeholders of a traced graph's parameters (its first inputs)."""
    return set([n for n in gm.graph.nodes if n.op == "placeholder"][:num_params])


@collector_paused()
def trace(
    model: torch.nn.Module, example_inputs, dynamic_dims: dict[int, tuple[int, ...]] | None = None
) -> LogicGraph:
    """Trace `model` called on `example_inputs` (a tuple, or a dict of keyword arguments) into a
    LogicGraph. forward returns a scalar loss, or an object or dict with a `loss` entry (see
    hotswitch.compiler.signature: the graph's inputs are the inputs' tensors, in `LogicGraph.call`'s order).

    dynamic_dims: tensor input index -> dims that vary between calls; default: dims 0 (batch) and 1
    (sequence) of every input tensor of rank >= 2.
    """
    call = ModelCall.of(model, example_inputs)
    example_inputs = call.flatten_example(example_inputs)
    if dynamic_dims is None:
        dynamic_dims = {i: (0, 1) for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor) and x.dim() >= 2}
    # a model built under torch.device("meta") traces as on its inputs' device (no weights are read)
    on_meta = any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))
    device = next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
    with meta_state_on(device) if on_meta else contextlib.nullcontext():
        ep = _export(LossModule(model, call), example_inputs, dynamic_dims)
    sig = ep.graph_signature
    if sig.buffers_to_mutate or sig.user_inputs_to_mutate:
        raise ValueError("the model mutates buffers or inputs in forward (e.g. running statistics); "
                         "hotswitch compiles pure training graphs: remove the mutation or register it as a non-buffer")
    param_names, buffer_names, user_inputs = [], [], 0
    for spec in sig.input_specs:
        kind = spec.kind.name
        if kind == "PARAMETER":
            param_names.append(spec.target)
        elif kind == "BUFFER":
            buffer_names.append(spec.target)
        elif kind == "USER_INPUT":
            user_inputs += 1
        elif kind in ("CONSTANT_TENSOR",):
            raise ValueError(f"the model holds a constant tensor attribute {spec.target!r}; register it as a buffer")
    if user_inputs != sum(isinstance(x, torch.Tensor) for x in example_inputs):
        raise ValueError("every example input must be a tensor (pass options as module attributes, not inputs)")

    # The exported module: placeholders are (params, buffers, user inputs) in signature order.
    state = {
        **dict(model.named_buffers(remove_duplicate=False)),
        **dict(model.named_parameters(remove_duplicate=False)),
    }
    exported = ep.graph_module
    _constant_pads(exported)
    canon = {id(p): n for n, p in model.named_parameters()}
    aliases = {k: canon[id(v)] for k, v in model.named_parameters(remove_duplicate=False) if canon[id(v)] != k}
    _merge_tied(exported, param_names, aliases)
    params = [state[n].detach() for n in param_names]
    buffers = [state[n].detach() for n in buffer_names]
    split = _split_loss(exported, _param_nodes(exported, len(param_names))) or _split_mean_cross_entropy(exported)
    if split:
        # one pass: the joint graph is traced from the exported one, decomposing as it goes, and the
        # forward is the part of it the loss needs (tracing the decomposed forward first, then the
        # joint from it, ran every forward op through fake tensors twice)
        joint = _make_joint(exported, len(params), len(buffers))
        fwd = _forward_of(joint, 2)
    else:  # a loss that is a division only once decomposed: decompose, split, then trace the joint
        fwd = _decompose(exported, [n.meta["val"] for n in exported.graph.nodes if n.op == "placeholder"])
        _fold_static_sizes(fwd, len(param_names) + len(buffer_names))
        _normalize_reduce_dims(fwd)
        _squeeze_one_dim(fwd)
        split = _split_loss(fwd, _param_nodes(fwd, len(param_names)))
        fwd = with_code(fwd)  # the passes above edit the graph; its code is written once, here
        joint = _make_joint(fwd, len(params), len(buffers))
    return LogicGraph(
        forward=fwd, joint=joint, param_names=param_names, buffer_names=buffer_names,
        param_shapes={n: p.shape for n, p in zip(param_names, params)},
        param_dtypes={n: p.dtype for n, p in zip(param_names, params)},
        num_inputs=user_inputs, split_loss=split, aliases=aliases,
        seq_symbol=seq_symbol(joint.graph, user_inputs), call=call)


def seq_symbol(graph: fx.Graph, num_inputs: int):
    """The symbol of the sequence dim in `graph`: dim 1 of the first model input of rank >= 2
    (the inputs are the last `num_inputs` placeholders); None when there is none."""
    inputs = [n for n in graph.nodes if n.op == "placeholder"][-num_inputs:]
    for n in inputs:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() >= 2 and isinstance(val.shape[1], torch.SymInt):
            return val.shape[1].node.expr
    return None


def _export(model: torch.nn.Module, example_inputs: tuple, dynamic_dims: dict[int, tuple[int, ...]]):
    """torch.export (non-strict) with the batch and sequence dims dynamic. Inputs of equal example
    sizes first share one `Dim` per dim (ids, positions and labels are all [batch, seq]: 2 symbols,
    not 6, and simpler guards everywhere after); a model that needs them apart gets `Dim.AUTO`."""
    def shapes(shared: bool):
        out = []
        for i, x in enumerate(example_inputs):
            if not isinstance(x, torch.Tensor):
                out.append(None)
                continue
            dims = {}
            for d in dynamic_dims.get(i, ()):
                dims[d] = Dim(f"d{d}_{x.shape[d]}", min=1) if shared else Dim.AUTO
            out.append(dims)
        return (tuple(out),)  # LossModule.forward(*tensors): export binds them to one parameter

    # codeless_modules: export's passes each wrote the code of the graph they edited (5 writings per
    # export), which nothing reads: the exported program's module is written once, at its end
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH), warnings.catch_warnings(), \
            AttentionWhole(), codeless_modules():  # AttentionWhole: attention one op (compiler/attention.py)
        # torch 2.13's own pytree use warns on every export; nothing for the user to act on
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        try:
            return export(model, example_inputs, dynamic_shapes=shapes(True), strict=False)
        except InputError:
            raise
        except Exception:  # noqa: BLE001 - the shared dims were a guess (a size 1 specializes, say): let export infer
            pass
        try:
            return export(model, example_inputs, dynamic_shapes=shapes(False), strict=False)
        except InputError:
            raise
        except Exception as e:  # noqa: BLE001 - said again in the user's terms, torch's error chained
            raise TraceError(explain_trace_error(e, type(getattr(model, "_target", model)).__name__)) from e


class TraceError(ValueError):
    """torch.export could not trace the model; the message names what, where, the usual cause and the fix."""


# (pattern in torch's error, what it means, the usual cause and fix); the first match explains the error
_TRACE_ERRORS = (
    (re.compile(r"data-dependent|GuardOnDataDependent|DataDependentOutput", re.I),
     "the model's Python code depends on a tensor's values",
     "a Python branch on a tensor (`if x.sum() > 0`), or `.item()`, `int(t)`, `.tolist()` deciding a size or a "
     "branch; tracing sees shapes, not values. Fix: compute that value outside the model and pass it in, or keep it "
     "in tensors (torch.where, masks; torch.cond for a branch)"),
    (re.compile(r"\.numpy\(\)|data pointer|doesn't have storage|does not have storage", re.I),
     "the model reads tensor data in Python",
     "`.numpy()`, `.data_ptr()` or a C extension reading a tensor's memory inside forward; tracing runs on fake "
     "tensors that hold no data. Fix: use torch ops there, or do it outside the model"),
    (re.compile(r"Found (<class '[^']+'>) in (?:output|input)|register a pytree|not a known type", re.I),
     "torch.export met an object it cannot flatten",
     "a custom class in the model's inputs or outputs (a Hugging Face KV cache, a dataclass of tensors) that is "
     "not a registered pytree type. Fix: register it (torch.export.register_dataclass, or "
     "torch.utils._pytree.register_pytree_node), keep it out of inputs and outputs, or for a cache pass "
     "use_cache=False"),
    (re.compile(r"UnsupportedOperator|no (?:fake|meta) (?:impl|kernel)|missing a fake kernel|register_fake", re.I),
     "an op without a fake (meta) implementation",
     "a custom op or C++ extension that torch cannot run on fake tensors to learn output shapes. Fix: register one "
     "with torch.library.register_fake, or use built-in torch ops"),
)


def explain_trace_error(e: BaseException, model_name: str) -> str:
    """torch.export's error in the user's terms: what went wrong, the user's source line, the usual
    cause and the fix, then torch's own first line."""
    text = f"{type(e).__name__}: {e}"
    first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
    what, cause = "torch.export failed", (
        "code torch.export cannot follow (see torch's error below). Fix: simplify forward around that line, or "
        "wrap the model so forward(*tensors) returns the loss")
    for pattern, meaning, usual in _TRACE_ERRORS:
        match = pattern.search(text)
        if match:
            what, cause = meaning, usual
            if match.groups() and match.group(1):
                what += f" ({match.group(1)})"
            break
    return (f"hotswitch could not trace {model_name} with torch.export: {what}, at {_user_frame(e)}. "
            f"Usual cause: {cause}. (torch: {first.strip()})")


def _user_frame(e: BaseException) -> str:
    """The model's source line the error came from: the line torch names, else the innermost frame
    outside torch and hotswitch's compiler."""
    named = re.search(r'The following call raised this error:\s*File "([^"]+)", line (\d+), in (\S+)\s*\n\s*(.+)',
                      str(e))
    if named:
        return f"{named.group(1)}:{named.group(2)} in {named.group(3)} (`{named.group(4).strip()}`)"
    here = os.path.dirname(os.path.abspath(__file__))
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if f"{os.sep}torch{os.sep}" not in f.filename and not f.filename.startswith(here)]
    if not frames:
        return "an unknown line (no frame outside torch)"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name} (`{(f.line or '').strip()}`)"


class _LossAsCoreOps(fx.Interpreter):
    """Runs a graph, with a cross-entropy decomposed above autograd: autograd then differentiates its
    core ops (a gather of the log-probabilities, whose backward scatter-adds the gradient), as when
    the forward was decomposed before the joint was traced. Left to autograd, `nll_loss`'s backward
    decomposes into a scatter of -1 into zeros, for which DTensor gathers the token rows over data
    parallelism: exact only with even rows (`sharding.mixes_rows`), where the loss is exact for any."""

    def call_function(self, target, args, kwargs):
        if target is aten.cross_entropy_loss.default:
            call = _cross_entropy_arguments(args, kwargs)
            logits, labels = call["self"], call["target"]
            if logits.dim() == 2 and not labels.is_floating_point() and call["label_smoothing"] == 0.0:
                nll = decomposition_table()[aten.nll_loss_forward.default]
                log_probs = aten._log_softmax.default(logits, 1, False)
                return nll(log_probs, labels, call["weight"], call["reduction"], call["ignore_index"])[0]
        return super().call_function(target, args, kwargs)


def _make_joint(fwd: fx.GraphModule, num_params: int, num_buffers: int) -> fx.GraphModule:
    """The forward and backward as one graph: (params, buffers, inputs) -> (outputs..., grad per
    param...), traced (like `_decompose`) with the forward's own fake values and shape environment.
    A model whose blocks repeat is traced one distinct region at a time and stitched
    (`compiler.regions`); any other as one graph."""
    vals = [n.meta["val"] for n in fwd.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode(vals)
    # the forward's own fake values and shape environment, attention in its math form
    trace_joint = functools.partial(traced_joint, within=lambda: [
        torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH), half_precision_math_attention(),
        fake_mode])
    params, buffers = vals[:num_params], vals[num_params:num_params + num_buffers]
    inputs = vals[num_params + num_buffers:]
    stitched = stitched_or_none(
        fwd, groups=(("params", num_params), ("buffers", num_buffers), ("inputs", len(inputs))),
        takes_grad=tuple(p.is_floating_point() for p in params) + (False,) * (len(vals) - num_params),
        grads_of=tuple(range(num_params)), loss=0, seeded=(), run=_run_forward, trace=trace_joint,
        fake_mode=fake_mode)
    if stitched is not None:
        return tidy_joint(stitched, num_params + num_buffers)

    def joint(params, buffers, inputs):
        outs = _run_forward(fwd, fwd.graph, [*params, *buffers, *inputs])
        target = outs[0]
        grads = torch.autograd.grad(target, params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
        return (*outs, *grads)

    with fake_mode:
        p = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in params]
    return tidy_joint(trace_joint(joint, p, list(buffers), list(inputs)), num_params + num_buffers)


def stitched_or_none(fwd: fx.GraphModule, **how) -> fx.GraphModule | None:
    """`regions.stitched_joint(fwd, **how)`, or None (with a warning) where a region fails to trace
    on its own: tracing by regions is an optimization, and the caller traces the whole graph."""
    try:
        return stitched_joint(fwd, **how)
    except Exception as e:  # noqa: BLE001 - the whole graph is traced instead
        warnings.warn(f"hotswitch: tracing the model one region at a time failed ({type(e).__name__}: "
                      f"{str(e)[:200]}); it is traced as one graph (slower)", stacklevel=3)
        return None


def _run_forward(gm: fx.GraphModule, graph: fx.Graph, args: list):
    """`graph` (`gm`'s, or one reading `gm`'s attributes) run on `args` as a joint graph's forward:
    an Interpreter under preserve_node_meta hands each forward node's source line and module path on
    to the joint graph (error messages and per-block collective counts use them), a cross-entropy
    decomposed above autograd (`_LossAsCoreOps`)."""
    with fx_traceback.preserve_node_meta():
        return _LossAsCoreOps(gm, graph=graph).run(*args)


def traced_joint(fn, *args, within: Callable[[], list] = list) -> fx.GraphModule:
    """`fn(*args)` (a forward and its backward) traced into a graph of core ATen ops, inside the
    context managers `within()` makes. A sharded program may not mutate (an in-place write into a
    view would land in a redistributed copy): a graph that does is traced once more, functionalized."""
    with contextlib.ExitStack() as stack:
        for context in within():
            stack.enter_context(context)
        stack.enter_context(codeless_modules())  # tidy_joint writes the joint's code once, at its end
        gm = make_fx(fn, decomposition_table=decomposition_table(), tracing_mode="fake")(*args)
        if any(is_mutable(n.target) for n in gm.graph.nodes):
            functional = torch.func.functionalize(gm, remove="mutations")
            plain = pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, args)
            gm = make_fx(functional, tracing_mode="fake")(*plain)
    return gm


def tidy_joint(gm: fx.GraphModule, num_static: int) -> fx.GraphModule:
    """A traced joint graph (a model's or a pipeline stage's) made ready to lower: identity slices
    dropped, the first `num_static` inputs' (parameters', buffers') sizes folded, common
    subexpressions merged, reductions' dims spelled out, squeezes DTensor has rules for. The passes
    edit the graph; its code is written once, at the end (each writing cost a tenth of a second at
    8 layers)."""
    _drop_identity_slices(gm)
    _fold_static_sizes(gm, num_static)
    gm = _cse(gm)
    _normalize_reduce_dims(gm)
    _squeeze_one_dim(gm)  # the joint's trace decomposes squeeze.dim again
    return with_code(gm)
