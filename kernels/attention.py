"""Document-causal attention as one op, `torch.ops.hotswitch.document_attention`, whose mask comes
from data (each token's document id and position inside it), never from the tokens' order.

    out = document_attention(q, k, v, positions, documents)   # q [B, H, T, d], k/v [B, Hkv, T, d]

A query attends to the keys of its own document (ids compared over the whole batch, so ids must be
unique per batch) at positions up to its own. Because nothing depends on where a token sits, the
runtime may lay tokens out however context parallelism wants (zigzag chunks, whole documents per
rank) and the same compiled graph stays exact; and since the op stays whole in the LogicGraph (it has
no decomposition), the compiler shards it with its own rule (`hotswitch.compiler.attention`).

Computed per group of documents (`document_groups`): short documents share one call of
`scaled_dot_product_attention` with a block-diagonal mask, a long one is cut into blocks of queries,
each seeing only the keys up to its last position. The backward is an op of its own that recomputes
each group's probabilities (none are kept between forward and backward). Under context parallelism
the runtime installs an implementation that first fetches the keys and values other ranks hold
(`local_implementation`).
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

__all__ = ["GROUP_QUERIES", "AttentionGroups", "document_attention", "document_groups", "from_tokens_first",
           "grouped_attention", "grouped_attention_backward", "groups_for", "keys_values", "local_implementation",
           "masked_attention", "masked_attention_backward", "masked_call", "tokens_first"]

GROUP_QUERIES = 256  # short documents share one call up to this many queries; a long one is cut into
# blocks of this many queries, each attending only to the keys up to its last position (the dense mask
# then wastes at most a block's triangle, not half the document's square)

# An object with forward(q, k, v, positions, documents) and backward(grad, q, k, v, positions,
# documents), set by the runtime while a context-parallel program runs; None: one device's data.
_IMPLEMENTATION: contextvars.ContextVar = contextvars.ContextVar("hotswitch_document_attention", default=None)


@contextlib.contextmanager
def local_implementation(implementation) -> Iterator[None]:
    """Run the op through `implementation` inside the block (the runtime's context parallelism)."""
    token = _IMPLEMENTATION.set(implementation)
    try:
        yield
    finally:
        _IMPLEMENTATION.reset(token)


def document_groups(documents: list[int], positions: list[int], queries: int,
                    group_queries: int = GROUP_QUERIES) -> list[tuple[list[int], list[int]]]:
    """(query indices, key indices) per attention call. Tokens 0..queries-1 are queries and keys,
    the rest keys only (fetched from other ranks). Documents are taken in id order."""
    keys_of: dict[int, list[int]] = {}
    for i, doc in enumerate(documents):
        keys_of.setdefault(doc, []).append(i)
    groups, pending, count = [], [], 0

    def close():
        if pending:
            groups.append(([i for d in pending for i in keys_of[d] if i < queries],
                           [i for d in pending for i in keys_of[d]]))
            pending.clear()

    for doc in sorted({documents[i] for i in range(queries)}):
        mine = sorted((i for i in keys_of[doc] if i < queries), key=positions.__getitem__)
        if len(mine) > group_queries:  # a long document: blocks of queries, each with the keys it sees
            close()
            count = 0
            for b in range(0, len(mine), group_queries):
                block = mine[b:b + group_queries]
                last = positions[block[-1]]
                groups.append((block, [i for i in keys_of[doc] if positions[i] <= last]))
            continue
        if count and count + len(mine) > group_queries:
            close()
            count = 0
        pending.append(doc)
        count += len(mine)
    close()
    return groups


class AttentionGroups:
    """`document_groups` as index tensors and masks, and the permutation that restores the queries'
    order after the groups' outputs are concatenated."""

    def __init__(self, documents: torch.Tensor, positions: torch.Tensor, queries: int,
                 group_queries: int = GROUP_QUERIES):
        doc_list, pos_list = documents.tolist(), positions.tolist()
        self.groups = []
        order = []
        for q, k in document_groups(doc_list, pos_list, queries, group_queries):
            q, k = torch.tensor(q, dtype=torch.long), torch.tensor(k, dtype=torch.long)
            mask = (documents[q, None] == documents[None, k]) & (positions[None, k] <= positions[q, None])
            self.groups.append((q, k, mask))
            order.append(q)
        self.restore = torch.empty(queries, dtype=torch.long)
        if order:
            self.restore[torch.cat(order)] = torch.arange(queries)

    def to(self, device: torch.device) -> AttentionGroups:
        if self.restore.device != device:
            self.groups = [(q.to(device), k.to(device), m.to(device)) for q, k, m in self.groups]
            self.restore = self.restore.to(device)
        return self


def grouped_attention(q: torch.Tensor, kv: torch.Tensor, groups: AttentionGroups) -> torch.Tensor:
    """q [n, heads, d] (the queries), kv [m, 2, kv_heads, d] (keys and values; the first n are the
    queries' own tokens) -> [n, heads, d]."""
    gqa = q.shape[1] != kv.shape[2]
    outs = []
    for qi, ki, mask in groups.groups:
        k, v = kv[ki].unbind(1)
        y = F.scaled_dot_product_attention(q[qi].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, enable_gqa=gqa)
        outs.append(y.transpose(0, 1))
    if not outs:
        return q.new_empty(0, q.shape[1], kv.shape[-1])
    return torch.cat(outs)[groups.restore]


def grouped_attention_backward(q: torch.Tensor, kv: torch.Tensor, groups: AttentionGroups,
                               grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of `grouped_attention` by its formulas, group by group (recomputing each group's
    probabilities): dq [n, heads, d] and dkv [m, 2, kv_heads, d]. Explicit rather than autograd
    because an op's implementation runs below autograd."""
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):  # probabilities and their gradients in fp32, as SDPA does
        q, kv, grad = q.float(), kv.float(), grad.float()
    heads, kv_heads, d = q.shape[1], kv.shape[2], q.shape[2]
    rep, scale = heads // kv_heads, d ** -0.5
    dq, dkv = torch.zeros_like(q), torch.zeros_like(kv)
    for qi, ki, mask in groups.groups:
        qg, go = q[qi].transpose(0, 1), grad[qi].transpose(0, 1)  # [heads, nq, d]
        k, v = (t.transpose(0, 1).repeat_interleave(rep, dim=0) for t in kv[ki].unbind(1))  # [heads, nk, d]
        p = torch.softmax((qg @ k.transpose(1, 2) * scale).masked_fill(~mask, float("-inf")), dim=-1)
        dp = go @ v.transpose(1, 2)
        ds = p * (dp - (go * (p @ v)).sum(-1, keepdim=True))
        dq[qi] = (ds @ k * scale).transpose(0, 1)
        dk = (ds.transpose(1, 2) @ qg * scale).view(kv_heads, rep, -1, d).sum(1)
        dv = (p.transpose(1, 2) @ go).view(kv_heads, rep, -1, d).sum(1)
        dkv.index_add_(0, ki, torch.stack([dk, dv], dim=0).permute(2, 0, 1, 3))
    return dq.to(dtype), dkv.to(dtype)


def _content_key(*tensors: torch.Tensor) -> tuple:
    return tuple((tuple(t.shape), hashlib.blake2b(t.detach().cpu().numpy().tobytes(), digest_size=16).digest())
                 for t in tensors)


_GROUPS: dict[tuple, AttentionGroups] = {}  # content of (documents, positions) -> groups: the last few batches


def groups_for(documents: torch.Tensor, positions: torch.Tensor) -> AttentionGroups:
    """The groups of a batch's flattened tokens, made once per batch: every layer (and the backward)
    sees the same documents and positions, so the Python work runs once, not per call."""
    documents, positions = documents.reshape(-1).cpu(), positions.reshape(-1).cpu()
    key = _content_key(documents, positions)
    groups = _GROUPS.get(key)
    if groups is None:
        while len(_GROUPS) >= 8:
            _GROUPS.pop(next(iter(_GROUPS)))
        groups = _GROUPS[key] = AttentionGroups(documents, positions, documents.numel())
    return groups


def tokens_first(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, d] -> [B*T, H, d]."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def keys_values(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, T, d] keys and values -> [B*T, 2, Hkv, d], the rows `grouped_attention` reads (and a
    context-parallel rank sends)."""
    return torch.stack([tokens_first(k), tokens_first(v)], dim=1)


def from_tokens_first(x: torch.Tensor, batch: int) -> torch.Tensor:
    """[B*T, H, d] -> [B, H, T, d], contiguous."""
    return x.view(batch, -1, *x.shape[1:]).transpose(1, 2).contiguous()


def _one_device(q, k, v, positions, documents):
    groups = groups_for(documents, positions).to(q.device)
    return from_tokens_first(grouped_attention(tokens_first(q), keys_values(k, v), groups), q.shape[0])


@torch.library.custom_op("hotswitch::document_attention", mutates_args=())
def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       documents: torch.Tensor) -> torch.Tensor:
    """Document-causal attention: [B, H, T, d] queries, [B, Hkv, T, d] keys and values (H a multiple
    of Hkv), [B, T] positions and document ids -> [B, H, T, d]."""
    _same_tokens(q, positions, documents)
    implementation = _IMPLEMENTATION.get()
    if implementation is not None:
        return implementation.forward(q, k, v, positions, documents)
    return _one_device(q, k, v, positions, documents)


def _same_tokens(q, positions, documents) -> None:
    """Positions and ids are [B, T] of q's [B, H, T, d]: said to the tracer too, so that their dims
    share q's symbols (a sharded sequence shards them alike)."""
    for t in (positions, documents):
        torch._check(t.dim() == 2, lambda: f"positions and document ids are [batch, tokens], got {tuple(t.shape)}")
        torch._check(t.shape[0] == q.shape[0], lambda: "positions and document ids need q's batch size")
        torch._check(t.shape[1] == q.shape[2], lambda: "positions and document ids need one entry per token of q")


@document_attention.register_fake
def _(q, k, v, positions, documents):
    _same_tokens(q, positions, documents)
    return q.new_empty(*q.shape[:3], v.shape[3])


@torch.library.custom_op("hotswitch::document_attention_backward", mutates_args=())
def document_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                positions: torch.Tensor, documents: torch.Tensor
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k and v, by recomputing the forward."""
    implementation = _IMPLEMENTATION.get()
    if implementation is not None:
        return implementation.backward(grad, q, k, v, positions, documents)
    b = q.shape[0]
    groups = groups_for(documents, positions).to(q.device)
    dq, dkv = grouped_attention_backward(tokens_first(q), keys_values(k, v), groups, tokens_first(grad))
    return from_tokens_first(dq, b), from_tokens_first(dkv[:, 0], b), from_tokens_first(dkv[:, 1], b)


@document_attention_backward.register_fake
def _(grad, q, k, v, positions, documents):  # contiguous, as the implementations return them
    _same_tokens(q, positions, documents)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    q, k, v, positions, documents = ctx.saved_tensors
    dq, dk, dv = document_attention_backward(grad.contiguous(), q, k, v, positions, documents)
    return dq, dk, dv, None, None


document_attention.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------ masked attention, kept whole


def _attend(q, k, v, mask, scale, causal):
    if causal and q.shape[2] == k.shape[2]:  # every query here: torch's causal flash kernel, no mask read
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    if k.shape[1] != q.shape[1]:  # grouped queries: torch's fused kernels that take a mask want equal heads
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@torch.library.custom_op("hotswitch::masked_attention", mutates_args=())
def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float, causal: bool) -> torch.Tensor:
    """`scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)` as one op of the
    LogicGraph: [B, H, Tq, d] queries, [B, Hkv, Tk, d] keys and values (H a multiple of Hkv), a 4-D
    mask broadcastable to [B, H, Tq, Tk] (bool: True attends; float: added to the scores). Traced
    whole (`hotswitch.compiler.attention.AttentionWhole`), it runs torch's fused kernel at run time
    (cuDNN, flash or memory-efficient attention on a GPU, the flash kernel on a CPU) where the math
    decomposition materialised the [B, H, Tq, Tk] scores and their softmax several times over. `causal`: the mask is
    the causal one (`masked_call` wrote it), so where a rank holds every query, torch's causal kernel
    runs without reading it; a rank holding a shard of the queries reads its rows of the mask."""
    return _attend(q, k, v, mask, scale, causal).contiguous()


@masked_attention.register_fake
def _(q, k, v, mask, scale, causal):
    return q.new_empty(*q.shape[:3], v.shape[3])


def _autograd_below_op():
    """Autograd back on inside an op's implementation, which the dispatcher runs with the autograd keys
    excluded; every other exclusion (autocast off, say) stays. torch's private dispatch-key guard: the
    one private torch call of this package."""
    C = torch._C
    exclude = C._dispatch_tls_local_exclude_set()
    for key in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView"):
        exclude = exclude.remove(getattr(C.DispatchKey, key))
    return C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude)


@torch.library.custom_op("hotswitch::masked_attention_backward", mutates_args=())
def masked_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              mask: torch.Tensor, scale: float, causal: bool
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k and v by torch's backward of the fused kernel, its forward recomputed: only q,
    k, v and the mask are kept between forward and backward. A program's runtime replaces the pair
    by torch's kernels and their own backward where it can (`hotswitch.compiler.attention.fused_kernels`);
    this runs where it cannot (a pipeline stage's backward program). Plain autograd inside the op (its
    implementation runs below the autograd of the graph that calls it; functorch's vjp, tried first,
    broke under Inductor)."""
    with _autograd_below_op(), torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = _attend(q, k, v, mask, scale, causal)
        return tuple(g.contiguous() for g in torch.autograd.grad(out, (q, k, v), grad))


@masked_attention_backward.register_fake
def _(grad, q, k, v, mask, scale, causal):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _masked_setup_context(ctx, inputs, output):
    q, k, v, mask, scale, causal = inputs
    ctx.save_for_backward(q, k, v, mask)
    ctx.scale, ctx.causal = scale, causal


def _masked_backward(ctx, grad):
    q, k, v, mask = ctx.saved_tensors
    dq, dk, dv = masked_attention_backward(grad.contiguous(), q, k, v, mask, ctx.scale, ctx.causal)
    return dq, dk, dv, None, None, None


masked_attention.register_autograd(_masked_backward, setup_context=_masked_setup_context)


def masked_call(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The arguments of `masked_attention` for a `scaled_dot_product_attention` call that it computes
    exactly, else None (dropout, a mask that takes gradients, tensors that are not [B, H, T, d], heads
    that do not group). A causal call gets its mask written out (top-left aligned, as torch's
    `is_causal`): the mask carries every query's position, so a shard of the queries stays exact."""
    if (dropout_p or query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or (is_causal and attn_mask is not None)
            or (attn_mask is not None and (attn_mask.requires_grad or attn_mask.dim() > 4))
            or query.shape[1] % key.shape[1] or (query.shape[1] != key.shape[1] and not enable_gqa)):
        return None
    if is_causal:
        rows = torch.arange(query.shape[2], device=query.device)
        cols = torch.arange(key.shape[2], device=query.device)
        attn_mask = (rows[:, None] >= cols[None, :])
    if attn_mask is None:
        attn_mask = torch.ones(1, 1, 1, key.shape[2], dtype=torch.bool, device=query.device)
    while attn_mask.dim() < 4:  # broadcast from the right, as SDPA does
        attn_mask = attn_mask.unsqueeze(0)
    scale = float(scale) if scale is not None else query.shape[-1] ** -0.5
    return query, key, value, attn_mask, scale, bool(is_causal)
