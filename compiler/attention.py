"""The sharding rules of hotswitch's attention ops (`hotswitch.kernels.attention`), next to DTensor's
strategies for aten ops, and `AttentionWhole`, which keeps a model's `scaled_dot_product_attention`
whole while it is traced.

`masked_attention` (and its backward), per mesh dim, runs replicated; on a shard of the batch; on a
shard of the heads (when the mesh dim divides both head counts); or on a shard of the queries (the
mask's rows with them, keys and values whole, their gradients partial sums): the mask says where
each query sits, so a sequence shard needs no offset. That last one is how context parallelism runs
a causal model's attention, as DTensor runs the math decomposition (mask rows sliced, keys gathered).
A lowered program's op pairs are written as torch's own fused kernels for the device it runs on
(`fuse_attention`: when it is lowered, or at run time by `fused_kernels`).

`document_attention` (and its backward), per mesh dim, runs

- replicated;
- on a shard of the batch (dim 0 of everything);
- on a shard of the heads (dim 1 of q, k, v and the output; positions and ids whole): tensor
  parallelism, when the mesh dim divides both head counts;
- on a shard of the sequence (dim 2 of q, k, v and the output, dim 1 of positions and ids): context
  parallelism, on the mesh dim named "cp" only, because there the runtime installs the
  implementation that fetches other ranks' keys and values (`hotswitch.runtime.cp_attention`).
  Anywhere else (sp's sequence shards on the tp axis) a sharded sequence is gathered first.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hotswitch.kernels import attention as _kernel

from . import _dtensor as dt
from . import _torch
from ._torch import copied_graph, graph_module, map_args, meta_like
from .garbage import collector_paused

__all__ = ["ATTENTION_OPS", "MASKED_OPS", "AttentionWhole", "FusedSite", "fuse_attention", "fused_kernels",
           "kernels_hold", "register"]

aten = torch.ops.aten

ATTENTION_OPS = (_kernel.document_attention._opoverload, _kernel.document_attention_backward._opoverload)
MASKED_OPS = (_kernel.masked_attention._opoverload, _kernel.masked_attention_backward._opoverload)


class AttentionWhole(TorchFunctionMode):
    """While a model is exported: its `F.scaled_dot_product_attention` calls become `masked_attention`,
    one op of the LogicGraph, where the op computes them exactly (`masked_call`; a causal call gets
    its mask written out). Other calls (dropout, a mask that takes gradients) are decomposed as before."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            call = _kernel.masked_call(*args, **kwargs)
            if call is not None:
                return _kernel.masked_attention(*call)
        return func(*args, **kwargs)


def _mask_along(mask_spec, dim: int, sharded):
    """The mask's placement where q is sharded on `dim`: sharded alike, unless it broadcasts there."""
    return sharded if mask_spec.shape[dim] > 1 else dt.Replicate()


def _masked_forward_strategies(op_schema):
    r, s0, s1, s2 = dt.Replicate(), dt.Shard(0), dt.Shard(1), dt.Shard(2)
    mask = op_schema.args_schema[3]
    #        out q   k   v   mask
    return [[r, r, r, r, r],
            [s0, s0, s0, s0, _mask_along(mask, 0, s0)],
            [s1, s1, s1, s1, _mask_along(mask, 1, s1)],
            [s2, s2, r, r, _mask_along(mask, 2, s2)]]


def _masked_backward_strategies(op_schema):
    r, s0, s1, s2, p = dt.Replicate(), dt.Shard(0), dt.Shard(1), dt.Shard(2), dt.Partial()
    mask = op_schema.args_schema[4]
    #        dq  dk  dv  grad q   k   v   mask
    return [[r, r, r, r, r, r, r, r],
            [s0, s0, s0, s0, s0, s0, s0, _mask_along(mask, 0, s0)],
            [s1, s1, s1, s1, s1, s1, s1, _mask_along(mask, 1, s1)],
            [s2, p, p, s2, s2, r, r, _mask_along(mask, 2, s2)]]


def _heads_divide(mesh, input_specs, output_spec) -> bool:
    """Heads (dim 1 of q, k, v) sharded only where the mesh dim divides both head counts: grouped
    queries map query head h to key head h // (H / Hkv), which holds shard by shard only then."""
    heads = [spec.tensor_meta.shape[1] for spec in input_specs[:-1]]  # the mask last
    return all(not (p.is_shard() and p.dim == 1) or all(h % mesh.size(i) == 0 for h in heads)
               for i, p in enumerate(input_specs[0].placements))


def _forward_strategies(op_schema):
    r, s0, s1, s2 = dt.Replicate(), dt.Shard(0), dt.Shard(1), dt.Shard(2)
    #        out  q   k   v   positions ids
    return [[r, r, r, r, r, r],
            [s0, s0, s0, s0, s0, s0],
            [s1, s1, s1, s1, r, r],
            [s2, s2, s2, s2, s1, s1]]


def _backward_strategies(op_schema):
    r, s0, s1, s2 = dt.Replicate(), dt.Shard(0), dt.Shard(1), dt.Shard(2)
    #        dq  dk  dv  grad q   k   v   positions ids
    return [[r, r, r, r, r, r, r, r, r],
            [s0, s0, s0, s0, s0, s0, s0, s0, s0],
            [s1, s1, s1, s1, s1, s1, s1, r, r],
            [s2, s2, s2, s2, s2, s2, s2, s1, s1]]


def _sequence_only_on_cp(mesh, input_specs, output_spec) -> bool:
    """The sequence (dim 2 of the first input, q or grad) may be sharded only over "cp"."""
    names = mesh.mesh_dim_names or ()
    first = input_specs[0]
    return all(not (p.is_shard() and p.dim == 2) or (i < len(names) and names[i] == "cp")
               for i, p in enumerate(first.placements))


_registered = False


def register() -> None:
    """Register the rules with DTensor's propagator (once per process)."""
    global _registered
    if not _registered:
        forward, backward = ATTENTION_OPS
        dt.register_mesh_dim_strategies(forward, _forward_strategies, 1, _sequence_only_on_cp)
        dt.register_mesh_dim_strategies(backward, _backward_strategies, 3, _sequence_only_on_cp)
        forward, backward = MASKED_OPS
        dt.register_mesh_dim_strategies(forward, _masked_forward_strategies, 1, _heads_divide)
        dt.register_mesh_dim_strategies(backward, _masked_backward_strategies, 3, _heads_divide)
        _registered = True


# ------------------------------------------------------------------ at run time: torch's own kernels

@collector_paused()  # a program's graph copied, edited and its code written (see compiler.garbage)
def fused_kernels(gm: fx.GraphModule, device: torch.device, for_inductor: bool = False) -> fx.GraphModule:
    """`gm`, a lowered program about to run on `device`, with each `masked_attention` written as the
    fused kernel `scaled_dot_product_attention` picks for its local shapes there (`fuse_attention`),
    on a copy of its graph: what the runner does for a program lowered without its kernels (a
    pipeline stage's forward or backward, cut apart after lowering; one lowered for no runner). A
    program lowered for the runner has them already (`lower.lower`), and so do the programs fitted
    from it where they hold (`kernels_hold`). Returns `gm` when nothing changes."""
    if not any(n.target is MASKED_OPS[0] for n in gm.graph.nodes):
        return gm
    graph = copied_graph(gm.graph)
    if not fuse_attention(graph, device, for_inductor):
        return gm
    out = graph_module(gm, graph)
    out.meta.update(gm.meta)
    return out


def fuse_attention(graph: fx.Graph, device: torch.device, for_inductor: bool = False, keep_meta: tuple = ()) -> int:
    """Write each `masked_attention` of `graph` (in place) as the fused kernel SDPA picks for its
    local shapes on `device`, and the op's backward, where the same graph holds it, as that kernel's
    own backward reading the forward's output and logsumexp. The op's backward recomputes its forward
    under autograd (an op's implementation keeps nothing but its inputs); here the forward's
    logsumexp is kept, as torch's own SDPA autograd keeps it, and no Python runs between the kernels
    (Inductor sees torch's attention ops, which it knows). Where SDPA would take its math path, the
    op stays. The kernel depends on the device and the concrete shapes: each forward kernel's node
    says what it was chosen from (`meta["sdpa"]`), for `kernels_hold` to check at another length.
    `keep_meta`: the keys of an op's meta its kernels' nodes take (a program's source line, phase).
    Returns how many forward ops were written.

    `for_inductor` on CUDA: fp32 attention keeps the op. Compiled by Inductor (torch 2.11, H100), an
    fp32 program with the memory-efficient kernel (fp32's only fused one) failed a later Triton
    launch with "CUDA driver error: invalid argument"; eager, and bf16 under Inductor, were exact."""
    forwards = [n for n in graph.nodes if n.target is MASKED_OPS[0]]
    backwards = {tuple(n.args[1:5]): n for n in graph.nodes if n.target is MASKED_OPS[1]}
    changed, choices = 0, {}
    for forward in forwards:
        backward = backwards.get(tuple(forward.args[:4]))
        if backward is not None and any(u.target is not operator.getitem for u in backward.users):
            backward = None
        if for_inductor and device.type == "cuda" and forward.args[0].meta["val"].dtype == torch.float32:
            continue
        changed += _write_fused(graph, forward, backward, device, choices, keep_meta)
    return changed


@dataclass(frozen=True)
class FusedSite:
    """What a fused attention kernel was chosen from (its forward node's `meta["sdpa"]`): the nodes
    of q, k and the mask by name, the op's scale and causality, whether it trains, the device, and
    the choice: SDPA's kernel, the causal kernel with the mask unread (`whole`), the mask padded to
    8-aligned rows (the memory-efficient kernel's)."""

    q: str
    k: str
    mask: str
    scale: float
    causal: bool
    train: bool
    device: str
    backend: str
    whole: bool
    padded: bool


def _choice(qv, kv, mv, causal: bool, scale: float, train: bool, device: torch.device, choices: dict) -> tuple:
    """(SDPA's kernel, whole, padded) for meta values q, k, mask: what `_write_fused` writes."""
    whole = causal and qv.shape[2] == kv.shape[2]  # every query here: the causal kernel, the mask unread
    backend = _sdpa_backend(qv, kv, mv, whole, scale, train, device, choices)
    return backend, whole, backend == "efficient" and not whole and kv.shape[2] % 8 != 0


def _said(backend: str, whole: bool, padded: bool) -> str:
    return f"{backend} kernel ({'causal' if whole else 'masked'}{', its mask padded' if padded else ''})"


def kernels_hold(sites, value) -> str | None:
    """None when each fused attention kernel of a program written at another length from a fit (its
    forward nodes' `sites`, FusedSites; `value(name)`: a node's meta value at this length, None where
    there is no such node) is still the one `fuse_attention` would write here, else why not (SDPA
    picks another kernel here, or the mask needs other padding)."""
    choices = {}
    for site in sites:
        q, k = value(site.q), value(site.k)
        mask = value(site.mask)  # unread by a causal kernel
        if mask is None and not (site.causal and q.shape[2] == k.shape[2]):
            return (f"attention at {list(q.shape)} needs its mask here, which the causal kernel of the fitted "
                    "lengths dropped")
        now = _choice(q, k, mask, site.causal, site.scale, site.train, torch.device(site.device), choices)
        if now != (site.backend, site.whole, site.padded):
            return (f"attention at {list(q.shape)} takes SDPA's {_said(*now)} here, not the "
                    f"{_said(site.backend, site.whole, site.padded)} of the fitted lengths")
    return None


# (forward, backward) aten ops per (device type, SDPA backend); `_write_fused` says what each takes
_KERNELS = {
    ("cpu", "flash"): (aten._scaled_dot_product_flash_attention_for_cpu.default,
                       aten._scaled_dot_product_flash_attention_for_cpu_backward.default),
    ("cuda", "flash"): (aten._scaled_dot_product_flash_attention.default,
                        aten._scaled_dot_product_flash_attention_backward.default),
    ("cuda", "efficient"): (aten._scaled_dot_product_efficient_attention.default,
                            aten._scaled_dot_product_efficient_attention_backward.default),
    ("cuda", "cudnn"): (aten._scaled_dot_product_cudnn_attention.default,
                        aten._scaled_dot_product_cudnn_attention_backward.default),
}


def _sdpa_backend(q, k, mask, whole: bool, scale: float, train: bool, device: torch.device, choices: dict) -> str:
    """SDPA's kernel for example inputs like the meta values q, k (keys repeated to q's heads) and
    the mask (None: `whole`, the causal kernel, which reads none), on `device`; asked once per
    distinct layout (the layers of a model share one)."""
    key = tuple(None if t is None else (tuple(t.shape), t.stride(), t.dtype) for t in (q, k, mask))
    key += (whole, scale, train)
    if key not in choices:
        batch, heads, _, dim = q.shape
        keys = k.shape[2]

        def example(shape, stride, dtype):
            return torch.empty_strided(shape, stride, dtype=dtype, device=device).requires_grad_(train)

        k_example = example((batch, heads, keys, dim), (heads * keys * dim, keys * dim, dim, 1), k.dtype)
        mask_example = None
        if not whole:
            stored = [size if stride else 1 for size, stride in zip(mask.shape, mask.stride())]  # broadcast dims: 1
            # (the choice reads the mask's shape, strides and dtype, never its values: an untouched
            # allocation, where zeros wrote T x T values: 2 GiB of bf16 at 32K tokens, resident)
            mask_example = torch.empty(stored, dtype=q.dtype, device=device).expand(mask.shape)
        choices[key] = _torch.sdpa_backend(example(q.shape, q.stride(), q.dtype), k_example, k_example, mask_example,
                                           whole, scale)
    return choices[key]


def _write_fused(graph: fx.Graph, forward: fx.Node, backward: fx.Node | None, device: torch.device,
                 choices: dict, keep_meta: tuple = ()) -> bool:
    q, k, v, mask, scale, causal = forward.args
    qv, kv, mv = q.meta["val"], k.meta["val"], mask.meta["val"]
    batch, heads, queries, dim = qv.shape
    kv_heads, keys = kv.shape[1], kv.shape[2]
    rep = heads // kv_heads
    train = backward is not None
    backend, whole, padded = _choice(qv, kv, mv, causal, scale, train, device, choices)
    kernels = _KERNELS.get((device.type, backend))
    if kernels is None or (backend == "flash" and device.type == "cuda" and (not whole or dim % 8)):
        return False  # SDPA's math path (or a kernel without a mask where one is needed): the op stays
    source = forward  # whose meta the nodes written take: the forward op's, then the backward's

    def made(target, args, kwargs, val) -> fx.Node:  # a node, with the meta kept of its op's
        node = graph.call_function(target, args, kwargs)
        node.meta.update((key, source.meta[key]) for key in keep_meta if key in source.meta)
        node.meta["val"] = val
        return node

    def call(target, *args, **kwargs) -> fx.Node:
        meta = lambda a: meta_like(a.meta["val"]) if isinstance(a, fx.Node) else a  # noqa: E731
        return made(target, args, kwargs, target(*map_args(meta, args), **map_args(meta, kwargs)))  # meta kernels

    def item(node, i) -> fx.Node:
        return made(operator.getitem, (node, i), {}, node.meta["val"][i])

    def repeated(t):
        return call(aten.repeat_interleave.self_int, t, rep, 1) if rep > 1 else t

    def bias():  # SDPA's own preparation of the mask for this kernel, written per call (it is transient)
        if whole:
            return None
        b = mask
        if mv.dtype == torch.bool:
            b = call(aten.where.Scalar, mask, 0.0, -65504.0 if backend == "cudnn" else float("-inf"))
            if qv.dtype != b.meta["val"].dtype:
                b = call(aten._to_copy.default, b, dtype=qv.dtype)
        if backend == "efficient":  # rows 8-aligned, broadcast dims expanded
            if padded:
                b = call(aten.slice.Tensor, call(aten.constant_pad_nd.default, b, [0, 8 - keys % 8]), -1, 0, keys)
            b = call(aten.expand.default, b, [batch, heads, queries, keys])
        return b

    forward_op, backward_op = kernels
    with graph.inserting_before(forward):
        kr, vr = repeated(k), repeated(v)
        if backend == "flash" and device.type == "cpu":
            fused = call(forward_op, q, kr, vr, 0.0, whole, attn_mask=bias(), scale=scale)
        elif backend == "flash":
            fused = call(forward_op, q, kr, vr, 0.0, True, False, scale=scale)
        elif backend == "efficient":
            fused = call(forward_op, q, kr, vr, bias(), True, 0.0, whole, scale=scale)
        else:
            fused = call(forward_op, q, kr, vr, bias(), True, 0.0, whole, False, scale=scale)
        fused.meta["sdpa"] = FusedSite(q.name, k.name, mask.name, scale, causal, train, str(device), backend, whole,
                                       padded)
        out = item(fused, 0)
        forward.replace_all_uses_with(call(aten.contiguous.default, out))
    graph.erase_node(forward)
    if backward is None:
        return True
    grad = backward.args[0]
    source = backward
    with graph.inserting_before(backward):
        kr, vr = repeated(k), repeated(v)  # again: the forward's copies are not kept alive until here
        saved = [item(fused, i) for i in range(1, len(fused.meta["val"]))]
        if backend == "flash" and device.type == "cpu":
            grads = call(backward_op, grad, q, kr, vr, out, saved[0], 0.0, whole, attn_mask=bias(), scale=scale)
        elif backend == "flash":  # lse, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused
            grads = call(backward_op, grad, q, kr, vr, out, *saved[:5], 0.0, True, *saved[5:7], scale=scale)
        elif backend == "efficient":  # lse, philox seed and offset
            grads = call(backward_op, grad, q, kr, vr, bias(), out, *saved[:3], 0.0, [True, True, True, False], whole,
                         scale=scale)
        else:  # lse, cum_seq_q, cum_seq_k, max_q, max_k, philox seed and offset
            grads = call(backward_op, grad, q, kr, vr, out, saved[0], *saved[5:7], bias(), *saved[1:5], 0.0, whole,
                         scale=scale)
        for node in saved:  # the outputs this kernel's backward does not read
            if not node.users:
                graph.erase_node(node)
        results = [call(aten.contiguous.default, item(grads, 0))]
        for i in (1, 2):  # grouped queries: each key head's gradient is the sum over its query heads
            g = item(grads, i)
            results.append(call(aten.sum.dim_IntList, call(aten.view.default, g, [batch, kv_heads, rep, keys, dim]),
                                [2]) if rep > 1 else call(aten.contiguous.default, g))
    for user in list(backward.users):
        user.replace_all_uses_with(results[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(backward)
    return True
