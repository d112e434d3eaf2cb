"""The lowering as it was first written, for tests only: `compiler.lower.lower`'s decisions replayed
by an interpreter under make_fx, every op traced through torch's proxy and fake-tensor modes. (The
interpreter's loop is restated here on purpose: it is the oracle; the outputs' finishing is shared.)

`compiler.lower.lower` emits the same program node by node instead (an op's local shapes from its
meta kernel; only DTensor's redistributions and the final reduction traced). `same_program` checks
the two give the same graph: the same ops in the same order on the same inputs, constants and
local shapes, so the faster construction cannot drift from what the interpreter would trace.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from hotswitch.compiler import _dtensor as dt
from hotswitch.compiler._torch import pytree
from hotswitch.compiler.lengths import resolved_arguments
from hotswitch.compiler.lower import makes_piece, placed_on
from hotswitch.compiler.reduce import output_finisher

__all__ = ["lower_by_make_fx", "same_program"]


def lower_by_make_fx(graph, sharding, local_inputs, out_plan, mesh, bucket_bytes, device=None) -> fx.GraphModule:
    decisions = sharding.decisions
    on_device = placed_on(device)
    finish = output_finisher(graph, sharding, out_plan, mesh, bucket_bytes)

    # (local shapes read outside the trace: under make_fx DTensor's arithmetic on the mesh would be traced)
    pieces = {(src, want.placements): list(dt.local_shape(want))
              for d in decisions.values() if d.kind not in ("drop", "const", "getitem")
              for src, have, want in zip(d.tensor_nodes, d.in_specs, d.want_specs)
              if have.placements != want.placements and makes_piece(src.target, have, want)}

    def step(node, env, moved):
        d = decisions[node]
        if d.kind == "drop":
            return
        if d.kind == "const":
            env[node] = d.value
            return
        if d.kind == "getitem":
            env[node] = env[node.args[0]][node.args[1]]
            return
        tensors = []
        for src, have, want in zip(d.tensor_nodes, d.in_specs, d.want_specs):
            value = env[src]
            if have.placements != want.placements:
                key = (src, want.placements)
                if key not in moved and key in pieces:  # the piece made, not sliced (`makes_piece`)
                    made = decisions[src]
                    moved[key] = src.target(pieces[key], *made.args[1:], **on_device(dict(made.kwargs)))
                if key not in moved:
                    moved[key] = dt.redistribute(value, have, want)
                value = moved[key]
            tensors.append(value)
        it = iter(tensors)
        fill = lambda a: next(it) if isinstance(a, dt.DTensorSpec) else a  # noqa: E731
        out = node.target(*pytree.tree_map(fill, d.args), **on_device(pytree.tree_map(fill, dict(d.kwargs))))
        if d.reduce_to is not None:
            out = dt.redistribute(out, d.out_spec, d.reduce_to)
        env[node] = out

    def run(*flat):
        env: dict[fx.Node, Any] = {}
        moved: dict[tuple, torch.Tensor] = {}
        it = iter(flat)
        for node in graph.nodes:
            if node.op == "placeholder":
                env[node] = next(it)
            elif node.op == "output":
                with fx_traceback.set_current_meta(node):
                    return finish([env[a] for a in pytree.tree_leaves(node.args[0])])
            else:
                with fx_traceback.set_current_meta(node):
                    step(node, env, moved)
        raise AssertionError("graph without output")

    with warnings.catch_warnings(), fx_traceback.preserve_node_meta():
        warnings.simplefilter("ignore")
        gm = make_fx(run, tracing_mode="fake")(*local_inputs)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _plain(value):
    """Lists and tuples alike (DTensor rewrites a view's shape as a tuple; make_fx records a list)."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _layout(v: torch.Tensor) -> tuple:
    """Strides, those of size-1 dims left out: any value describes the same memory (meta kernels and
    fake tensors do not always pick the same one)."""
    return tuple(stride if size != 1 else None for size, stride in zip(v.shape, v.stride()))


def _describe(gm: fx.GraphModule, portable: bool = False) -> list:
    """Each node as (op, target, args and kwargs with nodes as their positions, local shape, layout,
    dtype, phase); constants (get_attr) by value. `portable`: see `same_program`."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    out = []
    for n in nodes:
        args, kwargs = resolved_arguments(n) if portable else (n.args, n.kwargs)
        if portable and str(n.target).startswith("_c10d_functional.") and args and isinstance(args[-1], str):
            args = (*args[:-1], "group")
        args, kwargs = fx.node.map_arg((args, kwargs), lambda a: ("node", index[a]))
        args, kwargs = _plain(args), _plain(kwargs)
        val = n.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else (val,)
        meta = tuple((tuple(v.shape), _layout(v), v.dtype) if isinstance(v, torch.Tensor) else v for v in vals)
        target = getattr(gm, n.target).tolist() if n.op == "get_attr" else n.target
        out.append((n.op, target, args, kwargs, meta if n.op != "output" else None,
                    n.meta.get("custom", {}).get("phase")))
    return out


def same_program(a: fx.GraphModule, b: fx.GraphModule, portable: bool = False) -> str | None:
    """None when `a` and `b` are the same program (see `_describe`), else the first difference.
    `portable`: programs of two compiled models (or two lowering paths): a collective's process group
    by its place, not its name (each model makes groups of its own), and a view's -1 or a slice's end
    past its dim as the size it stands for (DTensor's search leaves some, a replay writes them)."""
    da, db = _describe(a, portable), _describe(b, portable)
    for i, (x, y) in enumerate(zip(da, db)):
        if x != y:
            return f"node {i}: {x} != {y}"
    if len(da) != len(db):
        return f"{len(da)} nodes != {len(db)} nodes"
    return None
