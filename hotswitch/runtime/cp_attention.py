"""Document-causal attention of packed rows under context parallelism, the token placement taken
as data (`hotswitch.distconfig.tokens`: static zigzag or document-aware).

Each rank holds the tokens of its segments. Keys and values move in one all-to-all whose sizes come
from the placement (`fetch[r][s]`), so a document held whole by one rank costs no exchange at all;
the backward returns their gradients the same way and adds them onto the owners' tokens. Attention
is then computed per group of documents with a [queries, keys] mask built from the documents and
positions: causal inside a document, nothing across. The plan is a handful of index tensors made
once per batch and shared by every layer, so a new batch is new data, not a new graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hotswitch.distconfig.tokens import CPPlacement

__all__ = ["AttentionGroup", "CPAttentionPlan", "cp_attention"]

GROUP_QUERIES = 256  # short documents share one attention call up to this many queries; a long one is cut
# into blocks of this many queries, each attending only to the keys up to its last position (so the dense
# mask wastes at most a block's triangle, not half the document's square)


@dataclass(frozen=True, eq=False)
class AttentionGroup:
    """Documents attended in one call: queries (local token indices), keys (indices into the local
    tokens followed by the received ones) and the mask between them (True = attend)."""

    queries: torch.Tensor
    keys: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True, eq=False)
class CPAttentionPlan:
    """One rank's share of a `CPPlacement`: which batch tokens it holds, what it sends to and
    receives from every rank, and its attention groups."""

    rank: int
    local_index: torch.Tensor  # [n] flat [rows x row_length] index of each local token
    positions: torch.Tensor  # [n] position of each local token inside its document
    send_index: torch.Tensor  # local tokens sent, grouped by destination rank
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    exchanges: bool  # whether any rank sends anything (every rank takes part in the all-to-all or none)
    groups: tuple[AttentionGroup, ...]
    restore: torch.Tensor  # the groups' outputs, concatenated, indexed by this give the local order

    @classmethod
    def build(cls, placement: CPPlacement, rank: int, group_queries: int = GROUP_QUERIES) -> CPAttentionPlan:
        cp = placement.cp
        if not 0 <= rank < cp:
            raise ValueError(f"rank {rank} is outside a placement over cp = {cp} ranks")
        local = placement.segments[rank]
        base, at = {}, 0  # (doc, start) of a local segment -> its first local index
        for seg in local:
            base[(seg.doc, seg.start)] = at
            at += len(seg)
        send = []
        for dest in range(cp):
            send.extend(i for seg in placement.fetch[dest][rank] for i in range(base[(seg.doc, seg.start)],
                                                                               base[(seg.doc, seg.start)] + len(seg)))
        received = [seg for source in range(cp) for seg in placement.fetch[rank][source]]
        docs = [s.doc for segs in (local, received) for s in segs for _ in range(len(s))]
        position = [p for segs in (local, received) for s in segs for p in range(s.start, s.stop)]
        positions = torch.tensor(position, dtype=torch.long)
        n = at
        keys_of: dict[int, list[int]] = {}  # doc -> indices of its keys (local first, then received)
        for i, doc in enumerate(docs):
            keys_of.setdefault(doc, []).append(i)
        doc_ids = torch.tensor(docs, dtype=torch.long)
        groups, order, pending = [], [], []

        def emit(queries: list[int], keys: list[int]):
            q, k = torch.tensor(queries, dtype=torch.long), torch.tensor(keys, dtype=torch.long)
            mask = (doc_ids[q, None] == doc_ids[None, k]) & (positions[None, k] <= positions[q, None])
            groups.append(AttentionGroup(q, k, mask))
            order.append(q)

        def close():
            if pending:
                emit([i for d in pending for i in keys_of[d] if i < n], [i for d in pending for i in keys_of[d]])
                pending.clear()

        count = 0
        for doc in sorted({s.doc for s in local}):
            queries = sorted((i for i in keys_of[doc] if i < n), key=position.__getitem__)
            if len(queries) > group_queries:  # a long document: blocks of queries, each with the keys it sees
                close()
                count = 0
                for b in range(0, len(queries), group_queries):
                    block = queries[b:b + group_queries]
                    last = position[block[-1]]
                    emit(block, [i for i in keys_of[doc] if position[i] <= last])
                continue
            if count and count + len(queries) > group_queries:
                close()
                count = 0
            pending.append(doc)
            count += len(queries)
        close()
        restore = torch.empty(n, dtype=torch.long)
        if order:
            restore[torch.cat(order)] = torch.arange(n)
        return cls(
            rank=rank,
            local_index=torch.tensor([i for s in local for i in placement.flat_index(s)], dtype=torch.long),
            positions=positions[:n],
            send_index=torch.tensor(send, dtype=torch.long),
            send_counts=tuple(sum(len(s) for s in placement.fetch[dest][rank]) for dest in range(cp)),
            recv_counts=tuple(sum(len(s) for s in placement.fetch[rank][src]) for src in range(cp)),
            exchanges=any(placement.fetched_tokens(r) for r in range(cp)),
            groups=tuple(groups),
            restore=restore,
        )

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a [rows, row_length, ...] batch tensor, in local order."""
        return batch.flatten(0, 1)[self.local_index]


class _ExchangeKeysValues(torch.autograd.Function):
    """Forward: send each rank the local key/value rows it fetches, receive ours (one all-to-all).
    Backward: the gradients of the received rows go back to their owners and add onto them."""

    @staticmethod
    def forward(ctx, kv, plan: CPAttentionPlan, group):
        ctx.plan, ctx.group, ctx.rows = plan, group, kv.shape[0]
        received = kv.new_empty(sum(plan.recv_counts), kv.shape[1])
        dist.all_to_all_single(received, kv[plan.send_index].contiguous(), list(plan.recv_counts),
                               list(plan.send_counts), group=group)
        return received

    @staticmethod
    def backward(ctx, grad_received):
        plan = ctx.plan
        grad_sent = grad_received.new_empty(sum(plan.send_counts), grad_received.shape[1])
        dist.all_to_all_single(grad_sent, grad_received.contiguous(), list(plan.send_counts),
                               list(plan.recv_counts), group=ctx.group)
        grad = grad_received.new_zeros(ctx.rows, grad_received.shape[1]).index_add_(0, plan.send_index, grad_sent)
        return grad, None, None


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CPAttentionPlan, group=None) -> torch.Tensor:
    """Exact document-causal attention of this rank's tokens: q [n, heads, d], k and v
    [n, kv_heads, d] (grouped-query when fewer) -> [n, heads, d]. Every rank of `group` calls it
    with its plan of the same placement."""
    n, kv_heads, head_dim = k.shape
    if q.shape[0] != n or n != plan.local_index.numel():
        raise ValueError(f"rank {plan.rank} holds {plan.local_index.numel()} tokens under this placement, "
                         f"got q of {q.shape[0]} and k of {n}; shard the batch with plan.shard")
    kv = torch.cat([k, v], dim=1).reshape(n, 2 * kv_heads * head_dim)
    if plan.exchanges:
        kv = torch.cat([kv, _ExchangeKeysValues.apply(kv, plan, group)])
    kv = kv.view(-1, 2, kv_heads, head_dim)
    gqa = q.shape[1] != kv_heads
    outs = []
    for g in plan.groups:
        kg, vg = kv[g.keys].unbind(1)
        y = F.scaled_dot_product_attention(q[g.queries].transpose(0, 1), kg.transpose(0, 1), vg.transpose(0, 1),
                                           attn_mask=g.mask, enable_gqa=gqa)
        outs.append(y.transpose(0, 1))
    if not outs:
        return q.new_empty(0, q.shape[1], v.shape[2])
    return torch.cat(outs)[plan.restore]
