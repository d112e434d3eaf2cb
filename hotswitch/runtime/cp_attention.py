"""Document-causal attention under context parallelism: keys and values fetched from the ranks that
hold them, as the token placement says (`hotswitch.distconfig.tokens`: static zigzag, document-aware,
or whatever layout `shard_inputs` chose).

Keys and values move in one all-to-all whose sizes come from the placement (`fetch[r][s]`), so a
document held whole by one rank costs no exchange at all; the backward sends their gradients back
the same way and adds them onto the owners' tokens. Attention itself is
`hotswitch.kernels.attention`'s grouped computation over the local and received tokens. A plan is a
handful of index tensors made once per batch and shared by every layer, so a new batch is new data,
not a new graph.

Two entry points: `cp_attention` (tokens-first tensors and a plan built from a placement; the
benchmark and the tests) and `ContextParallelAttention`, the implementation of
`torch.ops.hotswitch.document_attention` that `CompiledModel` installs while a cp config runs (it
derives the plan from the documents and positions the ranks hold, gathered once per micro-batch).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hotswitch.distconfig.tokens import CPPlacement, Segment, document_fetch, segments_of
from hotswitch.kernels.attention import (
    AttentionGroups,
    from_tokens_first,
    grouped_attention,
    grouped_attention_backward,
    keys_values,
    tokens_first,
)

__all__ = ["CPAttentionPlan", "ContextParallelAttention", "cp_attention"]


@dataclass(frozen=True, eq=False)
class CPAttentionPlan:
    """One rank's share of a placement: which tokens it holds, what it sends to and receives from
    every rank, and its attention groups over its own tokens followed by the received ones."""

    rank: int
    local_index: torch.Tensor  # [n] flat [rows x row_length] index of each local token
    send_index: torch.Tensor  # local tokens sent, grouped by destination rank
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    exchanges: bool  # whether any rank sends anything (every rank takes part in the all-to-all or none)
    groups: AttentionGroups

    @classmethod
    def build(cls, placement: CPPlacement, rank: int) -> CPAttentionPlan:
        """From a placement of a whole batch (`zigzag_placement`, `document_placement`): the rank's
        tokens in the order of its segments."""
        if not 0 <= rank < placement.cp:
            raise ValueError(f"rank {rank} is outside a placement over cp = {placement.cp} ranks")
        local_index = torch.tensor([i for s in placement.segments[rank] for i in placement.flat_index(s)],
                                   dtype=torch.long)
        return cls._make(placement.segments, placement.fetch, rank, local_index)

    @classmethod
    def from_tokens(cls, documents: list[list[int]], positions: list[list[int]], rank: int) -> CPAttentionPlan:
        """From every rank's tokens as they lie (document id and position per token, in local
        order), each rank fetching only what its queries attend to (`document_fetch`)."""
        segments = tuple(segments_of(d, p) for d, p in zip(documents, positions))
        return cls._make(segments, document_fetch(segments), rank, torch.arange(len(documents[rank])))

    @classmethod
    def _make(cls, segments, fetch, rank: int, local_index: torch.Tensor) -> CPAttentionPlan:
        cp, local = len(segments), segments[rank]
        base, at = {}, 0  # (doc, start) of a local segment -> its first local index
        for seg in local:
            base[(seg.doc, seg.start)] = at
            at += len(seg)
        send = [i for dest in range(cp) for seg in fetch[dest][rank]
                for i in range(base[(seg.doc, seg.start)], base[(seg.doc, seg.start)] + len(seg))]
        received: list[Segment] = [seg for source in range(cp) for seg in fetch[rank][source]]
        docs = torch.tensor([s.doc for segs in (local, received) for s in segs for _ in range(len(s))],
                            dtype=torch.long)
        positions = torch.tensor([p for segs in (local, received) for s in segs for p in range(s.start, s.stop)],
                                 dtype=torch.long)
        return cls(
            rank=rank,
            local_index=local_index,
            send_index=torch.tensor(send, dtype=torch.long),
            send_counts=tuple(sum(len(s) for s in fetch[dest][rank]) for dest in range(cp)),
            recv_counts=tuple(sum(len(s) for s in fetch[rank][src]) for src in range(cp)),
            exchanges=any(fetch[r][s] for r in range(cp) for s in range(cp)),
            groups=AttentionGroups(docs, positions, at),
        )

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a [rows, row_length, ...] batch tensor, in local order."""
        return batch.flatten(0, 1)[self.local_index]

    def fetch(self, kv: torch.Tensor, group=None) -> torch.Tensor:
        """The rows other ranks hold that this rank's queries need (one all-to-all)."""
        received = kv.new_empty(sum(self.recv_counts), *kv.shape[1:])
        dist.all_to_all_single(received, kv[self.send_index].contiguous(), list(self.recv_counts),
                               list(self.send_counts), group=group)
        return received

    def return_grads(self, grad_received: torch.Tensor, grad_local: torch.Tensor, group=None) -> torch.Tensor:
        """Send the gradients of fetched rows back to their owners; add the ones we get onto ours."""
        grad_sent = grad_received.new_empty(sum(self.send_counts), *grad_received.shape[1:])
        dist.all_to_all_single(grad_sent, grad_received.contiguous(), list(self.send_counts),
                               list(self.recv_counts), group=group)
        return grad_local.index_add(0, self.send_index.to(grad_local.device), grad_sent)


class _ExchangeKeysValues(torch.autograd.Function):
    """Forward: fetch the rows this rank needs. Backward: their gradients go back to the owners."""

    @staticmethod
    def forward(ctx, kv, plan: CPAttentionPlan, group):
        ctx.plan, ctx.group = plan, group
        return plan.fetch(kv, group)

    @staticmethod
    def backward(ctx, grad_received):
        zeros = grad_received.new_zeros(ctx.plan.local_index.numel(), *grad_received.shape[1:])
        return ctx.plan.return_grads(grad_received, zeros, ctx.group), None, None


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CPAttentionPlan, group=None) -> torch.Tensor:
    """Exact document-causal attention of this rank's tokens: q [n, heads, d], k and v
    [n, kv_heads, d] (grouped-query when fewer) -> [n, heads, d]. Every rank of `group` calls it
    with its plan of the same placement. Differentiable (autograd through the exchange)."""
    n = k.shape[0]
    if q.shape[0] != n or n != plan.local_index.numel():
        raise ValueError(f"rank {plan.rank} holds {plan.local_index.numel()} tokens under this placement, "
                         f"got q of {q.shape[0]} and k of {n}; shard the batch with plan.shard")
    kv = torch.stack([k, v], dim=1)
    if plan.exchanges:
        kv = torch.cat([kv, _ExchangeKeysValues.apply(kv, plan, group)])
    return grouped_attention(q, kv, plan.groups.to(q.device))


class ContextParallelAttention:
    """`document_attention` on a cp rank's shard: q, k, v [B, heads, T/cp, d] and positions and
    document ids [B, T/cp] of the tokens this rank holds. The plan comes from every rank's ids and
    positions, so it holds for any layout of the tokens. One instance serves one step
    (`CompiledModel` makes it per call): the first op call gathers the ids and positions (one
    all-gather of two small int tensors) and every later call with the same input tensors (the
    other layers, the backward) reuses the plan; a pipeline's next micro-batch brings new tensors,
    at the same call on every rank, so the ranks gather together. The backward fetches the keys and
    values again (nothing is kept between the two ops) and returns their gradients to the owners.
    `lengths`: each cp rank's positions per row where they differ (a length cp does not divide, cut
    as torch.chunk cuts it); None: all alike."""

    def __init__(self, group, lengths: tuple[int, ...] | None = None):
        self.group = group
        self.lengths = lengths
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._last: tuple[torch.Tensor, torch.Tensor, CPAttentionPlan] | None = None
        self.gathers = 0  # all-gathers of ids and positions issued (one per micro-batch)

    def _plan(self, positions: torch.Tensor, documents: torch.Tensor) -> CPAttentionPlan:
        if self._last is not None and self._last[0] is documents and self._last[1] is positions:
            return self._last[2]
        local = torch.stack([documents.reshape(-1), positions.reshape(-1)]).to(torch.long)
        rows = documents.shape[0]
        widest = rows * max(self.lengths) if self.lengths else local.shape[1]
        if local.shape[1] < widest:  # every rank's tokens padded to the most any holds, for one all-gather
            local = torch.nn.functional.pad(local, (0, widest - local.shape[1]), value=-1)
        gathered = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(gathered, local.contiguous(), group=self.group)
        self.gathers += 1
        counts = tuple(rows * n for n in self.lengths) if self.lengths else None
        plan = _plan_from_gathered(torch.stack(gathered).cpu().numpy().tobytes(), self.size, self.rank, counts)
        self._last = (documents, positions, plan)  # the tensors are held, so their identity is not reused
        return plan

    def forward(self, q, k, v, positions, documents):
        plan = self._plan(positions, documents)
        kv = keys_values(k, v)
        if plan.exchanges:
            kv = torch.cat([kv, plan.fetch(kv, self.group)])
        return from_tokens_first(grouped_attention(tokens_first(q), kv, plan.groups.to(q.device)), q.shape[0])

    def backward(self, grad, q, k, v, positions, documents):
        plan, b = self._plan(positions, documents), q.shape[0]
        kv_local = keys_values(k, v)
        kv = torch.cat([kv_local, plan.fetch(kv_local, self.group)]) if plan.exchanges else kv_local
        dq, dkv = grouped_attention_backward(tokens_first(q), kv, plan.groups.to(q.device), tokens_first(grad))
        n = kv_local.shape[0]
        dkv_local = plan.return_grads(dkv[n:], dkv[:n], self.group) if plan.exchanges else dkv
        grads = from_tokens_first(dq, b), from_tokens_first(dkv_local[:, 0], b), from_tokens_first(dkv_local[:, 1], b)
        # a rank holding no positions (a length cp does not divide) has empty views of one tensor, which
        # an op may not return together
        return tuple(g.clone() if g.numel() == 0 else g for g in grads)


@functools.lru_cache(maxsize=4)
def _plan_from_gathered(key: bytes, size: int, rank: int, counts: tuple[int, ...] | None = None) -> CPAttentionPlan:
    """The plan from every rank's (ids, positions), padded to one width; `counts`: how many tokens
    of each are real (None: all)."""
    rows = torch.frombuffer(bytearray(key), dtype=torch.long).view(size, 2, -1)
    counts = counts or (rows.shape[2],) * size
    return CPAttentionPlan.from_tokens([r[0, :n].tolist() for r, n in zip(rows, counts)],
                                       [r[1, :n].tolist() for r, n in zip(rows, counts)], rank)
