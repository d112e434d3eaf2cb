"""compiler.lengths: programs at new sequence lengths written from the fit of two (one process)."""

import marshal
import operator
from unittest import mock

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from hotswitch.compiler._torch import graph_built
from hotswitch.compiler.lengths import CannotFit, affine_in_length, fit
from tests.reference_lowering import same_program

H = 8


def _attention_like(x):
    """[4, L, H] -> heads of 2, a causal score matrix [L, L] and a slice of its first columns (strides
    of L * L), a local quarter of the length."""
    b, length, _ = x.shape
    heads = x.view(b, length, 2, H // 2).transpose(1, 2)
    scores = heads @ heads.transpose(-1, -2)
    mask = torch.ones(length, length).tril()
    quarter = x.view(b, 4, length // 4, H)[:, 0]
    return (scores * mask).sum(-1).transpose(1, 2).reshape(b, length, 2), quarter.sum(), scores[..., :4].exp()


def _merging(x):
    """Views the [L, L] score matrix as one dim of L * L: an integer not affine in L."""
    scores = x @ x.transpose(0, 1)
    return scores.view(-1).cumsum(0).view(x.shape[0] * x.shape[0])


def _programs(fn, lengths, shape=lambda n: (4, n, H), pieces_read_only: bool = False):
    """make_fx's programs of `fn` at `lengths`; `pieces_read_only`: an op's outputs that nothing
    reads dropped (make_fx takes every piece of a split; a lowered program keeps those it reads)."""
    programs = [make_fx(fn)(torch.randn(shape(n))) for n in lengths]
    for gm in programs if pieces_read_only else ():
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return programs


def _written_from_the_template(fitted, length: int):
    """`fitted.at(length)`, checking that its code was the first program's with integers replaced
    (fx wrote none), is exactly the code fx writes for the program's graph, and runs as the
    template's code compiled once, the integers that change read from globals set to this length's."""
    written = []
    write = torch.fx.Graph.python_code

    def writing(graph, *args, **kwargs):
        written.append(graph)
        return write(graph, *args, **kwargs)

    with mock.patch.object(torch.fx.Graph, "python_code", writing):
        gm = fitted.at(length)
    assert fitted.code is not None and not written
    assert gm.code == write(gm.graph, "self").src
    forward = type(gm).forward
    assert fitted.code.names and {n for n, _ in fitted.code.names} <= set(forward.__code__.co_names)
    assert all(forward.__globals__[n] == value.at(length) for n, value in fitted.code.names)
    assert marshal.dumps(forward.__code__.replace(co_filename="")) == \
        marshal.dumps(marshal.loads(fitted.code.compiled).replace(co_filename=""))
    return gm


def test_a_fitted_program_equals_the_traced_one_at_a_new_length():
    a, b, c = _programs(_attention_like, (8, 12, 20))
    fitted = fit(a, 8, b, 12)
    assert fitted.args  # view sizes, the mask's size: integers that move with the length
    at20 = _written_from_the_template(fitted, 20)
    assert same_program(at20, c) is None  # the same ops, arguments, local shapes and layouts
    x = torch.randn(4, 20, H)
    for got, want in zip(at20(x), c(x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_fitted_program_runs_before_its_graph_is_written():
    """A program written from the template is its code until something reads its graph: running it
    writes no node, and the graph written when first read is the traced program's, each value the
    one `value_at` reads off the fit without writing it (fitted, or the op run on its inputs' values
    where strides move with the length: the slice of the [L, L] scores)."""
    a, b, c = _programs(_attention_like, (8, 12, 20))
    fitted = fit(a, 8, b, 12)
    at20 = fitted.at(20)
    assert not graph_built(at20)
    x = torch.randn(4, 20, H)
    for got, want in zip(at20(x), c(x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not graph_built(at20)
    read_off = {name: fitted.value_at(name, 20) for name in fitted.vals}
    ran = [n for n in a.graph.nodes if n.target is torch.ops.aten.slice.Tensor
           and n.meta["val"].stride()[-2] == 8 and read_off[n.name].stride()[-2] == 20]
    assert ran  # the slice of the scores: its stride is the length
    assert same_program(at20, c) is None  # its graph, written now
    layout = lambda t: (tuple(t.shape), t.stride(), t.dtype) if isinstance(t, torch.Tensor) else t  # noqa: E731
    for n in at20.graph.nodes:
        if n.name in read_off:
            assert torch.utils._pytree.tree_map(layout, read_off[n.name]) == \
                torch.utils._pytree.tree_map(layout, n.meta.get("val")), n.name
    assert [layout(v) for v in fitted.placeholder_values(20)] == [layout(x)]


def test_a_fit_written_out_and_read_back_writes_the_same_programs_without_its_first_graph():
    """A fit as the compile cache files it (`dumps_fit`: nodes by name, ops by name) and reads it
    back for a program loaded from the cache (`loads_program`: its code only): it binds without
    building that program's graph (the outline the entry carries checks it is that program), and
    writes the same programs, the slice whose value is computed by running its op included."""
    from hotswitch.compiler.logic_io import dumps_fit, dumps_program, loads_fit, loads_program

    a, b, c = _programs(_attention_like, (8, 12, 20))
    fitted = fit(a, 8, b, 12)
    assert fitted.reads.runs  # a value computed by running its op (the slice of the scores)
    loaded = loads_program(dumps_program(a, {}), [])
    again = loads_fit(dumps_fit(fitted, {}), loaded, [])
    at20 = again.at(20)
    assert not graph_built(loaded) and not graph_built(at20)
    assert at20.code == fitted.at(20).code
    x = torch.randn(4, 20, H)
    for got, want in zip(at20(x), c(x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not graph_built(loaded)
    assert same_program(at20, c) is None  # its graph, written now (binding the loaded program's)
    other = loads_program(dumps_program(make_fx(lambda x: x.relu())(torch.randn(4, 8, H)), {}), [])
    with pytest.raises(ValueError, match="other node names"):  # another program: its outline tells
        loads_fit(dumps_fit(fitted, {}), other, [])
    assert not graph_built(other)


def test_a_size_of_minus_one_is_read_as_the_size_it_stands_for():
    def inferred(x):
        return x.view(x.shape[0], -1, 2, H // 2).sum(2)

    def written(x):
        return x.view(x.shape[0], x.shape[1], 2, H // 2).sum(2)
    a = make_fx(inferred)(torch.randn(4, 8, H))  # [4, -1, 2, 4]
    b, c = _programs(written, (12, 20))  # [4, 12, 2, 4], [4, 20, 2, 4]
    at20 = _written_from_the_template(fit(a, 8, b, 12), 20)  # the code's -1 replaced by 20
    assert same_program(at20, c, portable=True) is None
    x = torch.randn(4, 20, H)
    torch.testing.assert_close(at20(x), c(x), rtol=0, atol=0)


def test_a_slice_to_the_end_is_read_as_one_to_the_dims_size():
    def to_the_end(x):
        return x[:, 2:] * 2

    def to_the_length(x):
        return x[:, 2:x.shape[1]] * 2
    a = make_fx(to_the_end)(torch.randn(4, 8, H))  # slice(x, 1, 2, 2**63 - 1)
    b, c = _programs(to_the_length, (12, 20))  # slice(x, 1, 2, 12), slice(x, 1, 2, 20)
    at20 = _written_from_the_template(fit(a, 8, b, 12), 20)  # the code's 9223372036854775807 replaced
    assert same_program(at20, c, portable=True) is None


def test_a_length_the_fit_does_not_divide_is_refused():
    a, b = _programs(_attention_like, (8, 12))
    with pytest.raises(CannotFit, match="not a whole number"):  # 18 // 4 is not 18 / 4
        fit(a, 8, b, 12).at(18)


def test_an_integer_that_is_not_affine_is_caught_at_the_new_length():
    a, b = _programs(_merging, (4, 8), shape=lambda n: (n, H))
    fitted = fit(a, 4, b, 8)  # 16 and 64 fit 12 * L - 32, which is wrong everywhere else
    with pytest.raises(CannotFit, match="not affine"):
        fitted.at(12)


def test_programs_that_differ_beyond_integers_are_not_fitted():
    def branchy(x):
        return x.relu() if x.shape[1] > 10 else x.sigmoid()
    a, b = _programs(branchy, (8, 12))
    with pytest.raises(CannotFit, match="relu|sigmoid"):
        fit(a, 8, b, 12)
    def scaled(x):
        return x * (1.0 / x.shape[1])  # a float that moves with the length
    a, b = _programs(scaled, (8, 12))
    with pytest.raises(CannotFit, match="0.125"):
        fit(a, 8, b, 12)


def test_an_integer_that_is_not_a_size_is_never_fitted():
    """A dim, or a getitem's index into an op's outputs, that differs between the two lengths makes
    them two programs: fitted as an affine function of the length it would pick another dim, or
    another piece (or one past the last), at a third length."""
    def summed(x):
        return x.sum(2 if x.shape[1] == 8 else 1)  # [4, 8] at both lengths: only the dim differs
    a, b = _programs(summed, (8, 12))
    with pytest.raises(CannotFit, match="dim .* is 2 at length 8 but 1 at length 12: not a size"):
        fit(a, 8, b, 12)

    def shifted(x):  # a number the length moves, where the op takes a tensor (aten.add.Tensor's other)
        return x + x.shape[1]
    a, b = _programs(shifted, (8, 12))
    x = torch.randn(4, 20, H)
    torch.testing.assert_close(fit(a, 8, b, 12).at(20)(x), shifted(x))

    def quarter(x):  # a quarter of the length: the first at 8, the second at 12
        return x.split(x.shape[1] // 4, dim=1)[0 if x.shape[1] == 8 else 1] * 2
    a, b = _programs(quarter, (8, 12), pieces_read_only=True)
    with pytest.raises(CannotFit, match="index into its input's outputs is 0 at length 8 but 1 at length 12"):
        fit(a, 8, b, 12)


def test_an_uneven_split_whose_pieces_move_is_not_fitted():
    """Pieces of 3 of the length: 3 pieces at 8 (3, 3, 2) and at 9 (3, 3, 3), 5 at 13. Fitted, the
    program at 13 would sum 3 pieces where there are 5 (the last one's size fitted as L - 6)."""
    def sums(x):
        return torch.stack([p.sum() for p in x.split(3, 1)])
    a, b = _programs(sums, (8, 9))
    with pytest.raises(CannotFit, match="uneven split"):
        fit(a, 8, b, 9)
    a, b = _programs(sums, (9, 12))  # pieces of 3 that both lengths divide: refused on their number
    with pytest.raises(CannotFit, match="nodes at length"):
        fit(a, 9, b, 12)


def test_a_piece_of_a_value_whose_pieces_are_alike_keeps_the_first_programs_index():
    """Programs lowered on two data-parallel ranks take their own piece of a value every piece of
    which holds the same values (ones, cut into rows): which piece does not matter, and the fit
    keeps the first's at every length."""
    def ones_piece(x):
        ones = torch.ones(4, x.shape[1], H)
        return x * ones.split(1, dim=0)[0 if x.shape[1] == 8 else 1]
    a, b = _programs(ones_piece, (8, 12), pieces_read_only=True)
    fitted = fit(a, 8, b, 12)
    gm = fitted.at(20)
    (piece,) = [n for n in gm.graph.nodes if n.target is operator.getitem]
    assert piece.args[1] == 0
    x = torch.randn(4, 20, H)
    torch.testing.assert_close(gm(x), ones_piece(x))


def test_affine_in_length_reads_the_logic_graphs_symbolic_sizes():
    def fine(x):
        return x.view(x.shape[0], -1, 2, H // 2).sum(1)
    gm = make_fx(fine, tracing_mode="symbolic")(torch.randn(4, 12, H))
    length = [n for n in gm.graph.nodes if n.op == "placeholder"][0].meta["val"].shape[1].node.expr
    assert affine_in_length(gm.graph, length)
    gm = make_fx(_merging, tracing_mode="symbolic")(torch.randn(12, H))
    length = [n for n in gm.graph.nodes if n.op == "placeholder"][0].meta["val"].shape[0].node.expr
    assert not affine_in_length(gm.graph, length)
