"""Peak memory of an ExecGraph, read from the graph itself.

Each node that allocates (every op whose result is not an alias of an input, by its schema's alias
annotation) holds its bytes from where it runs until its last use, or until the last use of any
view of it; graph outputs (the loss and the gradients) live to the end. The peak of that running
sum is what a caching allocator must hold at once for this graph's intermediate values, beyond the
inputs (parameters, buffers, the micro-batch) that the caller counts as resident state. It works
the same for CPU and GPU graphs and needs no run, so configs that would not fit are never run.
It ignores allocator fragmentation and kernels' workspaces.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ._torch import OpOverload, op_schema


def estimate_peak_bytes(gm: fx.GraphModule) -> int:
    """Peak bytes of intermediate tensors held at once while `gm` runs (inputs excluded)."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    end = len(nodes)
    storage: dict[fx.Node, fx.Node] = {}  # node -> the node that allocated its storage
    for n in nodes:
        base = _aliased_input(n)
        storage[n] = storage.get(base, base) if base is not None else n
    free_at: dict[fx.Node, int] = {}  # allocating node -> index after which it can be freed
    for n in nodes:
        owner = storage[n]
        last = max((position[u] for u in n.users), default=position[n])
        if any(u.op == "output" for u in n.users):
            last = end
        free_at[owner] = max(free_at.get(owner, position[owner]), last)
    releases: dict[int, list[fx.Node]] = {}
    for owner, i in free_at.items():
        releases.setdefault(i, []).append(owner)
    live = peak = 0
    for i, n in enumerate(nodes):
        if n.op == "call_function" and storage[n] is n:
            live += _nbytes(n)
            peak = max(peak, live)
        for owner in releases.get(i, ()):
            if owner.op == "call_function":
                live -= _nbytes(owner)
    return peak


def _aliased_input(n: fx.Node) -> fx.Node | None:
    """The input node whose storage `n`'s result aliases (views, wait_tensor), or None."""
    if n.op != "call_function":
        return None
    if n.target is operator.getitem:  # one output of a multi-output op: owned by that op's node
        return n.args[0]
    if not isinstance(n.target, OpOverload):
        return None
    schema = op_schema(n.target)
    if not schema.returns or schema.returns[0].alias_info is None:
        return None
    alias_set = schema.returns[0].alias_info.before_set
    for arg, value in zip(schema.arguments, n.args):
        if arg.alias_info is not None and arg.alias_info.before_set & alias_set and isinstance(value, fx.Node):
            return value
    return None


def _nbytes(n: fx.Node) -> int:
    val = n.meta.get("val")
    values = val if isinstance(val, (list, tuple)) else (val,)
    total = 0
    for v in values:
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total
