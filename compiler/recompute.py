"""Activation recomputation as a rewrite of a joint forward+backward graph (`DistConfig.recompute`).

In one joint graph, recomputation is a choice of which forward values the backward reads and which
it computes again (functorch's partitioners make the same choice). Per repeated block (a
ModuleList child, `regions.block_of`), every forward value of the block that the backward reads and
the policy does not keep is computed again by copies of its forward ops, placed right before the
first backward op that needs one of them. The copies read only values the policy keeps: the
block's inputs (values made outside the block: the residual stream, masks, rotary tables,
parameters) and, under "selective", the block's matmul and attention outputs. The originals are
then read by the forward alone, so the program frees them after the block's forward.

- "full": each block's inputs kept, the rest of its forward recomputed (torchtitan's full AC,
  Megatron's `--recompute-granularity full`); collectives inside the block (tensor parallelism's)
  run again in the recomputation, as in Megatron.
- "selective": matmul (mm, addmm, bmm) and attention outputs kept, what lies between them
  recomputed: norms, activations, rotary embeddings, their elementwise arithmetic (torch's
  selective AC with a "save matmuls" policy). Attention here is one op whose backward reads its
  output and log-sum-exp (`kernels.attention`), never the [T, T] scores, so Megatron's selective
  recompute of the attention core is already what it does.

Values outside blocks (embeddings, the final norm, the head, the loss) are kept, and so are
seeded random ops (dropout would draw new numbers). The copies are the same ops on the same
inputs, so the numbers equal those without recomputation (bit for bit on CPU).
"""
from __future__ import annotations

import operator
import weakref

import torch
import torch.fx as fx

from ._torch import ancestors, copied_graph, copy_node, pytree
from .regions import block_of

__all__ = ["POLICIES", "recomputed"]

aten = torch.ops.aten
POLICIES = ("none", "selective", "full")

# ops whose outputs "selective" keeps: the matmuls and attention (their outputs are what is costly to compute)
_KEPT_BY_SELECTIVE = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
_ATTENTION = ("hotswitch::masked_attention", "hotswitch::document_attention")

# graph -> {(policy, forward outputs): the rewritten GraphModule}: every config and length of a model
# with the same policy lowers the same rewritten graph (and the caches key it by its text)
_REWRITTEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def recomputed(gm: fx.GraphModule, policy: str, forward_outputs: int,
               regathered: frozenset[int] = frozenset()) -> fx.GraphModule:
    """`gm` (a joint graph whose first `forward_outputs` outputs are the forward's: the loss parts,
    and a pipeline stage's activations) with the forward values its backward reads recomputed as
    `policy` says; `gm` itself for "none" with nothing `regathered`. Computed once per graph and
    arguments.

    `regathered`: placeholder indices of parameters stored sharded (fsdp), whose forward copies are
    freed after the forward: a value the backward reads that derives from them alone (a transposed
    weight, its bf16 cast) is computed again from the backward's own gather, in any block."""
    if policy not in POLICIES:
        raise ValueError(f"recompute must be one of {', '.join(POLICIES)}, got {policy!r}")
    if policy == "none" and not regathered:
        return gm
    memo = _REWRITTEN.setdefault(gm.graph, {})
    key = (policy, forward_outputs, regathered)
    if key not in memo:
        memo[key] = _rewrite(gm, policy, forward_outputs, regathered)
    return memo[key]


def _rewrite(gm: fx.GraphModule, policy: str, forward_outputs: int, regathered: frozenset[int]) -> fx.GraphModule:
    graph = copied_graph(gm.graph)
    out = next(n for n in graph.nodes if n.op == "output")
    forward = ancestors(pytree.tree_leaves(out.args[0])[:forward_outputs])
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    sharded = {placeholders[i] for i in regathered}
    # forward values made from sharded parameters alone (and constants): recomputed wherever read
    from_params: set[fx.Node] = set()
    for n in graph.nodes:
        if n in forward and n.op == "call_function" and n.all_input_nodes \
                and all(a in sharded or a in from_params for a in n.all_input_nodes):
            from_params.add(n)
    blocks = {n: block_of(n) for n in forward}

    def group(n: fx.Node) -> str | None:
        """The copies `n` is made again with (placed before the first backward read of any)."""
        return blocks.get(n) if n not in from_params else f"parameter {n.name}"

    def kept(n: fx.Node) -> bool:
        if n in from_params:
            return False
        if policy == "none" or n.op != "call_function" or blocks.get(n) is None or not _holds_tensors(n):
            return True
        if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()):
            return True
        if policy == "selective":
            op = n.args[0].target if n.target is operator.getitem else n.target
            return op in _KEPT_BY_SELECTIVE or str(getattr(op, "_name", op)).startswith(_ATTENTION)
        return False

    position = {n: i for i, n in enumerate(graph.nodes)}
    backward = [n for n in graph.nodes if n.op == "call_function" and n not in forward]
    # per group: the forward nodes to compute again (read by the backward, or by another such node of
    # the same group), and the first backward node that reads one of them (where the copies go)
    again: dict[str, set[fx.Node]] = {}
    first: dict[str, fx.Node] = {}
    for b in backward:
        for a in b.all_input_nodes:
            if a in forward and not kept(a):
                g = group(a)
                again.setdefault(g, set())
                first.setdefault(g, b)
                stack = [a]
                while stack:
                    n = stack.pop()
                    if n in again[g]:
                        continue
                    again[g].add(n)
                    stack += [i for i in n.all_input_nodes if i in forward and not kept(i)
                              and (i in from_params or blocks.get(i) == g)]
    copies: dict[str, dict[fx.Node, fx.Node]] = {}
    for g, nodes in again.items():
        mine = copies.setdefault(g, {})
        with graph.inserting_before(first[g]):
            for n in sorted(nodes, key=position.__getitem__):
                mine[n] = copy_node(graph, n, lambda a, mine=mine: mine.get(a, a))
    for b in backward:
        for a in list(b.all_input_nodes):
            if a in forward and not kept(a):
                b.replace_input_with(a, copies[group(a)][a])
    graph.eliminate_dead_code()
    graph.lint()
    return fx.GraphModule(gm, graph)


def _holds_tensors(n: fx.Node) -> bool:
    val = n.meta.get("val")
    return isinstance(val, torch.Tensor) or (isinstance(val, (tuple, list))
                                             and any(isinstance(v, torch.Tensor) for v in val))
