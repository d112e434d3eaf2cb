"""`compiler.uniform.uniform_dims`: the dims along which a value's slices are all equal, which lets
data-parallel ranks share a program that cuts such a value into their rows. Every claim is checked
against the values the graph computes: a wrong claim would give another rank's rows."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from hotswitch.compiler.uniform import uniform_dims

B, T = 4, 6


def causal_mask(ids):  # HF Llama's way: positions from arange, a [T, T] pattern, over the batch
    b, t = ids.shape
    positions = (torch.arange(t) + 0).unsqueeze(0).expand(b, -1)
    rows = torch.arange(b).view(b, 1, 1, 1)
    q = positions[rows, torch.arange(t).view(1, 1, t, 1)]
    k = positions[rows, torch.arange(t).view(1, 1, 1, t)]
    keep = torch.full((), True) & (k <= q)
    return keep.expand(b, 1, t, t).clone()


def packed_mask(ids):  # documents found from position jumps, as transformers does for packed rows
    b, t = ids.shape
    positions = torch.arange(t).unsqueeze(0).expand(b, -1)
    first = positions[:, :1] - 1
    jumps = torch.cat([first, positions], dim=-1)
    doc = ((jumps[:, 1:] - jumps[:, :-1]) != 1).cumsum(-1)
    return doc.unsqueeze(1).unsqueeze(1) == doc.unsqueeze(1).unsqueeze(-1)


def batch_numbered(ids):  # a value made whole on every rank whose rows differ: the batch index in it
    b, t = ids.shape
    return torch.arange(b).view(b, 1) + torch.arange(t).view(1, t)


def from_input(ids):
    return (ids > 3).unsqueeze(1)


def summed_over_batch(ids):
    b, t = ids.shape
    return torch.ones(b, t).cumsum(0)


def transposed(ids):
    b, t = ids.shape
    return torch.arange(t).unsqueeze(0).expand(b, t).t().contiguous()


CASES = {  # function -> the dims of its output that must be found uniform
    causal_mask: {0, 1},
    packed_mask: {0, 1},  # every row holds the same documents
    batch_numbered: set(),
    from_input: {1},  # only the unsqueezed dim
    summed_over_batch: {1},
    transposed: {1},
}


@pytest.mark.parametrize("fn", list(CASES), ids=[f.__name__ for f in CASES])
def test_claimed_dims_hold_on_the_values_and_the_masks_are_found(fn):
    ids = torch.randint(0, 8, (B, T))
    graph = make_fx(fn, tracing_mode="fake")(ids).graph
    dims = uniform_dims(graph)
    out = next(n for n in graph.nodes if n.op == "output").args[0]
    out = out[0] if isinstance(out, (tuple, list)) else out
    claimed = set(dims.get(out, ()))
    assert claimed == CASES[fn], (fn.__name__, claimed)
    # every claim, for every node, holds on the values the graph computes
    values = {}
    env = iter([ids])
    for node in graph.nodes:
        if node.op == "placeholder":
            values[node] = next(env)
        elif node.op == "call_function":
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
            values[node] = node.target(*args, **kwargs)
            for d in dims.get(node, ()):
                v = values[node]
                assert torch.equal(v, v.narrow(d, 0, 1).expand_as(v)), (fn.__name__, node.name, d)


def row_positions(ids):  # rows picked from a value whose rows differ: the pick reads every row
    b, t = ids.shape
    positions = torch.arange(b * t).view(b, t)
    rows = torch.arange(b).view(b, 1, 1, 1)
    return positions[rows, torch.arange(t).view(1, 1, t, 1)] > 3


def _graph(fn):
    ids = torch.randint(0, 8, (B, T))
    attend = lambda ids: fn(ids) & (ids > -1)[:, None, None, :]  # noqa: E731 - read beside the input's rows
    return make_fx(attend, tracing_mode="fake")(ids).graph


@pytest.mark.parametrize("fn", [causal_mask, packed_mask, batch_numbered, row_positions],
                         ids=["causal_mask", "packed_mask", "batch_numbered", "row_positions"])
def test_values_made_from_no_input_are_made_in_rows_from_their_first_alike_rows_on(fn):
    """`propagate._made_in_rows`: a mask's [B, 1, T, T] values are made in the batch's rows (each dp
    rank makes its own), from the first value of alike rows on; never the positions the rows are
    picked from (that pick reads every row), nor a value whose rows differ."""
    from hotswitch.compiler.propagate import _input_free, _made_in_rows

    graph = _graph(fn)
    free = _input_free(graph)
    chosen = _made_in_rows(graph, free, B)
    uniform = uniform_dims(graph)
    assert all(n in free and 0 in uniform[n] and n.meta["val"].shape[0] == B for n in chosen)
    big = [n for n in free if n.meta["val"].dim() == 4 and n.meta["val"].shape[-2:] == (T, T)]
    if fn in (causal_mask, packed_mask):
        assert big and set(big) <= chosen, (sorted(n.name for n in big), sorted(n.name for n in chosen))
        picked = {n.args[0] for n in graph.nodes if n.target is torch.ops.aten.index.Tensor}
        assert not picked & chosen, "a value whose rows an index picks is made whole"
    else:
        assert not chosen & set(big), sorted(n.name for n in chosen)
