"""Where a training ExecGraph says that gradients are final: the hook a switch starts from.

A training program that reduces its own gradients (pp = 1, the data-parallel reduction inside) calls
`gradients_final(indices, *grads)` once per reduction bucket, as soon as that bucket's gradients are
reduced, divided by the loss denominator and in their parameters' layouts (`lower.hand_off_early`
places the call behind the next bucket's all-reduce, while the backward goes on). `indices` are the
gradients' positions among the parameters. Nothing happens unless the runtime armed a handler
(`handing_off`): then the next config's gradients start moving during the backward that makes them
final, instead of after it. The compiler knows nothing of switching; this is the whole interface.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.fx as fx

__all__ = ["gradients_final", "handing_off", "is_hand_off", "strip_hand_offs"]

_handler: Callable[[tuple[int, ...], tuple[torch.Tensor, ...]], None] | None = None


def gradients_final(indices: tuple[int, ...], *grads: torch.Tensor) -> None:
    """The gradients of parameters `indices` are final for this call (see the module doc)."""
    if _handler is not None:
        _handler(indices, grads)


fx.node.has_side_effect(gradients_final)  # no output, yet never dead code


@contextlib.contextmanager
def handing_off(handler: Callable[[tuple[int, ...], tuple[torch.Tensor, ...]], None]) -> Iterator[None]:
    """Programs run in the block call `handler(indices, grads)` where their gradients become final."""
    global _handler
    previous, _handler = _handler, handler
    try:
        yield
    finally:
        _handler = previous


def is_hand_off(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is gradients_final


def strip_hand_offs(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` without hand-off calls (for a compiler that cannot call Python, Inductor: the
    runtime then moves those gradients after the call, as it would without a hook)."""
    if not any(is_hand_off(n) for n in gm.graph.nodes):
        return gm
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if not is_hand_off(n):
            env[n] = graph.node_copy(n, lambda a: env[a])
    return fx.GraphModule(gm, graph)
