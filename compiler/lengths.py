"""Programs at new sequence lengths without lowering them: `fit` two programs, then `LengthFit.at`.

A config's first sequence length is lowered by DTensor's search and later lengths replay its
decisions (`propagate.propagate_graph`). A replay still visits every op, traces the redistributions and
builds every node: most of a lowering. But two programs of one config, at the same rows and two
lengths, are usually one graph whose integer arguments (view and split sizes, ranges, fills) are
affine functions of the length. `fit` finds those functions; `LengthFit.at(length)` writes the
program at another length as a copy of the first with the integers evaluated there. This is
torch.compile's automatic dynamic shapes in spirit: the first length is specialized; the second is
replayed as a sample (its graph only: no code written, nothing filed) to fit with the first, and
from there on the length is a variable: the second length's program, and every later one's, is
written from the fit.

The two programs may come from different paths (searched on one rank, replayed on another, loaded
from another dp rank): their nodes are paired by position, names aside, and a size's -1 or a slice's
end past its dim is read as the size it stands for (`resolved_arguments`) before comparing. Meta
values are fitted in their sizes and strides, not their storage offsets (meta results memoized across
views do not always carry one).

Refused (`CannotFit`, with the reason) when:
- the two graphs differ other than in integers (an uneven length adds ops, say), or a float or a
  constant tensor differs (DTensor's uneven gathers read index tensors built for one length), or a
  sentinel differs (a -1 against a number, an end of 2**63 - 1);
- an integer that is not a size differs: a dim, a collective's group size, a getitem's index into
  an op's outputs (`_leaf_kinds`). Only a getitem that takes one of equal pieces all holding the
  same values may differ, as between the programs of two data-parallel ranks (`_same_pieces`):
  the first's is kept;
- a split's pieces move with the length while the split is uneven at either length: their number,
  ceil(size / split size), stays the same at every length only where the two are proportional;
- at the new length an integer is not whole, or a size is negative: the affine functions carry the
  divisibility the sharding needs (a local length L/4 refuses L = 18, which DTensor splits unevenly);
- at the new length a view's input and output would hold different numbers of elements: how an
  integer that is not affine shows (a view merging two length dims, L * L).
The caller also checks that every size in the LogicGraph is affine in the length
(`affine_in_length`): the integers an op computes from those sizes (a range of L * L) are not views.

The program's Python code is written the same way: the first program's code with the integers of
the lines that change replaced (`_CodeTemplate`), not generated again by fx (most of writing one).

A written program is its code until something reads its graph: `LengthFit.at` checks the length
from sizes alone (`check`), writes the code, and leaves the nodes to be written when the graph is
first read (`module_with_lazy_graph`), which an eager step never does. A fit names the first
program's nodes and keeps what writing a length reads of that program's graph (`_Reads`), so it
binds to a program loaded from the compile cache without building that program's graph either.

A fit is filed in the compile cache under its first program's key (`LengthFit.portable`): a later
process that loads that program loads the fit too, and neither lowers a second length nor fits
again. Ranks that differ only in their dp coordinate and share one first program share its fit too:
one samples and fits, the others load the fit (`SharedCache`'s "shared length fit").
"""
from __future__ import annotations

import functools
import hashlib
import marshal
import operator
import re
import types
import weakref
from dataclasses import dataclass, replace
from fractions import Fraction

import sympy
import torch
import torch.fx as fx

from ._torch import (
    FloorDiv,
    OpName,
    OpOverload,
    WrittenCode,
    add_node,
    arg_leaves,
    codegen,
    copy_node,
    graph_built,
    module_with_code,
    module_with_lazy_graph,
    op_of,
    op_schema,
    pytree,
    renamed_strings,
    written_code,
)
from .attention import kernels_hold
from .tp_rules import RESHAPE_OPS, SIZED_VIEW_OPS
from .uniform import uniform_dims

__all__ = ["CannotFit", "LengthFit", "affine_in_length", "fit", "resolved_arguments"]



class CannotFit(ValueError):
    """Two programs are not one graph in the length, or the fit does not hold at a length."""


@dataclass(frozen=True)
class Affine:
    """(p * length + q) / r: an integer of a program, as the length changes (r > 0, whole at the
    two fitted lengths)."""

    p: int
    q: int
    r: int

    @staticmethod
    @functools.lru_cache(maxsize=4096)  # the same few pairs, over and over (every length-sized dim)
    def through(length_a: int, a: int, length_b: int, b: int) -> Affine:
        slope = Fraction(b - a, length_b - length_a)
        p, r = slope.numerator, slope.denominator
        return Affine(p, a * r - p * length_a, r)

    def at(self, length: int) -> int:
        v, rest = divmod(self.p * length + self.q, self.r)
        if rest:
            raise CannotFit(f"({self.p} * {length} + {self.q}) / {self.r} is not a whole number")
        return v


def _at(x, length: int):
    return x.at(length) if isinstance(x, Affine) else x


def _fit_leaf(a, b, la: int, lb: int, where: str):
    """A constant (the value itself) or an Affine for one pair of integers."""
    if a is b:
        return a
    if type(a) is int and type(b) is int and a != b:
        if min(a, b) < 0 or max(a, b) >= 2 ** 31:  # a sentinel (a size's -1, a slice's "to the end")
            raise CannotFit(f"{where}: {a} at length {la} but {b} at length {lb}")
        return Affine.through(la, a, lb, b)
    if type(a) is not type(b) or not _same(a, b):
        raise CannotFit(f"{where}: {a!r} at length {la} but {b!r} at length {lb}")
    return a


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare (tensors): not the same
        return False


def _pair_leaves(a, b, out: list) -> bool:
    """Append the pairs of leaves of two fx arguments, in the order `fx.node.map_aggregate` visits
    them; False when they are not nested alike (containers' types aside: a size is a list or a tuple)."""
    if isinstance(a, (tuple, list)):
        if not isinstance(b, (tuple, list)) or len(a) != len(b):
            return False
        return all(_pair_leaves(x, y, out) for x, y in zip(a, b))
    if isinstance(a, dict):
        if not isinstance(b, dict) or list(a) != list(b):
            return False
        return all(_pair_leaves(a[k], b[k], out) for k in a)
    if isinstance(a, slice):
        return isinstance(b, slice) and all(_pair_leaves(getattr(a, f), getattr(b, f), out)
                                            for f in ("start", "stop", "step"))
    if isinstance(b, (tuple, list, dict, slice)):
        return False
    out.append((a, b))
    return True


def _leaf_kinds(node: fx.Node, arguments) -> list[tuple[bool, str]]:
    """Per leaf of `arguments` (`node`'s resolved (args, kwargs), in the order `_pair_leaves` visits
    them): may it move with the length, and what it is (for the error). An aten op's sizes may (its
    schema's SymInt arguments: a view's size, a split's size, a slice's ends) and so may its values
    (a Scalar: an arange's end, a count; a number added to a tensor); its plain `int` arguments are
    the program's structure (a dim, a collective's group size), as are a getitem's index into an
    op's outputs and every integer handed to a Python function. Two programs differing there are
    two programs, not one in L."""
    args, kwargs = arguments
    target = node.target
    if not isinstance(target, OpOverload):
        values = getattr(target, "__module__", None) == "_operator" and target is not operator.getitem
        what = "index into its input's outputs" if target is operator.getitem else "integer argument"
        return [(values, what)] * len(arg_leaves(arguments))
    positional, named = _schema_kinds(target)
    kinds: list[tuple[bool, str]] = []
    for i, value in enumerate(args):
        kinds += [positional[i] if i < len(positional) else (False, f"argument {i}")] * len(arg_leaves(value))
    for name, value in kwargs.items():
        kinds += [named.get(name, (False, name))] * len(arg_leaves(value))
    return kinds


@functools.lru_cache(maxsize=None)
def _schema_kinds(target: OpOverload) -> tuple[tuple, dict]:
    """`_schema_kind` of each of the op's arguments, by position and by name."""
    arguments = op_schema(target).arguments
    kinds = tuple(_schema_kind(a) for a in arguments)
    return kinds, {a.name: k for a, k in zip(arguments, kinds)}


def _schema_kind(argument) -> tuple[bool, str]:
    """An integer given for an `int` (a dim, an index, a group size) is structure; for a SymInt, a
    Scalar or a Tensor (a number added to a tensor) it is a size or a value."""
    t = argument.real_type
    while isinstance(t, (torch.OptionalType, torch.ListType)):
        t = t.getElementType()
    return not isinstance(t, torch.IntType), f"{argument.name} ({t})"


# ops whose outputs are pieces of their first input along a dim (a rank's own chunk is one of them)
_PIECES = {torch.ops.aten.split.Tensor: 2, torch.ops.aten.unbind.int: 1}


def _same_pieces(getitem: fx.Node) -> bool:
    """Does `getitem` take one of equal pieces of a value whose every piece holds the same values
    (`uniform.uniform_dims`: an even chunk of a fresh tensor, a dp rank's rows of HF Llama's mask)?
    Then which piece it takes does not matter: programs lowered on two data-parallel ranks (a
    program every dp rank shares, and a sample from another of them) take different ones."""
    pieces = getitem.args[0]
    dim = _cut_dim(pieces) if isinstance(pieces, fx.Node) else None
    even = dim is not None and (pieces.target is torch.ops.aten.unbind.int or _split_evenly(pieces))
    return even and dim in uniform_dims(getitem.graph).get(pieces.args[0], ())


def _cut_dim(pieces: fx.Node) -> int | None:
    """The dim (>= 0) a `_PIECES` op cuts its input along; None for another node."""
    at = _PIECES.get(pieces.target)
    if at is None:
        return None
    dim = pieces.args[at] if len(pieces.args) > at else pieces.kwargs.get("dim", 0)
    val = pieces.args[0].meta.get("val") if isinstance(pieces.args[0], fx.Node) else None
    return dim % val.dim() if isinstance(val, torch.Tensor) and type(dim) is int else None


def _pieces(node: fx.Node) -> list | None:
    val = node.meta.get("val")
    return [tuple(t.shape) for t in val] if isinstance(val, (tuple, list)) else None


def _split_evenly(node: fx.Node) -> bool:
    """Does `aten.split.Tensor` node `node` cut its input's dim into pieces of its split size exactly?"""
    dim, size = _cut_dim(node), node.args[1]
    return dim is not None and type(size) is int and size > 0 and node.args[0].meta["val"].shape[dim] % size == 0


def _structure_kept(a: fx.Node, b: fx.Node, arguments, leaves: list, pairs: list, where: str, la: int,
                    lb: int) -> tuple:
    """`a`'s fitted leaves (of its resolved `arguments`), where an integer that is structure, not a
    size (`_leaf_kinds`), differs between the programs: the first's, where it picks one of pieces
    that all hold the same values (`_same_pieces`, in both programs), else CannotFit."""
    kinds = _leaf_kinds(a, arguments)
    if len(kinds) != len(leaves):
        raise CannotFit(f"{where}: its arguments could not be read against its schema")
    out = list(leaves)
    for i, ((may_vary, what), leaf) in enumerate(zip(kinds, leaves)):
        if may_vary or not isinstance(leaf, Affine):
            continue
        x, y = pairs[i]
        if a.target is operator.getitem and _same_pieces(a) and _same_pieces(b):
            out[i] = x
            continue
        raise CannotFit(f"{where}: its {what} is {x} at length {la} but {y} at length {lb}: not a size, "
                        "so the two programs differ in what they compute, not in a length")
    return tuple(out)


@dataclass(frozen=True)
class _TensorFit:
    """A node's meta value (a meta tensor) as the length changes: dense in one order of its dims, or
    of strides that do not change."""

    sizes: tuple  # ints and Affines
    strides: tuple[int, ...] | None  # None: dense in `order` at every length
    order: tuple[int, ...]  # dims from outermost to innermost (for strides=None)
    offset: int
    dtype: torch.dtype
    requires_grad: bool

    def sizes_at(self, length: int) -> list[int]:
        sizes = [_at(s, length) for s in self.sizes]
        if min(sizes, default=0) < 0:
            raise CannotFit(f"a size would be negative at length {length}: {sizes}")
        return sizes

    def at(self, length: int) -> torch.Tensor:
        sizes = self.sizes_at(length)
        strides = self.strides
        if strides is None:
            strides, step = [0] * len(sizes), 1
            for d in reversed(self.order):
                strides[d] = step
                step *= max(sizes[d], 1)
        t = torch.empty_strided(sizes, strides, dtype=self.dtype, device="meta")
        if self.offset:
            t = t.as_strided(sizes, strides, self.offset)
        return t.requires_grad_(self.requires_grad) if self.dtype.is_floating_point else t


class _NotDense(Exception):
    """A value not dense in one order whose strides change between the lengths (a slice of a tensor
    whose strides hold L * L): the fit does not follow it; its op is run on meta values instead."""


_RUN = "run its op"  # a node's fitted value: computed by running the node on its inputs' values


def _dense_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The dims of a dense, non-overlapping tensor from outermost to innermost (None: not such)."""
    order = tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d], d)))
    return order if _dense_in(t, order) else None


def _dense_in(t: torch.Tensor, order: tuple[int, ...]) -> bool:
    step = 1
    for d in reversed(order):
        if t.shape[d] != 1 and t.stride(d) != step:
            return False
        step *= t.shape[d]
    return True


def _fit_val(a, b, la: int, lb: int, where: str, memo: dict):
    """A node's meta value as the length changes: the value itself where it does not change.
    `memo`: fits already made for values alike (a repeated block's), by their layouts."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.requires_grad != b.requires_grad or a.dim() != b.dim():
            raise CannotFit(f"{where}: its value changes more than its sizes")
        if a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset():
            return a  # a description, never written to: shared by the programs of every length
        key = (a.shape, a.stride(), a.storage_offset(), b.shape, b.stride(), a.dtype, a.requires_grad)
        fitted = memo.get(key)
        if fitted is None:
            fitted = memo[key] = _fit_tensor(a, b, la, lb, where)
        return fitted
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b):
        return type(a)(_fit_val(x, y, la, lb, where, memo) for x, y in zip(a, b))
    return _fit_leaf(a, b, la, lb, where)


def _fit_tensor(a: torch.Tensor, b: torch.Tensor, la: int, lb: int, where: str) -> _TensorFit:
    """`_fit_val` of two meta tensors of the same dtype and rank whose layouts differ."""
    sizes = tuple(_fit_leaf(x, y, la, lb, where) for x, y in zip(a.shape, b.shape))
    order, strides = _dense_order(a), None
    if order is None or not _dense_in(b, order):
        if a.stride() != b.stride():
            raise _NotDense  # strides that move with the length, maybe as L * L: not fitted
        order, strides = (), a.stride()
    # a storage offset is not read off a program's values (and meta results memoized across
    # views do not always carry it): the first's, where the two differ
    return _TensorFit(sizes, strides, order, a.storage_offset(), a.dtype, a.requires_grad)


def resolved_arguments(node: fx.Node) -> tuple:
    """(args, kwargs) with a -1 in a view's or an expand's size written as the size it stands for,
    and a slice's end past its dim as the dim's size (DTensor's search may leave either where a
    replay writes the local size)."""
    args, val = node.args, node.meta.get("val")
    if node.target in SIZED_VIEW_OPS and len(args) > 1 and isinstance(args[1], (tuple, list)) and -1 in args[1] \
            and isinstance(val, torch.Tensor):
        size = [val.shape[i] if s == -1 else s for i, s in enumerate(args[1])]
        return (args[0], size, *args[2:]), node.kwargs
    if node.target is torch.ops.aten.slice.Tensor and len(args) > 3 and type(args[3]) is int \
            and isinstance(args[0], fx.Node) and isinstance(args[0].meta.get("val"), torch.Tensor):
        size = args[0].meta["val"].shape[args[1]]
        if args[3] > size:
            return (*args[:3], size, *args[4:]), node.kwargs
    return args, node.kwargs


def _varies(fitted) -> bool:
    if isinstance(fitted, (_TensorFit, Affine)):
        return True
    return isinstance(fitted, (tuple, list)) and any(map(_varies, fitted))


def _val_at(fitted, length: int, sizes_only: bool = False):
    """A fitted value at `length` (`sizes_only`: a tensor's sizes, as a list; no meta tensor made)."""
    if isinstance(fitted, _TensorFit):
        return fitted.sizes_at(length) if sizes_only else fitted.at(length)
    if isinstance(fitted, (tuple, list)):
        return type(fitted)(_val_at(x, length, sizes_only) for x in fitted)
    return _at(fitted, length)


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


# an integer literal as fx writes one: not part of a name, a float (1e-05, 0.5), a string ('3') or a
# device's index (index=0)
_INTEGER = re.compile(r"(?<![\w.'\"=+-])-?\d+(?![\w.'\"])")


@dataclass(frozen=True)
class _CodeTemplate:
    """The first program's code, and where in it the integers that change are: per line that
    changes, the spans of its integer literals and what each is (an int, or an Affine).

    `compiled`: the forward compiled once, with each integer that changes read from a global of its
    own (`names`: global -> Affine), so that a length's code is its source written (for tracebacks
    and `gm.code`) and that compiled code run with the length's integers as globals, not Python
    compiling every length's code anew (half of writing a length). None: each length is compiled."""

    code: WrittenCode
    lines: tuple[str, ...]
    sites: tuple[tuple[int, tuple[tuple[int, int], ...], tuple], ...]  # (line, spans, values)
    compiled: bytes | None = None
    names: tuple[tuple[str, Affine], ...] = ()

    @staticmethod
    def of(first: fx.GraphModule, args: dict) -> _CodeTemplate | None:
        """None where a changing line's literals are not exactly its node's integers, in order (a
        device written with its index, say): then fx writes each program's code."""
        code = written_code(first, compiled=False)  # each length's code is compiled anew
        if code is None:
            return None
        lines = code.src.split("\n")
        line_of = {}
        for i, line in enumerate(lines):
            lhs, assigns, _ = line.partition(" = ")
            if assigns:
                line_of.setdefault(lhs.strip(), i)
        sites = []
        for node, fitted in args.items():
            i = line_of.get(node.name)
            if i is None:
                return None
            statement = lines[i].split(";  ", 1)[0]  # not fx's deletions after it (x = None)
            literals = list(_INTEGER.finditer(statement, statement.index(" = ") + 3))
            written = arg_leaves((node.args, node.kwargs))
            if len(written) != len(fitted):
                return None
            values = [(x, f) for x, f in zip(written, fitted) if type(x) is int]
            if len(values) != len(literals) or any(int(m.group()) != x for m, (x, _) in zip(literals, values)):
                return None
            sites.append((i, tuple(m.span() for m in literals), tuple(f for _, f in values)))
        template = _CodeTemplate(code, tuple(lines), tuple(sites))
        return replace(template, **template._compiled())

    def _compiled(self) -> dict:
        """`compiled` and `names` for this template, or nothing where its globals' names are taken."""
        if _LENGTH_GLOBAL.search(self.code.src) or any(_LENGTH_GLOBAL.match(k) for k in self.code.globals):
            return {}
        names = []

        def name(value: Affine) -> str:
            names.append((f"_hotswitch_int{len(names)}", value))
            return names[-1][0]

        module = compile(self._written(lambda value: name(value) if isinstance(value, Affine) else str(value)),
                         "<hotswitch length template>", "exec")
        forward = [c for c in module.co_consts if isinstance(c, types.CodeType) and c.co_name == "forward"]
        if len(forward) != 1:
            return {}
        return {"compiled": marshal.dumps(forward[0]), "names": tuple(names)}

    def _written(self, write) -> str:
        """The source with each changing literal written by `write(its value)`."""
        lines = list(self.lines)
        for i, spans, values in self.sites:
            line = lines[i]
            for (start, end), value in reversed(list(zip(spans, values))):
                line = line[:start] + write(value) + line[end:]
            lines[i] = line
        return "\n".join(lines)

    def renamed(self, names: dict[str, str], scope) -> _CodeTemplate | None:
        """This template with the string literals `names` maps replaced and its globals mapped by
        `scope` (None: they cannot be); None where a line whose integers change holds such a literal
        (its integers' places would move)."""
        literals = [repr(name) for name in names]
        if any(literal in self.lines[i] for i, _, _ in self.sites for literal in literals):
            return None
        scope = scope(self.code.globals)
        if scope is None:
            return None
        code = renamed_strings(replace(self.code, globals=scope), names)
        compiled = self.compiled
        if compiled is not None:
            compiled = renamed_strings(replace(self.code, src="", bytecode=compiled), names).bytecode
        return replace(self, code=code, lines=tuple(code.src.split("\n")), compiled=compiled)

    def at(self, length: int) -> WrittenCode:
        src = self._written(lambda value: str(_at(value, length)))
        if self.compiled is None:
            return replace(self.code, src=src)
        ints = {name: value.at(length) for name, value in self.names}
        return replace(self.code, src=src, globals={**self.code.globals, **ints}, bytecode=self.compiled)


# the globals a compiled template reads its integers from (a source that has the name already is
# compiled at each length instead)
_LENGTH_GLOBAL = re.compile(r"_hotswitch_int\d")


@dataclass(frozen=True)
class _Named:
    """A node of the first program, by its name: a LengthFit written out (`LengthFit.portable`)."""

    name: str


@dataclass(frozen=True)
class _Reads:
    """What writing the program at a length reads of the first program's graph besides the fit, read
    off it once when fitting: a fit loaded with a program whose graph is not built yet (from the
    compile cache) checks and writes lengths without building it. Nodes by name."""

    attrs: tuple[str, ...] | None  # the tensors its code reads as attributes (None: one named by a path)
    codegen: object  # how its graph writes its code
    values: dict  # name -> meta value, of the nodes read below whose value does not change
    reshapes: dict  # name -> its input's name, of the views among the values that change
    runs: dict  # name -> (op, arguments with nodes as _Named), of the values computed by running their op
    sites: tuple  # the fused attention kernels' FusedSites (`attention.kernels_hold`)
    placeholders: tuple[str, ...]

    @staticmethod
    def of(first: fx.GraphModule, vals: dict) -> _Reads:
        nodes = {n.name: n for n in first.graph.nodes}
        named = lambda a: _Named(a.name) if isinstance(a, fx.Node) else a  # noqa: E731
        reshapes = {n.name: n.args[0].name for n in vals if n.target in RESHAPE_OPS}
        runs = {n.name: (n.target, fx.node.map_aggregate(resolved_arguments(n), named))
                for n, v in vals.items() if v is _RUN}
        sites = tuple(n.meta["sdpa"] for n in first.graph.nodes if n.meta.get("sdpa") is not None)
        placeholders = tuple(n.name for n in first.graph.nodes if n.op == "placeholder")
        run_inputs = (i.name for n, v in vals.items() if v is _RUN for i in n.all_input_nodes)
        read = {*reshapes.values(), *placeholders, *run_inputs, *(x for s in sites for x in (s.q, s.k, s.mask))}
        changing = {n.name for n in vals}
        attrs = tuple(n.target for n in first.graph.nodes if n.op == "get_attr")
        return _Reads(attrs if all(a.isidentifier() for a in attrs) else None, codegen(first.graph),
                      {x: nodes[x].meta.get("val") for x in read if x in nodes and x not in changing},
                      reshapes, runs, sites, placeholders)

    def mapped(self, rename, op) -> _Reads:
        """These reads with each string of the ops' arguments mapped by `rename`, each op by `op`
        (`OpName.of` to write them out, `op_of` to read them back)."""
        runs = {k: (op(target), fx.node.map_aggregate(args, rename)) for k, (target, args) in self.runs.items()}
        return replace(self, runs=runs)


@dataclass(frozen=True)
class LengthFit:
    """The program `first` (lowered at `lengths[0]`) with its integers as functions of the length,
    its nodes by name (`_Named`): it binds to `first`'s graph only to write one (`at`)."""

    first: fx.GraphModule
    lengths: tuple[int, int]
    args: dict  # node name -> its arguments' leaves (_Named nodes, constants, Affines), where some change
    vals: dict  # node name -> its meta value as the length changes, where it changes (in the program's order)
    reads: _Reads
    code: _CodeTemplate | None = None  # its code as the length changes (None: fx writes it)

    def at(self, length: int) -> fx.GraphModule:
        """The program at `length` (raises CannotFit where the fit does not hold there: `check`).

        Where its code comes from the template, its graph is written only when something reads it
        (`module_with_lazy_graph`, as a program loaded from the compile cache): running the program
        needs its code alone, so a new length costs its integers and its code, not a copy of every
        node and value, and does not build the graph of a first program loaded without one."""
        self.check(length)
        if self.code is None or self.reads.attrs is None:
            graph = fx.Graph()
            self._write(graph, length)
            if self.code is None:
                return fx.GraphModule(self.first, graph)
            return module_with_code(self.first, graph, self.code.at(length))
        attrs = {name: getattr(self.first, name) for name in self.reads.attrs}
        return module_with_lazy_graph(attrs, self.reads.codegen, self.code.at(length),
                                      functools.partial(self._write, length=length))

    def check(self, length: int) -> None:
        """Raise CannotFit where the program at `length` cannot be written: an integer that is not
        whole, a size that would be negative, a value its op does not give, or a view whose input and
        output would hold different numbers of elements (how an integer that is not affine shows).
        From sizes alone where a value is fitted (no meta tensor made)."""
        for leaves in self.args.values():
            for x in leaves:
                if isinstance(x, Affine):
                    x.at(length)
        sizes, ran = {}, {}
        for name, fitted in self.vals.items():  # in the program's order: a view's input comes first
            try:
                sizes[name] = _val_at(fitted, length, sizes_only=True) if fitted is not _RUN else \
                    pytree.tree_map_only(torch.Tensor, lambda t: list(t.shape), self.value_at(name, length, ran))
            except CannotFit as e:
                raise CannotFit(f"{name}: {e}") from None
            source = self.reads.reshapes.get(name)
            if source is not None:
                before = sizes[source] if source in sizes else list(self.reads.values[source].shape)
                if _numel(before) != _numel(sizes[name]):
                    raise CannotFit(f"{name} would view {before} as {sizes[name]} at length {length}: "
                                    "an integer is not affine in the length")

    def value_at(self, name: str, length: int, memo: dict | None = None):
        """The meta value of the first program's node `name` in the program at `length`, without
        writing that program: fitted, the first's where it does not change, or its op run on its
        inputs' values (`memo`: those computed so far at this length). Only the nodes `_Reads` keeps."""
        fitted = self.vals.get(name)
        if fitted is None:
            return self.reads.values[name]
        if fitted is not _RUN:
            return _val_at(fitted, length)
        memo = {} if memo is None else memo
        if name not in memo:
            op, arguments = self.reads.runs[name]
            args, kwargs = self._arguments_at(name, arguments, length, lambda x: self.value_at(x.name, length, memo))
            try:
                memo[name] = op(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - an op without a meta kernel, say: the length is lowered
                raise CannotFit(f"its value at this length could not be computed ({type(e).__name__}: {e})") from None
        return memo[name]

    def kernels_hold(self, length: int) -> str | None:
        """`attention.kernels_hold` for the program at `length`, its values read off the fit."""
        known = lambda name: name in self.vals or name in self.reads.values  # noqa: E731
        return kernels_hold(self.reads.sites, lambda name: self.value_at(name, length) if known(name) else None)

    def placeholder_values(self, length: int) -> list:
        """The meta values of the program's inputs at `length`."""
        return [self.value_at(name, length) for name in self.reads.placeholders]

    def _arguments_at(self, name: str, arguments, length: int, node) -> tuple:
        """The (args, kwargs) of node `name` at `length`, from `arguments` (its own, resolved
        (`resolved_arguments`), its nodes as they are or as _Named), each node mapped by `node`."""
        fitted = self.args.get(name)
        if fitted is None:
            return fx.node.map_aggregate(arguments, lambda a: node(a) if isinstance(a, (fx.Node, _Named)) else a)
        leaves = iter([node(x) if isinstance(x, _Named) else _at(x, length) for x in fitted])
        return fx.node.map_aggregate(arguments, lambda _: next(leaves))

    def _write(self, graph: fx.Graph, length: int) -> None:
        """The program's nodes at `length` (`check`ed) written into `graph`, an empty one."""
        env, memo = {}, {}
        codegen(graph, self.reads.codegen)
        for node in self.first.graph.nodes:
            if node.name in self.args:
                args, kwargs = self._arguments_at(node.name, resolved_arguments(node), length,
                                                  lambda x: env[x.name])
                new = add_node(graph, node.op, node.target, args, kwargs, name=node.name)
                new.meta.update(node.meta)
            else:
                new = copy_node(graph, node, lambda x: env[x.name])  # its meta copied
            if node.name in self.vals:
                new.meta["val"] = self.value_at(node.name, length, memo)
            env[node.name] = new

    def portable(self, names: dict[str, str], scope) -> tuple | None:
        """This fit apart from its first program, for `bound` in another process: each string
        `names` maps (a process group's name) replaced, the code's globals mapped by `scope`. None
        where the code cannot be written so."""
        code = None
        if self.code is not None:
            code = self.code.renamed(names, scope)
            if code is None:
                return None
        rename = lambda x: names.get(x, x) if type(x) is str else x  # noqa: E731
        args = {k: tuple(map(rename, leaves)) for k, leaves in self.args.items()}
        return self.lengths, args, self.vals, self.reads.mapped(rename, OpName.of), code, program_outline(self.first)

    @staticmethod
    def bound(first: fx.GraphModule, portable: tuple, names: dict[str, str], scope) -> LengthFit:
        """`portable` (from `LengthFit.portable`) as the fit of `first`, the program it was made
        from, strings and globals mapped back by `names` and `scope` (ValueError: `first` is not the
        program it was made from, node for node). `first`'s graph is not read (nor built)."""
        lengths, args, vals, reads, code, outline = portable
        if program_outline(first) != outline:
            raise ValueError("the program it was fitted from was lowered again with other node names")
        rename = lambda x: names.get(x, x) if type(x) is str else x  # noqa: E731
        if code is not None:
            code = code.renamed(names, scope)
        return LengthFit(first, tuple(lengths), {k: tuple(map(rename, v)) for k, v in args.items()},
                         {k: _RUN if isinstance(v, str) and v == _RUN else v for k, v in vals.items()},
                         reads.mapped(rename, op_of), code)


def program_outline(gm: fx.GraphModule) -> str:
    """A digest of `gm`'s nodes, names and ops in order: a fit written out binds to its nodes by name.
    A program loaded from the compile cache carries its own (`OUTLINE`, `logic_io.loads_program`),
    read while its graph is not built (after that, the graph is the truth, edited or not)."""
    stored = gm.meta.get(OUTLINE)
    if stored is not None and not graph_built(gm):
        return stored
    h = hashlib.sha256()
    for n in gm.graph.nodes:
        target = str(n.target) if isinstance(n.target, (str, OpOverload)) else \
            f"{getattr(n.target, '__module__', '')}.{getattr(n.target, '__qualname__', n.target)}"  # no address
        h.update(f"{n.name} {n.op} {target}\n".encode())
    return h.hexdigest()


OUTLINE = "hotswitch outline"  # meta key of a module read without its graph: its `program_outline`


def fit(first: fx.GraphModule, length_a: int, second: fx.GraphModule, length_b: int) -> LengthFit:
    """The two programs of one config, at the same rows and lengths `length_a` != `length_b`, as one
    graph whose integers are affine in the length (raises CannotFit naming the first difference)."""
    a_nodes, b_nodes = list(first.graph.nodes), list(second.graph.nodes)
    if len(a_nodes) != len(b_nodes):
        raise CannotFit(f"{len(a_nodes)} nodes at length {length_a} but {len(b_nodes)} at length {length_b}")
    index = {n: i for i, n in enumerate(a_nodes)}
    index.update({n: i for i, n in enumerate(b_nodes)})
    args, vals, alike = {}, {}, {}
    for a, b in zip(a_nodes, b_nodes):
        where = f"{a.name} ({a.target})"
        if (a.op, a.target) != (b.op, b.target):  # names may differ: a trace memoized or not names nodes apart
            raise CannotFit(f"{where} at length {length_a} but {b.name} ({b.target}) at length {length_b}")
        if a.op == "get_attr":
            x, y = getattr(first, a.target), getattr(second, b.target)
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
                    and x.dtype == y.dtype and torch.equal(x, y)):
                raise CannotFit(f"the constant {a.target} differs between the lengths")
        pairs, arguments = [], resolved_arguments(a)
        if not _pair_leaves(arguments, resolved_arguments(b), pairs):
            raise CannotFit(f"{where} takes other arguments at length {length_b}")
        leaves, varies = [], False
        for x, y in pairs:
            if isinstance(x, fx.Node) or isinstance(y, fx.Node):
                if not (isinstance(x, fx.Node) and isinstance(y, fx.Node) and index[x] == index[y]):
                    raise CannotFit(f"{where} reads other values at length {length_b}")
                leaves.append(x)
                continue
            leaf = _fit_leaf(x, y, length_a, length_b, where)
            varies |= isinstance(leaf, Affine)
            leaves.append(leaf)
        if varies:
            leaves = _structure_kept(a, b, arguments, leaves, pairs, where, length_a, length_b)
            if any(isinstance(x, Affine) for x in leaves):
                args[a] = leaves
        if a.target is torch.ops.aten.split.Tensor and _pieces(a) != _pieces(b) and \
                not (_split_evenly(a) and _split_evenly(b)):
            # ceil(size / split size) pieces: the same number at every length only where the two are
            # affine alike, which an even split at both lengths proves
            raise CannotFit(f"{where}: an uneven split whose pieces move with the length (their number may change)")
        try:
            val = _fit_val(a.meta.get("val"), b.meta.get("val"), length_a, length_b, where, alike)
        except _NotDense:
            if a.op != "call_function":
                raise CannotFit(f"{where}: an input whose strides move with the length") from None
            val = _RUN
        if val is _RUN or _varies(val):
            vals[a] = val
    named = lambda x: _Named(x.name) if isinstance(x, fx.Node) else x  # noqa: E731
    return LengthFit(first, (length_a, length_b), {n.name: tuple(map(named, v)) for n, v in args.items()},
                     {n.name: v for n, v in vals.items()}, _Reads.of(first, vals), _CodeTemplate.of(first, args))


def affine_in_length(graph: fx.Graph, length) -> bool:
    """Is every size and every integer value in `graph` (a LogicGraph) of degree at most 1 in the
    sympy symbol `length`? Then an op's integer arguments, computed from them, are affine too.
    Answered once per graph and symbol (a LogicGraph is never edited; every fit asks)."""
    known = _AFFINE.setdefault(graph, {})
    if length not in known:
        known[length] = _affine_in_length(graph, length)
    return known[length]


_AFFINE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> {symbol: affine_in_length}


def _affine_in_length(graph: fx.Graph, length) -> bool:
    def degree_ok(s) -> bool:
        if not isinstance(s, torch.SymInt):
            return True
        key = s.node.expr
        if length not in key.free_symbols or key == length:
            return True
        if key not in degrees:
            # a floor division by a constant counts as a division: the fit keeps to the lengths it
            # divides (`Affine.at`)
            expr = key.replace(lambda e: isinstance(e, FloorDiv) and e.args[1].is_number,
                               lambda e: e.args[0] / e.args[1])
            try:
                degrees[key] = sympy.Poly(expr, length).degree()
            except sympy.PolynomialError:  # Mod, Max, ...: not a polynomial in the length
                degrees[key] = None
        return degrees[key] is not None and degrees[key] <= 1

    degrees: dict = {}
    for n in graph.nodes:
        val = n.meta.get("val")
        for v in (val if isinstance(val, (tuple, list)) else (val,)):
            if isinstance(v, torch.Tensor) and not all(degree_ok(s) for s in v.shape):
                return False
            if isinstance(v, torch.SymInt) and not degree_ok(v):
                return False
    return True
