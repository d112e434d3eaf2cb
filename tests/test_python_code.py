"""`compiler._torch.python_code` writes the code fx writes (source, globals, line map), or leaves
the graph to fx. Lowered programs are compared in `test_compile_world2` (the make_fx check); these
are the corners a program rarely has."""
import math
import operator
from collections import namedtuple
from unittest import mock

import torch
import torch.fx as fx

from hotswitch.compiler._torch import graph_module, lists_codegen, python_code

aten = torch.ops.aten
Pair = namedtuple("Pair", "a b")


def hand_off(*values):  # a Python function a program calls (as it calls `handoff.gradients_final`)
    return values


def assert_as_fx_writes(graph: fx.Graph, by_fx: bool = False) -> None:
    """`python_code(graph)` is fx's code; `by_fx`: because fx wrote it (else without asking fx)."""
    theirs = fx.Graph.python_code(graph, "self")
    with mock.patch.object(fx.Graph, "python_code", autospec=True, side_effect=fx.Graph.python_code) as fx_writes:
        ours = python_code(graph)
    assert fx_writes.called == by_fx
    assert ours.src == theirs.src
    assert ours._lineno_map == theirs._lineno_map and ours._prologue_start == theirs._prologue_start
    assert ours.globals.keys() == theirs.globals.keys()
    assert all(ours.globals[k] is theirs.globals[k] for k in theirs.globals)


def program_like() -> fx.Graph:
    """A program's kinds of nodes: a renamed placeholder, aten calls with list, dtype, device, float
    and infinite arguments and keyword arguments, getitem, an attribute, a Python function, a value
    no one reads (deleted at once), names that clash with fx's globals."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("device")  # `device` is a global of fx's code
    view = g.call_function(aten.view.default, (x, [4, -1]))
    cast = g.call_function(aten._to_copy.default, (view,), {"dtype": torch.float16, "device": torch.device("cpu")})
    full = g.call_function(aten.full.default, ([2, 2], -math.inf), {"dtype": torch.float32})
    split = g.call_function(aten.split.Tensor, (cast, 2, 1))
    first = g.call_function(operator.getitem, (split, 0))
    rows = g.call_function(operator.getitem, (first, slice(0, 4, None)))
    g.call_function(aten.neg.default, (first,))  # read by no one
    attr = g.get_attr("_constant0")
    hand = g.call_function(hand_off, (first, attr))
    torch_named = g.call_function(aten.add.Tensor, (w, 1.5))
    torch_named.name = "torch"  # clashes with the `torch` global: fx renames it in the code
    g.output((hand, full, torch_named, rows, g.call_function(aten.slice.Tensor, (x, 1, 0, 9223372036854775807))))
    return g


def test_a_program_like_graph_is_written_as_fx_writes_it():
    assert_as_fx_writes(program_like())


def test_a_graph_of_lists_in_and_a_tuple_out_is_written_as_fx_writes_it():
    g = fx.Graph()
    a, b, c = (g.placeholder(n) for n in ("arg0_1", "arg1_1", "arg2_1"))
    total = g.call_function(aten.sum.dim_IntList, (c, [0]), {"keepdim": True})
    g.output((g.call_function(aten.mm.default, (a, b)), total))
    g._codegen = lists_codegen(["params", "inputs"], [2, 1], 2)
    assert_as_fx_writes(g)


def test_arguments_it_does_not_write_are_left_to_fx():
    """A named tuple and a tensor constant: fx's code (the same, by construction)."""
    for arg in (Pair(1, 2), torch.ones(2)):
        g = fx.Graph()
        x = g.placeholder("x")
        g.output(g.call_function(hand_off, (x, arg)))
        assert_as_fx_writes(g, by_fx=True)


def test_a_module_built_with_it_runs_like_fx_s():
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(aten.mul.Tensor, (g.call_function(aten.view.default, (x, [2, 3])), 2.0))
    g.output((y, g.call_function(operator.getitem, (g.call_function(aten.split.Tensor, (y, 1)), 1))))
    root = torch.nn.Module()
    ours, theirs = graph_module(root, g), fx.GraphModule(root, g)
    assert ours.code == theirs.code
    assert "python_code" not in vars(g)  # fx's again, for later edits
    x = torch.arange(6.0)
    assert all(torch.equal(a, b) for a, b in zip(ours(x), theirs(x)))
