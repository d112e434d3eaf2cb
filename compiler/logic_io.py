"""A LogicGraph as bytes, so that one rank traces and the others load (tracing is most of a compile).

fx's own pickling of a GraphModule keeps only its Python code and traces it again, which renames
nodes, changes the graph and drops every node's metadata. Here a graph is written node by node:
name, op, target (an aten overload by its qualified name), arguments, the metadata the compiler reads
(module paths, source lines, phases) and `meta["val"]` as what it describes: a fake tensor's dtype,
device and symbolic sizes and strides, a SymInt's expression. Loading rebuilds the values in a fresh
ShapeEnv that knows the same size symbols (example values and ranges), so a loaded graph lowers to
the very ExecGraphs the traced one does, and its code (the decision cache's key) is the same. Sizes
that were one SymInt object stay one object: make_fx binds a size to the first tensor it saw it on,
so a pipeline stage's joint graph (traced again from these values) reads its sizes where the traced
one does. The Python code fx wrote for each graph is written too, and a loaded GraphModule runs it
instead of writing it again (for an 8-layer ExecGraph, half of loading it).
"""
from __future__ import annotations

import importlib
import pickle
import types
import warnings
import weakref
from dataclasses import dataclass, fields, replace

import torch
import torch.fx as fx

from ._torch import (
    OpName,
    WrittenCode,
    add_node,
    codegen,
    map_args,
    module_with_code,
    module_with_lazy_graph,
    op_of,
    renamed_strings,
    symbolic_fake_mode,
    symbols_of,
    written_code,
)
from .lengths import OUTLINE, LengthFit, program_outline
from .trace import LogicGraph

__all__ = ["dumps_fit", "dumps_logic", "dumps_program", "graph_text", "loads_fit", "loads_logic", "loads_program"]

_VERSION = 5

_GRAPH_TEXT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def graph_text(graph: fx.Graph) -> str:
    """A LogicGraph's (or a stage's) code, part of every cache key naming its lowerings: generated
    once per graph, which is never edited after tracing (0.25 s for an 8-layer Llama's joint graph:
    a saved LogicGraph carries its joint's, so a process that loads it does not generate it again)."""
    text = _GRAPH_TEXT.get(graph)
    if text is None:
        text = _GRAPH_TEXT[graph] = graph.python_code("self").src
    return text


_SKIPPED_META = ("val", "tensor_meta", "from_node", "original_aten", "eager_input_vals")  # rebuilt or process-local


@dataclass(frozen=True)
class _Ref:
    name: str  # an argument that is another node

    def __reduce__(self):  # (a call, not a dataclass's state dict: a program's entry has thousands)
        return _Ref, (self.name,)


@dataclass(frozen=True)
class _MemoryFormat:
    name: str  # "contiguous_format": pickle finds torch.memory_format values by scanning sys.modules
    # for one that reaches them, and may write a script's __mp_main__, which no other process has


@dataclass(frozen=True)
class _Module:
    name: str  # a module among the globals of a graph's code: imported again by name


@dataclass(frozen=True)
class _Group:
    axis: int  # a collective's process group: the one of this axis of the config's mesh


@dataclass(frozen=True)
class _Tensor:
    sizes: tuple
    strides: tuple
    offset: object
    dtype: torch.dtype
    device: str
    requires_grad: bool

    def __reduce__(self):
        return _Tensor, (self.sizes, self.strides, self.offset, self.dtype, self.device, self.requires_grad)


@dataclass(frozen=True)
class _SymInt:
    expr: object
    ident: int  # equal for sizes that were one SymInt object


class _Encoder:
    def __init__(self):
        self.idents: dict[int, int] = {}  # id(SymNode) -> ident
        self.alive: list = []  # the SymNodes numbered (kept alive while encoding, so ids stay unique)
        # a program's values alike in layout, one description: pickle writes it once, then refers to it
        self.layouts: dict[tuple, _Tensor] = {}

    def size(self, size):
        if not isinstance(size, torch.SymInt):
            return int(size)
        node = size.node
        if id(node) not in self.idents:
            self.idents[id(node)] = len(self.idents)
            self.alive.append(node)
        return _SymInt(node.expr, self.idents[id(node)])

    def val(self, v):
        if type(v) is torch.Tensor and v.device.type == "meta":  # a program's value: its sizes are ints
            key = (v.shape, v.stride(), v.storage_offset(), v.dtype, v.requires_grad)
            found = self.layouts.get(key)
            if found is None:
                found = self.layouts[key] = _Tensor(tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, "meta",
                                                    v.requires_grad)
            return found
        if isinstance(v, torch.Tensor):
            return _Tensor(tuple(map(self.size, v.shape)), tuple(map(self.size, v.stride())),
                           self.size(v.storage_offset()), v.dtype, str(v.device), v.requires_grad)
        if isinstance(v, torch.SymInt):
            return self.size(v)
        if isinstance(v, (list, tuple)):
            return type(v)(self.val(x) for x in v)
        if v is None or isinstance(v, (bool, int, float)):
            return v
        raise TypeError(f"cannot write a node value of type {type(v).__name__}")


def _encode_code(gm: fx.GraphModule) -> WrittenCode | None:
    """The code fx wrote for `gm`, its globals made picklable (`_portable_globals`); None where one
    is not, or where the code is not this graph's (edited since)."""
    code = written_code(gm)
    if code is None or not _writes_each_node(gm.graph, code.src):
        return None
    scope = _portable_globals(code.globals)
    return None if scope is None else replace(code, globals=scope)


def _portable_globals(scope: dict) -> dict | None:
    """A code's globals made picklable: modules by name, the rest by pickle's reference to them;
    None where one is not."""
    out = {}
    for name, value in scope.items():
        if isinstance(value, types.ModuleType):
            out[name] = _Module(value.__name__)
            continue
        try:
            pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - a closure, say: the loading process writes the code itself
            return None
        out[name] = value
    return out


def _live_globals(scope: dict) -> dict:
    return {k: importlib.import_module(v.name) if isinstance(v, _Module) else v for k, v in scope.items()}


def _writes_each_node(graph: fx.Graph, src: str) -> bool:
    """Does `src` assign each of `graph`'s computed values once, and nothing else? (A graph edited
    after its code was written has added, dropped or renamed nodes: then no.)"""
    assigned = [lhs for lhs in (line.split(" = ", 1)[0].strip() for line in src.splitlines() if " = " in line)
                if lhs.isidentifier()]  # a line per node; the inputs' unflattening assigns a tuple
    computed = {n.name for n in graph.nodes if n.op not in ("placeholder", "output")}
    return len(assigned) == len(computed) and set(assigned) == computed


def _decode_code(code: WrittenCode | None) -> WrittenCode | None:
    return None if code is None else replace(code, globals=_live_globals(code.globals))


def _encode_graph(gm: fx.GraphModule, encoder: _Encoder) -> tuple[list, dict, object, WrittenCode | None]:
    nodes, attrs, refs = [], {}, {}

    def encoded(a):  # (one _Ref per node: pickle writes it once, then refers to it)
        if isinstance(a, fx.Node):
            ref = refs.get(a)
            if ref is None:
                ref = refs[a] = _Ref(a.name)
            return ref
        return _MemoryFormat(str(a).removeprefix("torch.")) if isinstance(a, torch.memory_format) else a

    for n in gm.graph.nodes:
        args, kwargs = fx.node.map_aggregate((n.args, n.kwargs), encoded)
        target = OpName.of(n.target)
        if n.op == "get_attr":
            attrs[n.target] = getattr(gm, n.target)
        meta = {k: v for k, v in n.meta.items() if k not in _SKIPPED_META}
        nodes.append((n.name, n.op, target, args, kwargs, meta, encoder.val(n.meta.get("val"))))
    return nodes, attrs, codegen(gm.graph), _encode_code(gm)


def _decode_arg(by_name: dict):
    def decode(a):
        if isinstance(a, _Ref):
            return by_name[a.name]
        return getattr(torch, a.name) if isinstance(a, _MemoryFormat) else a
    return decode


def _decode_graph(nodes: list, attrs: dict, code, written: WrittenCode | None, fake_mode, symint, symints: dict,
                  made: dict | None = None) -> fx.GraphModule:
    graph = fx.Graph()
    codegen(graph, code)
    root = torch.nn.Module()
    for name, value in attrs.items():
        setattr(root, name, value)
    _build_nodes(graph, nodes, fake_mode, symint, symints, made)
    written = _decode_code(written)
    return module_with_code(root, graph, written) if written is not None else fx.GraphModule(root, graph)


def _build_nodes(graph: fx.Graph, nodes: list, fake_mode, symint, symints: dict, made: dict | None) -> None:
    """The encoded `nodes` added to `graph`, their meta values made again."""
    by_name = {}

    def size(v):
        if not isinstance(v, _SymInt):
            return v
        if v.ident not in symints:
            symints[v.ident] = symint(v.expr)
        return symints[v.ident]

    # a fake tensor with symbolic sizes costs milliseconds to make: one per distinct description, for
    # every graph decoded with the same `made` (a LogicGraph's forward is a part of its joint graph)
    made = {} if made is None else made
    expr = lambda s: s.expr if isinstance(s, _SymInt) else s  # noqa: E731

    def value(v, shared: bool = True):
        if isinstance(v, _Tensor):
            key = (tuple(map(expr, v.sizes)), tuple(map(expr, v.strides)), expr(v.offset), v.dtype, v.device,
                   v.requires_grad)
            if shared and key in made:
                return made[key]
            sizes, strides = [size(s) for s in v.sizes], [size(s) for s in v.strides]
            if v.device == "meta" and not any(isinstance(s, torch.SymInt) for s in (*sizes, *strides)):
                t = torch.empty_strided(sizes, strides, dtype=v.dtype, device="meta")  # as lowering made it
            else:
                with fake_mode:
                    t = torch.empty_strided(sizes, strides, dtype=v.dtype, device=v.device)
            t = t.requires_grad_(v.requires_grad) if v.dtype.is_floating_point else t
            if shared:
                made[key] = t
            return t
        if isinstance(v, _SymInt):
            return size(v)
        if isinstance(v, (list, tuple)):
            return type(v)(value(x, shared) for x in v)
        return v

    for name, op, target, args, kwargs, meta, val in nodes:
        args, kwargs = map_args(_decode_arg(by_name), (args, kwargs))
        node = add_node(graph, op, op_of(target), args, kwargs, name=name)
        node.meta.update(meta)
        if val is not None:
            # nodes alike in shape share one value (a description, never written to); inputs do not:
            # a trace of the graph would take two placeholders with one value for aliases
            node.meta["val"] = value(val, shared=op != "placeholder")
        by_name[name] = node


def dumps_logic(logic: LogicGraph) -> bytes:
    """`logic` as bytes for `loads_logic` in another process of the same torch and hotswitch."""
    graphs = {"forward": logic.forward, "joint": logic.joint}
    rest = {f.name: getattr(logic, f.name) for f in fields(logic) if f.name not in graphs}
    encoder = _Encoder()  # one numbering for both graphs: they share sizes
    encoded = {k: _encode_graph(gm, encoder) for k, gm in graphs.items()}
    symbols = symbols_of(encoder.alive)  # every size written is made of these
    written = encoded["joint"][3]  # the joint's code as its GraphModule has it: its text, not written again
    if written is not None and logic.joint.graph not in _GRAPH_TEXT:
        _GRAPH_TEXT[logic.joint.graph] = written.src
    return pickle.dumps((_VERSION, symbols, encoded, rest, graph_text(logic.joint.graph)),
                        protocol=pickle.HIGHEST_PROTOCOL)


def loads_logic(data: bytes) -> LogicGraph:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        version, *parts = pickle.loads(data)
    if version != _VERSION:
        raise ValueError(f"a LogicGraph written by another version of hotswitch ({version}, not {_VERSION})")
    symbols, encoded, rest, joint_text = parts
    fake_mode, symint = symbolic_fake_mode(symbols)
    symints: dict[int, torch.SymInt] = {}
    made: dict[tuple, torch.Tensor] = {}
    graphs = {k: _decode_graph(*parts, fake_mode, symint, symints, made) for k, parts in encoded.items()}
    _GRAPH_TEXT[graphs["joint"].graph] = joint_text
    return LogicGraph(**graphs, **rest)


def dumps_program(gm: fx.GraphModule, groups: dict[str, int]) -> bytes | None:
    """A lowered ExecGraph as bytes for `loads_program`. Its collectives name process groups, whose
    names depend on how many groups the process made before: `groups` (group name -> mesh axis) turns
    each into its axis, in the nodes and in the code. None when a collective names a group that is not
    one of the mesh's."""
    nodes, named = [], dict.fromkeys(groups, 0)  # group name -> collectives naming it
    encoded, attrs, graph_code, written = _encode_graph(gm, _Encoder())
    for name, op, target, args, kwargs, meta, val in encoded:
        if isinstance(target, OpName) and target.qualified.startswith("_c10d_functional::") and args \
                and isinstance(args[-1], str):
            if args[-1] not in groups:
                return None
            named[args[-1]] += 1
            args = (*args[:-1], _Group(groups[args[-1]]))
        nodes.append((name, op, target, args, kwargs, meta, val))
    if written is not None:
        # the code names each group once per collective, as a string literal; a literal equal to a
        # group's name anywhere else leaves the code out (the loading process writes it)
        if all(written.src.count(repr(name)) == count for name, count in named.items()):
            written = renamed_strings(written, {name: _group_token(groups[name]) for name in named})
        else:
            written = None
    # the nodes as bytes of their own: a program that runs its code unpickles them only if its graph is read
    nodes = pickle.dumps(nodes, protocol=pickle.HIGHEST_PROTOCOL)
    return pickle.dumps((_VERSION, nodes, attrs, graph_code, written, program_outline(gm)),
                        protocol=pickle.HIGHEST_PROTOCOL)


def dumps_fit(fit: LengthFit, groups: dict[str, int]) -> bytes | None:
    """A program's length fit as bytes for `loads_fit`, its nodes by name and its collectives'
    process groups by mesh axis (`groups`: group name -> axis), as `dumps_program` writes them. None
    where it cannot be written (a global of its code that does not pickle, a group's name on a line
    whose integers change)."""
    portable = fit.portable({name: _group_token(axis) for name, axis in groups.items()}, _portable_globals)
    if portable is None:
        return None
    try:
        return pickle.dumps((_VERSION, portable), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - a constant that does not pickle: the fit is made again
        return None


def loads_fit(data: bytes, first: fx.GraphModule, group_names: list[str]) -> LengthFit:
    """`dumps_fit` inverted in this process, for `first` (the program it was made from, loaded from
    the cache): axis i's collectives run on `group_names[i]`."""
    version, portable = pickle.loads(data)
    if version != _VERSION:
        raise ValueError(f"a length fit written by another version of hotswitch ({version}, not {_VERSION})")
    names = {_group_token(axis): name for axis, name in enumerate(group_names)}
    return LengthFit.bound(first, portable, names, _live_globals)


def _group_token(axis: int) -> str:
    return f"<hotswitch group of mesh axis {axis}>"


def loads_program(data: bytes, group_names: list[str]) -> fx.GraphModule:
    """`dumps_program` inverted in this process: axis i's collectives run on `group_names[i]`."""
    version, *entry = pickle.loads(data)
    if version != _VERSION:
        raise ValueError(f"an ExecGraph written by another version of hotswitch ({version}, not {_VERSION})")
    encoded, attrs, graph_code, written, outline = entry

    def nodes() -> list:
        return [(name, op, target, tuple(group_names[a.axis] if isinstance(a, _Group) else a for a in args), kwargs,
                 meta, val) for name, op, target, args, kwargs, meta, val in pickle.loads(encoded)]

    if written is not None:
        written = renamed_strings(written, {_group_token(axis): name for axis, name in enumerate(group_names)})
        if all(name.isidentifier() for name in attrs):  # the code is all it takes to run: nodes built when read
            def build(graph: fx.Graph) -> None:
                codegen(graph, graph_code)
                _build_nodes(graph, nodes(), *symbolic_fake_mode({}), {}, None)
            gm = module_with_lazy_graph(attrs, graph_code, _decode_code(written), build)
            gm.meta[OUTLINE] = outline  # what a length fit checks it against, its graph unbuilt
            return gm
    fake_mode, symint = symbolic_fake_mode({})
    return _decode_graph(nodes(), attrs, graph_code, written, fake_mode, symint, {})
