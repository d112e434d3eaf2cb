"""The private torch APIs the compiler uses outside torch.distributed.tensor (that is `_dtensor.py`),
behind names of ours, so that an upstream change breaks this file and no other. Pinned to torch 2.13."""
from __future__ import annotations

import builtins
import contextlib
import functools
import hashlib
import linecache
import marshal
import sys
import types
from dataclasses import dataclass, replace

import torch
from torch._decomp import core_aten_decompositions
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.node import map_aggregate
from torch.utils import _pytree as pytree
from torch.utils._sympy.functions import FloorDiv  # a SymInt's floor division, in sympy

__all__ = ["FakeTensorMode", "FloorDiv", "OpName", "OpOverload", "WrittenCode", "add_node", "allocated_peak",
           "ancestors", "arg_leaves", "codegen",
           "codeless_module", "codeless_modules", "copied_graph", "copy_node", "core_aten_decompositions",
           "detect_fake_mode", "graph_built", "graph_module", "half_precision_math_attention", "inductor_compile",
           "inductor_default_cache_dir", "is_mutable", "lists_codegen", "map_args", "meta_like", "module_with_code",
           "module_with_lazy_graph", "op_of", "op_schema", "pytree", "python_code", "renamed_strings", "sdpa_backend",
           "size_hint", "symbolic_fake_mode", "symbols_of", "with_code", "written_code",
           "meta_state_on"]

OpOverload = torch._ops.OpOverload


def map_args(fn, args):
    """`fn` applied to every leaf of an fx node's arguments (tuples, lists, dicts, slices; None is a
    leaf), the structure kept. fx's own C++ walk: a lowering maps every node's arguments several times,
    and pytree's generic walk (type registry lookups per level) was 40% of replaying a new length."""
    return map_aggregate(args, fn)


def arg_leaves(args) -> list:
    """The leaves of an fx node's arguments in order, as `map_args` visits them (None included)."""
    leaves: list = []
    map_aggregate(args, leaves.append)
    return leaves


def meta_like(value):
    """Shapes, strides and dtypes of `value` (a tensor, or a tuple or list of them) on the meta device."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":
            return value
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (tuple, list)):
        return type(value)(meta_like(v) for v in value)
    return value


def add_node(graph, op: str, target, args: tuple = (), kwargs: dict | None = None, name: str | None = None,
             type_expr=None):
    """`graph.create_node(op, target, args, kwargs, name=name, type_expr=type_expr)` without torch
    2.13's walk of every argument in search of a raw SymInt, which it would warn about (a pytree walk
    per node: a fifth of loading an ExecGraph from the compile cache). The compiler's graphs hold a
    size as an int or as a node, never as a raw SymInt. The arguments are then set by what fx's
    `args` and `kwargs` setters call, once for both and without `Node.__setattr__`'s lookups (which
    made copying a node cost twice what making it does)."""
    node = graph.create_node(op, target, name=name, type_expr=type_expr)
    if args or kwargs:
        node._update_args_kwargs(args, kwargs if kwargs is not None else {})
    return node


def copy_node(graph, node, arg_transform):
    """`graph.node_copy(node, arg_transform)` through `add_node`: its meta copied."""
    args, kwargs = map_aggregate((node.args, node.kwargs),
                                 lambda a: arg_transform(a) if isinstance(a, torch.fx.Node) else a)
    new = add_node(graph, node.op, node.target, args, kwargs, name=node.name, type_expr=node.type)
    new.meta.update(node.meta)
    return new


def ancestors(roots) -> set:
    """The fx nodes among `roots` and every node they read, transitively (non-nodes ignored)."""
    seen: set = set()
    stack = [r for r in roots if isinstance(r, torch.fx.Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def copied_graph(graph):
    """A copy of `graph` to edit, its nodes made by `copy_node`: each node's meta is a new dict holding
    the same values (never written to), where `copy.deepcopy` copied every value and made each node
    through `Graph.create_node` (a third of a second for a 32-layer program)."""
    out, env = torch.fx.Graph(), {}
    codegen(out, codegen(graph))
    for node in graph.nodes:
        env[node] = copy_node(out, node, env.__getitem__)
    return out


def sdpa_backend(query, key, value, attn_mask, is_causal: bool, scale: float) -> str:
    """The kernel `scaled_dot_product_attention` runs for these inputs (their device, shapes, strides,
    dtypes, whether they take gradients) under torch's current backend flags: "flash", "efficient",
    "cudnn" or "math"; "none" where no enabled kernel takes them, "other" for another device's."""
    from torch.nn.attention import SDPBackend

    try:
        choice = torch._fused_sdp_choice(query, key, value, attn_mask, 0.0, is_causal, scale=scale)
    except RuntimeError:  # on CUDA: "No available kernel" (none of the enabled ones takes these inputs)
        return "none"
    return {SDPBackend.FLASH_ATTENTION.value: "flash", SDPBackend.EFFICIENT_ATTENTION.value: "efficient",
            SDPBackend.CUDNN_ATTENTION.value: "cudnn", SDPBackend.MATH.value: "math"}.get(int(choice), "other")


@contextlib.contextmanager
def half_precision_math_attention():
    """Within: the math decomposition of `scaled_dot_product_attention` keeps bf16/fp16 inputs in
    their dtype (matmuls accumulate in fp32 all the same; softmax computes in fp32 on CUDA) instead
    of upcasting q, k, v to fp32. A bf16 ExecGraph otherwise ran its attention as fp32 matmuls, 3.4x
    slower than the HF model on an H100. The flag is torch's process-wide one: restored on exit."""
    allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        yield
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allowed)


@contextlib.contextmanager
def meta_state_on(device: torch.device):
    """Within: torch.export (non-strict) fakes a module's meta-device parameters and buffers as
    tensors on `device` (fakes hold no data either way), so a model built under
    `torch.device("meta")` traces as it would on `device`, beside inputs on `device`. Export's
    helper is module-level state: wrapped here, restored on exit."""
    from torch.export import _trace

    original = _trace._fakify_params_buffers

    def fakify(fake_mode, module):
        faked, moved = original(fake_mode, module), {}
        for name, fake in faked.items():
            if fake.device.type == "meta":
                if id(fake) not in moved:
                    with fake_mode:
                        on = torch.empty_strided(fake.shape, fake.stride(), dtype=fake.dtype, device=device)
                    moved[id(fake)] = on.requires_grad_(fake.requires_grad)
                faked[name] = moved[id(fake)]
        return faked

    _trace._fakify_params_buffers = fakify
    try:
        yield
    finally:
        _trace._fakify_params_buffers = original


@contextlib.contextmanager
def codeless_modules():
    """Within: make_fx and torch.export build their GraphModules without writing their Python code
    (fx's lazy modules, as torch.compile builds them), which is written, if ever, when first read or
    run. A trace wrote the code of each intermediate module (export's passes, make_fx's result) and
    threw it away: 9 writings of a model's graphs per trace where 2 are read. Hand a module built
    here on with `with_code`."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    with _use_lazy_graph_module(True):
        yield


def codeless_module(root, graph):
    """`fx.GraphModule(root, graph)` without writing its code (a lazy module, as `codeless_modules`
    makes them), for a graph built node by node and handed on to `with_code`."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(root, graph)


def with_code(gm):
    """`gm`, its graph edited, as a plain GraphModule whose code is its graph's: one built within
    `codeless_modules` becomes a GraphModule (its code written once, here), any other is recompiled.
    (A lazy module's `recompile` only marks its code stale, and the compiler reads and sets a module's
    written code itself: `written_code`, `module_with_code`.)"""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    if not isinstance(gm, _LazyGraphModule):
        gm.recompile()
        return gm
    out = torch.fx.GraphModule(gm, gm.graph, class_name=type(gm).__name__)
    out.meta.update(gm.meta)
    return out


def inductor_compile(gm, example_inputs: list):
    """`gm` (a functional ATen graph, collectives included) compiled by Inductor ahead of time, as
    torch.compile does after dynamo: a callable on inputs like `example_inputs` returning the graph's
    outputs as a list. Raises where Inductor cannot take the graph."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # the tracing context dynamo would have set up: Inductor's FX graph cache reads its shape
    # environment (without one it bypasses the cache, and every process compiles from scratch)
    with tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv()))):
        return compile_fx(gm, example_inputs)


def inductor_default_cache_dir() -> str:
    """Where Inductor keeps its caches when TORCHINDUCTOR_CACHE_DIR is unset (it then writes this
    path into the variable itself, so finding it there does not mean a user chose it)."""
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(default_cache_dir())


def size_hint(value) -> int:
    """A concrete int for a size that may be a SymInt (its hint: the example value it was traced
    with). torch 2.13 names it `optimization_hint`; 2.11 (the GPU image's torch) `hint_int`."""
    if not isinstance(value, torch.SymInt):
        return int(value)
    from torch.fx.experimental import symbolic_shapes

    hint = getattr(symbolic_shapes, "optimization_hint", None) or symbolic_shapes.hint_int
    return int(hint(value))


def op_schema(target):
    """The schema of an aten op overload (arguments, their alias and mutation annotations)."""
    return target._schema


def lists_codegen(arg_names: list[str], lengths: list[int], num_outputs: int):
    """The code writer make_fx gives a function of lists returning a tuple (`fn(params, buffers,
    inputs) -> (outputs...)`), for a graph built node by node whose placeholders are those lists'
    items in order: its module is called as the traced one is."""
    in_spec = pytree.tree_structure(tuple([0] * n for n in lengths))
    out_spec = pytree.tree_structure(tuple([0] * num_outputs))
    return torch.fx.graph._PyTreeCodeGen(torch.fx.graph._PyTreeInfo(list(arg_names), in_spec, out_spec))


def codegen(graph, value=None):
    """How `graph` writes its Python code: the pytree flattening of its inputs and outputs for a
    make_fx graph. With `value`, set it (a graph rebuilt node by node)."""
    if value is not None:
        graph._codegen = value
    return graph._codegen


@dataclass(frozen=True)
class OpName:
    """An aten overload by its qualified name ("aten::add.Tensor"): what pickle can write of one (an
    OpOverload does not pickle)."""

    qualified: str

    @staticmethod
    def of(target):
        """`target` as pickle can write it: an overload by its name, anything else as it is."""
        return OpName(target.name()) if isinstance(target, OpOverload) else target

    def op(self) -> OpOverload:
        namespace, rest = self.qualified.split("::")
        packet, _, overload = rest.partition(".")
        return getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")


def op_of(target):
    """`OpName.of` inverted: the overload an OpName names, anything else as it is."""
    return target.op() if isinstance(target, OpName) else target


@dataclass(frozen=True)
class WrittenCode:
    """The Python code fx wrote for a GraphModule's forward: its source, the globals it runs with
    (name -> value), fx's map from its lines to nodes, the line its body starts on and, for the
    Python named by `python`, the forward's compiled code (`marshal`'s bytes; None: compile `src`)."""

    src: str
    globals: dict
    lineno_map: dict | None
    prologue_start: int
    bytecode: bytes | None = None
    python: str = sys.implementation.cache_tag


def written_code(gm, compiled: bool = True) -> WrittenCode | None:
    """The code fx wrote for `gm` when it last generated it, with its compiled code where `compiled`
    (None where fx annotates it for the profiler: that code names a file registered in this process
    only)."""
    from torch.fx.experimental import _config

    if getattr(_config, "enrich_profiler_metadata", False):
        return None
    forward = type(gm).forward
    scope = {k: v for k, v in forward.__globals__.items() if k != "__builtins__"}
    plain = compiled and forward.__defaults__ is None and forward.__kwdefaults__ is None and \
        forward.__closure__ is None and not any(isinstance(c, types.CodeType) for c in forward.__code__.co_consts)
    return WrittenCode(gm.code, scope, gm._lineno_map, getattr(gm, "_prologue_start", 0),
                       marshal.dumps(forward.__code__) if plain else None)


def renamed_strings(code: WrittenCode, names: dict[str, str]) -> WrittenCode:
    """`code` with the string literals `names` maps replaced (in its source and its compiled code)."""
    src = code.src
    for old, new in names.items():
        src = src.replace(repr(old), repr(new))
    bytecode = code.bytecode
    if bytecode is not None:
        def renamed(c):
            if type(c) is str:
                return names.get(c, c)
            return type(c)(map(renamed, c)) if type(c) in (tuple, frozenset) else c
        compiled = marshal.loads(bytecode)
        bytecode = marshal.dumps(compiled.replace(co_consts=tuple(map(renamed, compiled.co_consts))))
    return replace(code, src=src, bytecode=bytecode)


def module_with_code(root, graph, code: WrittenCode):
    """`fx.GraphModule(root, graph)` running `code`, which fx wrote for this same graph (same nodes,
    same names, same order) in another process, instead of writing it again (for an 8-layer
    ExecGraph, half of loading it from the compile cache) and, with its compiled code for this
    Python, instead of compiling it again (most of the rest)."""
    from torch.fx.graph import PythonCode

    forward = None
    if code.bytecode is not None and code.python == sys.implementation.cache_tag:
        # the source under a name of its own, for tracebacks (fx numbers its files per process)
        filename = f"<hotswitch code {hashlib.sha1(code.src.encode()).hexdigest()[:16]}>"
        linecache.cache[filename] = (len(code.src), None, code.src.splitlines(keepends=True), filename)
        compiled = marshal.loads(code.bytecode).replace(co_filename=filename)
        forward = types.FunctionType(compiled, {**code.globals, "__builtins__": builtins}, "forward")
        src = PythonCode("\ndef forward(self):\n    pass\n", {}, None, 0)  # replaced below
    else:
        src = PythonCode(code.src, dict(code.globals), code.lineno_map, code.prologue_start)

    graph.python_code = lambda root_module, **_options: src  # GraphModule's constructor asks once
    try:
        gm = torch.fx.GraphModule(root, graph)
    finally:
        del graph.python_code  # later edits write their code as usual
    if forward is not None:  # as GraphModule.recompile sets them (its class is this module's own)
        gm._code, gm._lineno_map, gm._prologue_start = code.src, code.lineno_map, code.prologue_start
        type(gm).forward = forward
    return gm


class _Unwritten(Exception):
    """A graph `python_code` leaves to fx."""


# what `python_code` writes as `repr` writes it (exact types: an IntEnum or a NamedTuple is fx's)
_PLAIN = frozenset((int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format))


def python_code(graph, root_module: str = "self", **options):
    """`graph.python_code(root_module)`: fx's code for `graph`, the same source, globals and line
    map, written 2.6x faster (an ExecGraph's nodes cost fx 12 us each, most of it bookkeeping: each
    node's repr function swapped in and out, its name looked up at each use; 8-layer tp4sp program,
    2,724 nodes: 34 -> 13 ms). For graphs of placeholders, function calls, attributes and an output,
    with plain arguments; any other (or other `options`, a verbose printout's, say) fx writes."""
    from torch.fx.graph import (
        CodeGen,
        PythonCode,
        _custom_builtins,
        _format_target,
        _is_from_torch,
        _Namespace,
        _PyTreeCodeGen,
        inplace_methods,
        magic_methods,
    )
    from torch.fx.immutable_collections import immutable_list
    from torch.fx.node import _get_qualified_name

    gen = graph._codegen
    if any(options.values()) or type(gen) not in (CodeGen, _PyTreeCodeGen) or gen._body_transformer is not None:
        return torch.fx.Graph.python_code(graph, root_module, **options)
    namespace, globals_, names, targets = _Namespace(), {}, {}, {}

    def add_global(name_hint: str, obj) -> str:  # fx's, for the same names in the same order
        if _is_from_torch(obj) and obj != torch.device:
            return _get_qualified_name(obj)
        name = namespace.create_name(name_hint, obj)
        if globals_.setdefault(name, obj) is not obj:
            raise _Unwritten
        return name

    def name_of(node) -> str:  # fx names a node when it first writes it: where it is defined
        names[node] = name = namespace.create_name(node.name, node)
        return name

    def arg(a) -> str:
        kind = type(a)
        if kind in _PLAIN:
            return repr(a)
        if kind is torch.fx.Node:
            return names[a]  # (KeyError: used before it is defined)
        if kind is list or kind is immutable_list:
            return "[" + ", ".join(map(arg, a)) + "]"
        if kind is tuple:
            return f"({arg(a[0])},)" if len(a) == 1 else "(" + ", ".join(map(arg, a)) + ")"
        if kind is OpOverload:
            return add_global(_get_qualified_name(a), a)
        if kind is slice:
            return f"slice({arg(a.start)}, {arg(a.stop)}, {arg(a.step)})"
        raise _Unwritten

    def call(node) -> str:
        target = node.target
        if node.meta.get("is_wrapped", False):
            raise _Unwritten
        if getattr(target, "__module__", "") == "_operator":
            if target.__name__ in magic_methods:
                return f"{name_of(node)} = {magic_methods[target.__name__].format(*map(arg, node.args))}"
            if target.__name__ in inplace_methods:
                raise _Unwritten
        if target is builtins.getattr:
            raise _Unwritten
        written = targets.get(target)
        if written is None:
            written = targets[target] = add_global(_get_qualified_name(target), target)
        name = name_of(node)
        args = [*map(arg, node.args), *(f"{k} = {arg(v)}" for k, v in node.kwargs.items())]
        return f"{name} = {written}({', '.join(args)})"

    try:
        for name, (_, obj) in _custom_builtins.items():
            add_global(name, obj)
        nodes = list(graph.nodes)
        last_uses: dict = {}  # node -> the values read for the last time there, as fx orders them
        seen = set()
        for node in reversed(nodes):
            for value in node._input_nodes:
                if value not in seen:
                    seen.add(value)
                    last_uses.setdefault(node, []).append(value)
        free_vars, lines, lineno_map, output = [], [], {}, None
        for index, node in enumerate(nodes):
            op = node.op
            if node.type is not None:
                raise _Unwritten
            if op == "placeholder":
                if node.args or not isinstance(node.target, str):
                    raise _Unwritten
                free_vars.append(node.target)
                raw = node.target.replace("*", "")
                if raw != name_of(node):
                    lineno_map[len(lines)] = index
                    lines.append(f"{names[node]} = {raw}")
                continue
            if op == "call_function":
                text = call(node)
            elif op == "get_attr":
                text = f"{name_of(node)} = {_format_target(root_module, node.target)}"
            elif op == "output":
                text = gen.generate_output(node.args[0], repr_fn=arg)
                output = index
            else:
                raise _Unwritten
            if op != "output":
                dead = last_uses.get(node, [])
                if not node.users:
                    dead = [*dead, node]
                if dead:
                    text += ";  " + " = ".join(names[n] for n in dead) + " = None"
            for line in text.split("\n"):
                lineno_map[len(lines)] = index
                lines.append(line)
        if output is None:
            raise _Unwritten
        lineno_map[len(lines)] = output  # (the empty line after fx's last newline)
        lines.append("")
        for name, value in gen.additional_globals():
            add_global(name, value)
        prologue = gen._call_method_with_signature_check(gen.gen_fn_def, free_vars, "", expanded_def=False)
    except (_Unwritten, KeyError):
        return torch.fx.Graph.python_code(graph, root_module, **options)
    start = prologue.count("\n") + 1
    code = "\n".join("    " + line for line in "\n".join(lines).lstrip("\n").split("\n"))
    return PythonCode(f"\n\n\n{prologue}\n{code}", globals_,
                      _lineno_map={k + start: v for k, v in lineno_map.items()}, _prologue_start=4)


def graph_module(root, graph):
    """`fx.GraphModule(root, graph)`, its code written by `python_code` (fx's code, sooner)."""
    graph.python_code = functools.partial(python_code, graph)  # GraphModule's constructor asks once
    try:
        return torch.fx.GraphModule(root, graph)
    finally:
        del graph.python_code


class _UndecodedGraph(torch.fx.Graph):
    """A GraphModule's graph not built yet: the first read of any of its attributes builds it in
    place (`build(graph)` adds the nodes), after which it is a plain `fx.Graph`, the same object."""

    def __init__(self, build, owning_module):  # fx.Graph.__init__ runs when it is built
        object.__setattr__(self, "_hotswitch_build", (build, owning_module))

    def __getattribute__(self, name):
        pending = object.__getattribute__(self, "__dict__").pop("_hotswitch_build", None)
        if pending is not None:
            build, owner = pending
            object.__setattr__(self, "__class__", torch.fx.Graph)
            torch.fx.Graph.__init__(self, owning_module=owner)
            build(self)
        return object.__getattribute__(self, name)


def module_with_lazy_graph(attrs: dict, graph_codegen, code: WrittenCode, build) -> torch.fx.GraphModule:
    """A GraphModule running `code` (see `module_with_code`) whose graph is built by `build(graph)`
    only when something reads it: running the module needs its code only, so a program loaded from
    the compile cache that nothing inspects never builds its nodes (most of loading it). `attrs`:
    the tensors the code reads as attributes, by name; `graph_codegen`: the graph's `codegen`."""
    placeholder = torch.fx.Graph()
    codegen(placeholder, graph_codegen)
    gm = module_with_code(torch.nn.Module(), placeholder, code)
    for name, value in attrs.items():
        setattr(gm, name, value)
    gm.__dict__["_graph"] = _UndecodedGraph(build, gm)  # where GraphModule keeps it; not its setter
    return gm


def graph_built(gm: torch.fx.GraphModule) -> bool:
    """Has `gm`'s graph been built (not one `module_with_lazy_graph` has yet to build)?"""
    return type(gm.__dict__.get("_graph")) is not _UndecodedGraph


def is_mutable(target) -> bool:
    """Does the op write into one of its inputs?"""
    return isinstance(target, OpOverload) and target._schema.is_mutable


def symbols_of(sym_nodes) -> dict:
    """The size symbols that SymInts' nodes (`SymInt.node`) are made of: symbol -> (example value,
    lower bound, upper bound or None), from their ShapeEnv."""
    out = {}
    for node in sym_nodes:
        env = node.shape_env
        for s in node.expr.free_symbols:
            if s not in out:
                r = env.var_to_range.get(s)
                unbounded = r is None or str(r.upper) in ("int_oo", "oo")  # torch's or sympy's infinity
                upper = None if unbounded else int(r.upper)
                out[s] = (int(env.backed_var_to_val[s]), int(r.lower) if r is not None else 0, upper)
    return out


def symbolic_fake_mode(symbols: dict):
    """A FakeTensorMode over a fresh ShapeEnv that knows `symbols` (as `symbols_of` returns them, by
    their own sympy symbols) and a function turning a sympy expression over them into a SymInt."""
    import sympy
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.utils._sympy.numbers import int_oo
    from torch.utils._sympy.value_ranges import ValueRanges

    env = ShapeEnv()
    for s, (hint, lower, upper) in symbols.items():
        env.backed_var_to_val[s] = sympy.Integer(hint)
        env.var_to_range[s] = ValueRanges(lower, int_oo if upper is None else upper)
    hints = {s: hint for s, (hint, _, _) in symbols.items()}

    def symint(expr):
        expr = sympy.sympify(expr)
        if expr.is_number:
            return int(expr)
        return env.create_symintnode(expr, hint=int(expr.subs(hints)))

    return FakeTensorMode(shape_env=env), symint


def allocated_peak(fn, *args):
    """(`fn(*args)`, the most bytes of tensors it allocated that were alive at once): torch's
    MemTracker, which follows storages through the dispatcher, so it measures a CPU run as exactly
    as `torch.cuda.max_memory_allocated` a GPU one. Tensors alive before the call are not counted."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        out = fn(*args)
    peak = tracker.get_tracker_snapshot("peak")
    return out, int(sum(by_kind["Total"] for by_kind in peak.values()))
