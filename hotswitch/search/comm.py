"""A config's communication as its compiled ExecGraph issues it, for the cost model to price.

Megatron's rules (4 all-reduces per layer under TP, reduce-scatters and all-gathers under SP) are
what the cost model assumes when nothing is compiled. The compiler's ExecGraphs differ from them
where DTensor's strategy search chose otherwise: k/v heads gathered under tp > kv heads, work
sharded over tokens on the tp ranks (gpt-tiny under tp4: nearly every weight's gradient comes out
partial and is all-reduced whole, then sliced to its shard). A `CommProfile` lists what one ExecGraph really issues, per
collective: kind, bytes, group size and span, and whether it moves an activation (scales with the
micro-batch's tokens) or a gradient (does not). Read once per config at one shape, it prices that
config at every length (`cost.micro_batch_work(..., comm=profile)`).

Which is which is read off the graph's phase: the forward's and backward's collectives count as
activations, the final reduction's (tagged "reduce" by `compiler.lower`) as gradients. A weight
gathered in the forward or a gradient reduced inside the backward would be scaled with the tokens wrongly;
the compiler's pp = 1 graphs reduce every gradient in the final phase.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import fx

from hotswitch.compiler.lower import collective_kind, collectives
from hotswitch.distconfig import Topology

__all__ = ["Collective", "CommProfile", "comm_profile", "compiled_comm_profile", "link_bandwidth", "ring_bytes"]


def link_bandwidth(topology: Topology, span: int) -> float:
    """Bandwidth of a group whose ranks lie within `span` consecutive ranks: the intra-node link when
    they share a node, else the inter-node one (a ring is as slow as its slowest link)."""
    return topology.intra_node_bandwidth if span <= topology.devices_per_node else topology.inter_node_bandwidth


def ring_bytes(kind: str, nbytes: float, group_size: int) -> float:
    """Bytes one rank sends in a ring implementation of collective `kind` over `group_size` ranks
    whose input on each rank is `nbytes` (all-gather: the shard; reduce-scatter, all-reduce: the
    whole tensor)."""
    n = group_size
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if kind == "all_gather":
        return (n - 1) * nbytes
    if kind in ("reduce_scatter", "all_to_all"):
        return (n - 1) / n * nbytes
    return float(nbytes)  # broadcast and anything else: the tensor once


@dataclass(frozen=True, slots=True)
class Collective:
    kind: str  # "all_reduce", "all_gather", "reduce_scatter", "all_to_all", ...
    nbytes: int  # its input on one rank
    group_size: int
    span: int  # the group's ranks lie within this many consecutive ranks (one node or not)
    per_token: bool  # an activation's (forward/backward: scales with tokens) or a gradient reduction's


@dataclass(frozen=True, slots=True)
class CommProfile:
    """The collectives of one config's ExecGraph for a micro-batch of `tokens` tokens per replica."""

    config: str
    tokens: int
    collectives: tuple[Collective, ...]

    def seconds(self, tokens: int, topology: Topology) -> float:
        """The collectives of a micro-batch of `tokens` tokens per replica on `topology`'s links:
        ring bytes over the bandwidth of the link each group spans (latency is counted apart)."""
        scale = tokens / self.tokens
        return sum(ring_bytes(c.kind, c.nbytes, c.group_size) * (scale if c.per_token else 1.0)
                   / link_bandwidth(topology, c.span) for c in self.collectives)


def comm_profile(gm: fx.GraphModule, config: str, tokens: int, groups: Mapping[str, tuple[int, int]]) -> CommProfile:
    """The `CommProfile` of ExecGraph `gm` (config `config`, `tokens` tokens per replica). `groups`:
    process-group name -> (group size, span), for the groups the graph's collectives name (their last
    argument, as torch's functional collectives take it)."""
    out = []
    for node in collectives(gm):
        kind = collective_kind(node)
        value = node.args[0].meta["val"]
        group = node.args[-1]
        if group not in groups:
            raise ValueError(f"collective {node.name} runs on process group {group!r}, which is none of the config's "
                             f"groups {sorted(groups)}")
        size, span = groups[group]
        custom = node.meta.get("custom", {})
        # fsdp's gathers move weights, whatever the phase they serve (`compiler.fsdp`)
        per_token = custom.get("phase") != "reduce" and custom.get("fsdp") != "gather"
        out.append(Collective(kind, value.numel() * value.element_size(), size, span, per_token))
    return CommProfile(config, tokens, tuple(out))


def compiled_comm_profile(cm, name: str, gm: fx.GraphModule, tokens: int) -> CommProfile:
    """`comm_profile` of config `name`'s ExecGraph `gm` in CompiledModel `cm`, its groups read off
    `cm`'s process groups for the config (a real job's or a fake process group's)."""
    import torch.distributed as dist

    groups = {}
    for axis in ("dp", "tp"):
        group = cm.process_group(name, axis)
        if group is not None:
            ranks = dist.get_process_group_ranks(group)
            groups[group.group_name] = (len(ranks), max(ranks) - min(ranks) + 1)
    return comm_profile(gm, name, tokens, groups)
