"""The one module that touches torch.distributed.tensor's private sharding machinery.

We reuse DTensor's op sharding strategies (hundreds of aten ops) at compile time, on specs built
from global shapes, without creating any DTensor. Everything private is imported here so that an
upstream change breaks one file. Pinned to torch 2.13.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
from collections.abc import Iterator, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import _sharding_prop as _sp
from torch.distributed.tensor import placement_types as _placement_types
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, OutputSharding
from torch.distributed.tensor._ops import utils as _op_utils
from torch.distributed.tensor._redistribute import redistribute_local_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard, _MaskPartial

from hotswitch.distconfig import chunk_span

from ._torch import arg_leaves

MaskPartial = _MaskPartial  # DTensor's vocab-parallel embedding partial: its offset is a rank's own

__all__ = [
    "DTensorSpec", "DeviceMesh", "OpSchema", "OutputSharding", "Partial", "Placement", "Replicate",
    "Shard", "StridedShard", "make_spec", "spec", "propagate", "propagation", "redistribute", "local_shape", "has_rule",
    "torch_functions", "from_local", "encode_placements", "decode_placements", "encode_spec", "decode_spec",
    "MaskPartial", "register_mesh_dim_strategies",
]

from torch.distributed.tensor.placement_types import _StridedShard as StridedShard  # noqa: E402

_propagator = DTensor._op_dispatcher.sharding_propagator


# ------------------------------------------------------------------ hotswitch's policy, scoped
# Two changes to DTensor's strategy search, active only inside `propagation()` and undone on exit
# (as DTensor's own `use_min_cost_redistribution_plan` does), so the user's DTensor / FSDP2 code and
# DCP resharding never run under them:
# - selection: never shard one tensor dim over two mesh axes when another strategy exists, and
#   keep parameters (the `pinned` inputs of the op being propagated) in the layout their config gave
#   them (Megatron's rule);
# - pricing: strategy expansion prices every candidate input placement with `redistribute_cost`;
#   for _StridedShard specs that runs a graph search per call (~40 ms), and DTensor's own cache keys
#   on whole specs, so it almost never hits across the nodes of one graph. The price depends only on
#   the mesh's shape and devices, both placements (with shard orders), the global shape and dtype:
#   memoized on those values, for the whole process (every model and config compiled in it).
_pinned: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar("hotswitch_pinned", default=frozenset())
_memo: contextvars.ContextVar[dict | None] = contextvars.ContextVar("hotswitch_memo", default=None)


def _mesh_key(mesh) -> tuple:
    """A mesh as values (device type, shape, devices, axis names), computed once per mesh object per
    memo (`DeviceMesh.mesh` rebuilds its tensor on every access)."""
    keys = _memo.get()["mesh"]
    entry = keys.get(id(mesh))
    if entry is None or entry[0] is not mesh:
        grid = mesh.mesh
        entry = keys[id(mesh)] = (mesh, (mesh.device_type, tuple(grid.shape), tuple(grid.flatten().tolist()),
                                         mesh.mesh_dim_names))
    return entry[1]


def _spec_key(spec) -> tuple:
    meta = spec.tensor_meta
    return (spec.placements, getattr(spec, "shard_order", None),
            None if meta is None else (tuple(meta.shape), meta.dtype))


_COSTS: dict[tuple, float] = {}  # (mesh, current, target) as values -> DTensor's redistribute_cost


def _memoized_cost(original, current: DTensorSpec, target: DTensorSpec) -> float:
    key = (_mesh_key(current.mesh), _spec_key(current), _spec_key(target))
    cost = _COSTS.get(key)
    if cost is None:
        if len(_COSTS) > 200_000:
            _COSTS.clear()
        cost = _COSTS[key] = original(current, target)
    return cost


def _nests_one_dim(spec) -> bool:
    specs = spec if isinstance(spec, (tuple, list)) else (spec,)
    for s in specs:
        dims = [p.dim for p in getattr(s, "placements", ()) if isinstance(p, Shard)]
        if len(dims) != len(set(dims)):
            return True
    return False


def _select_keeping_pinned(original, strategy: OpStrategy, op_schema: OpSchema | None = None):
    nested_inputs = op_schema is not None and any(_nests_one_dim(s) for s in op_schema.args_spec)
    if len(strategy.strategies) > 1 and not nested_inputs:
        # Never shard one tensor dim over two mesh axes when another choice exists: Megatron layouts
        # do not, and DTensor's local shapes for flattening nested uneven shards are inconsistent.
        # (Where an input already is, [batch x seq] rows under dp x cp say, its rows stay put.)
        flat = [s for s in strategy.strategies if not _nests_one_dim(s.output_specs)]
        if flat and len(flat) < len(strategy.strategies):
            strategy = OpStrategy(flat)
    pinned = _pinned.get()
    if pinned and op_schema is not None and len(strategy.strategies) > 1:
        current = op_schema.args_spec
        keep = [
            s for s in strategy.strategies
            if all(i >= len(current) or s.input_specs is None
                   or s.input_specs[i].placements == current[i].placements for i in pinned)
        ]
        if keep:
            strategy = OpStrategy(keep)
    return original(strategy, op_schema)


@contextlib.contextmanager
def propagation(memo: dict | None = None) -> Iterator[dict]:
    """hotswitch's strategy selection and cost memo, only inside this block; torch's own functions
    are back on exit (also on error). `memo` (a dict the caller owns, e.g. one per compiled model)
    caches propagation results across the graphs lowered with it (prices, plain values, are kept for
    the whole process); it dies with its owner. Nested blocks reuse the outer one's memo."""
    if _memo.get() is not None:
        yield _memo.get()
        return
    memo = {} if memo is None else memo
    memo.setdefault("op", {})
    memo.setdefault("mesh", {})
    original_cost, original_select = _op_utils.redistribute_cost, _sp._select_min_cost_strategy
    _op_utils.redistribute_cost = functools.partial(_memoized_cost, original_cost)
    _sp._select_min_cost_strategy = functools.partial(_select_keeping_pinned, original_select)
    token = _memo.set(memo)
    try:
        yield memo
    finally:
        _memo.reset(token)
        _op_utils.redistribute_cost, _sp._select_min_cost_strategy = original_cost, original_select


def torch_functions() -> tuple:
    """The torch functions `propagation()` replaces while it is active, (strategy selection, cost
    function): tests check they are torch's own outside it."""
    return _sp._select_min_cost_strategy, _op_utils.redistribute_cost


def spec(mesh: DeviceMesh, placements: Sequence[Placement], tensor_meta: TensorMeta | None) -> DTensorSpec:
    """The one way hotswitch builds a spec. A _StridedShard here is always a view's strided rows
    (the split factor the dims folded in front of it), as DTensor's own strategies produce it: a
    spec built plainly would read it as a shard order instead (DTensorSpec's default), which is
    neither equal to DTensor's spec of the same placements nor priced alike (any redistribution
    between the two costs inf), so a decision made on DTensor's specs and replayed on rebuilt ones
    came out otherwise: ranks replaying another's decisions lowered other collectives, and hung."""
    placements = tuple(placements)
    if any(isinstance(p, StridedShard) for p in placements):
        return DTensorSpec(mesh, placements, tensor_meta, use_strided_shard_as_shard_order=False)
    return DTensorSpec(mesh, placements, tensor_meta)


def make_spec(mesh: DeviceMesh, placements: Sequence[Placement], meta: torch.Tensor) -> DTensorSpec:
    """A spec for a global tensor described by `meta` (a fake or real tensor of the global shape)."""
    return spec(mesh, placements, TensorMeta(meta.shape, meta.stride(), meta.dtype))


def encode_spec(spec: DTensorSpec) -> tuple:
    """A spec without its mesh, as plain values (a cached program's output specs)."""
    meta = spec.tensor_meta
    return encode_placements(tuple(spec.placements)), tuple(meta.shape), tuple(meta.stride), meta.dtype


def decode_spec(mesh: DeviceMesh, encoded: tuple) -> DTensorSpec:
    placements, shape, stride, dtype = encoded
    return spec(mesh, decode_placements(placements), TensorMeta(torch.Size(shape), stride, dtype))


_PLAIN_CODES = {Replicate: lambda p: ("R",), Shard: lambda p: ("S", p.dim), Partial: lambda p: ("P", p.reduce_op),
                StridedShard: lambda p: ("SS", p.dim, int(p.split_factor))}


def encode_placements(obj):
    """Placements (nested in tuples and lists) as plain tuples, for ShardingDecisions and the
    persistent cache: ("R",), ("S", dim), ("SS", dim, split_factor), ("P", op) and, for DTensor's
    vocab-parallel embedding, ("MP", op, offset_shape, offset_dim, link): the placements of one
    decision that share a mask share a link number (the mask is made where the indices are
    redistributed and applied where the output is reduced)."""
    links: dict[int, int] = {}

    def one(p):
        kind = type(p)
        if kind is tuple or kind is list:
            return kind(one(q) for q in p)
        if p is None:
            return None
        plain = _PLAIN_CODES.get(kind)  # by exact type first: an isinstance on a placement class
        if plain is not None:  # goes through torch's opaque-type check (a million per lowering)
            return plain(p)
        if isinstance(p, _MaskPartial):
            link = links.setdefault(id(p.mask_buffer), len(links))
            shape = None if p.offset_shape is None else tuple(p.offset_shape)
            return ("MP", p.reduce_op, shape, p.offset_dim, link)
        if isinstance(p, StridedShard):
            return ("SS", p.dim, int(p.split_factor))
        if isinstance(p, Shard):
            return ("S", p.dim)
        if isinstance(p, Partial):
            return ("P", p.reduce_op)
        if isinstance(p, Replicate):
            return ("R",)
        raise ValueError(f"cannot encode placement {p!r}")

    return one(obj)


def decode_placements(obj):
    """`encode_placements` inverted, with fresh objects: linked _MaskPartials share a new mask buffer."""
    buffers: dict[int, object] = {}

    def one(e):
        if e is None:
            return None
        if isinstance(e, list) or (isinstance(e, tuple) and e and not isinstance(e[0], str)) or e == ():
            return type(e)(one(q) for q in e)
        kind = e[0]
        if kind == "R":
            return Replicate()
        if kind == "S":
            return Shard(e[1])
        if kind == "SS":
            return StridedShard(e[1], split_factor=e[2])
        if kind == "P":
            return Partial(e[1])
        if kind == "MP":
            from torch.distributed.tensor._ops._mask_buffer import MaskBuffer

            buffer = buffers.setdefault(e[4], MaskBuffer())
            return _MaskPartial(e[1], mask_buffer=buffer, offset_shape=None if e[2] is None else torch.Size(e[2]),
                                offset_dim=e[3])
        raise ValueError(f"cannot decode placement {e!r}")

    return one(obj)


def from_local(local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], shape) -> DTensor:
    """A DTensor of global `shape` (contiguous) from this rank's shard, without communication: the
    one place hotswitch wraps shards (full tensors, DCP states, benchmarks' baselines)."""
    shape = tuple(shape)
    return DTensor.from_local(local, mesh, tuple(placements), run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def register_mesh_dim_strategies(op, strategies, num_outputs: int, is_valid=None) -> None:
    """Give DTensor a sharding rule for one of our own ops: `strategies(op_schema)` lists, for one mesh
    dim, acceptable placements (outputs first, then inputs); DTensor expands them over every mesh
    dim and prices the redistributions. `is_valid(mesh, input_specs, output_spec)` drops
    combinations (a placement allowed on one named axis only). Registering a rule for an op torch
    does not know changes nothing torch does for its own ops."""

    def strategy(op_schema: OpSchema):
        mesh = op_schema.get_mesh_from_args()
        valid = None if is_valid is None else (lambda ins, out: is_valid(mesh, ins, out))
        return _op_utils.expand_to_full_mesh_op_strategy(mesh, op_schema, strategies(op_schema),
                                                         input_index=num_outputs, is_valid_strategy_cb=valid)

    _op_utils.register_op_strategy(op)(strategy)


def has_rule(op) -> bool:
    p = _propagator
    return (op in p.op_strategy_funcs or op in p.op_to_rules
            or op in getattr(p, "op_single_dim_strategy_funcs", {})
            or (hasattr(_sp, "DecompShardingStrategy") and _sp.DecompShardingStrategy.has_decomp(op)))  # 2.13 only


def propagate(op, args_schema: tuple, kwargs_schema: dict, pinned: frozenset[int] = frozenset()) -> OutputSharding:
    """DTensor's sharding propagation for one op on specs, under `propagation()`'s policy; `pinned`
    inputs keep their placements. Results are cached in the active memo, never in DTensor's own
    cache (which the user's DTensor code reads)."""
    memo = _memo.get()
    assert memo is not None, "dt.propagate runs inside `with dt.propagation(): ...`"
    schema = OpSchema(op, args_schema, kwargs_schema, schema_info=_propagator.op_to_schema_info.get(op))
    # OpSchema compares only its specs for ops registered without a RuntimeSchemaInfo: the two
    # embedding backwards of a model with learned positions (num_weights 1001 and 256, same specs)
    # were one entry, and the second took the first's output shape. The other arguments join the key.
    others = tuple(a for a in arg_leaves((args_schema, kwargs_schema)) if not isinstance(a, DTensorSpec))
    key = (schema, pinned, others)
    try:
        cached = memo["op"].get(key)
    except TypeError:  # an unhashable argument: no caching for this op
        key, cached = None, None
    if cached is not None:
        return copy.copy(cached)
    token = _pinned.set(pinned)
    try:
        out = _propagator.propagate_op_sharding_non_cached(schema)
    finally:
        _pinned.reset(token)
    if key is not None:
        memo["op"][key] = copy.copy(out)
    return out


def redistribute(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec) -> torch.Tensor:
    """Local-shard redistribution; under make_fx tracing it records functional collectives."""
    gathered = _gather_strided(local, src, dst)
    if gathered is not None:
        return gathered
    if _nests_strided(src) or _nests_strided(dst):
        return _redistribute_nested(local, src, dst)
    with _shard_to_shard_by_all_gather():
        return redistribute_local_tensor(local, src, dst)


def _shards(p, dim: int | None = None) -> bool:
    return isinstance(p, (Shard, StridedShard)) and (dim is None or p.dim == dim)


def _nests_strided(spec: DTensorSpec) -> bool:
    """Is a tensor dim sharded over two mesh dims, one of them by a _StridedShard ([batch x seq]
    rows sequence-sharded over cp and split over dp or tp)?"""
    dims = [p.dim for p in spec.placements if _shards(p)]
    return any(isinstance(p, StridedShard) and dims.count(p.dim) > 1 for p in spec.placements)


def _redistribute_nested(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec) -> torch.Tensor:
    """`redistribute` where a tensor dim is sharded over several mesh dims, one of them strided.
    DTensor's planner sizes each step's gather by the plain Shards of the mesh dims before it only
    (its greedy path, taken whenever a _StridedShard is not a shard order): after cp's _StridedShard
    of [batch x seq] rows and tp's Shard of the batch, a gather over tp took its piece for the whole
    dim and refused to unpad ("Expected cond to be True"); its strided gathers of uneven pieces
    disagree in size across ranks (gloo aborts), and a strided shard inside a Shard gathered into
    wrong values. Done here in mesh order (the order `local_shape` composes):
    innermost first, every shard that changes, or that nests in a changing one, is gathered (each
    gather sized by the mesh dims before it); then, outermost first, each mesh dim takes its target
    (a local chunk, a strided local chunk, a reduction or a reduce-scatter)."""
    mesh, shape, target = src.mesh, src.shape, dst.placements
    current = list(src.placements)
    changed_from: dict[int, int] = {}  # tensor dim -> first mesh dim whose sharding of it changes
    for i, (a, b) in enumerate(zip(current, target)):
        if a != b:
            for p in (a, b):
                if _shards(p):
                    changed_from.setdefault(p.dim, i)
    for i in reversed(range(mesh.ndim)):
        p = current[i]
        if _shards(p) and (p != target[i] or changed_from.get(p.dim, mesh.ndim) < i):
            size = _logical_size(shape, mesh, current, i, p.dim)
            if isinstance(p, StridedShard):
                local = _strided_whole(local, p.dim, int(p.split_factor), size, mesh, i)
            else:
                local = p._to_replicate_tensor(local, mesh, i, _with_dim(shape, p.dim, size))
            current[i] = Replicate()
    for i in range(mesh.ndim):
        p, q = current[i], target[i]
        if p == q:
            continue
        if p.is_replicate() and isinstance(q, StridedShard):
            local = _strided_piece(local, q.dim, int(q.split_factor), mesh, i)
        elif p.is_replicate() and _shards(q):
            local = q._replicate_to_shard(local, mesh, i, mesh.get_local_rank(i))
        elif p.is_partial() and q.is_replicate():
            local = p._reduce_value(local, mesh, i)
        elif p.is_partial() and type(q) is Shard:
            local = p._reduce_shard_value(local, mesh, i, q)
        else:
            raise NotImplementedError(f"redistribution {src.placements} -> {dst.placements}: no step {p} -> {q} "
                                      f"on mesh dim {i}")
        current[i] = q
    return local


def _logical_size(shape, mesh, placements, i: int, dim: int) -> int:
    """The size of `dim` as mesh dims 0..i-1 leave it on this rank (the piece mesh dim i shards);
    torch.chunk's semantics, _StridedShards as `strided_runs` (with this rank's coordinates as
    plain ints: under make_fx DTensor's own helper reads them as data-dependent symbols)."""
    size, coordinate = int(shape[dim]), mesh.get_coordinate()
    for j, p in enumerate(placements[:i]):
        if not _shards(p, dim):
            continue
        n, c = mesh.size(j), coordinate[j]
        if isinstance(p, StridedShard):
            size = sum(length for _, _, length in strided_runs(size, int(p.split_factor), n)[c])
        else:
            size = chunk_span(size, n, c)[1]
    return size


def _with_dim(shape, dim: int, size: int) -> list[int]:
    out = list(shape)
    out[dim] = size
    return out


def _strided_piece(whole: torch.Tensor, dim: int, split_factor: int, mesh, i: int) -> torch.Tensor:
    """This rank's _StridedShard(dim, split_factor) piece over mesh dim `i` of a tensor it holds whole
    along `dim` (a local slice; `strided_runs`)."""
    runs = strided_runs(whole.shape[dim], split_factor, mesh.size(i))[mesh.get_local_rank(i)]
    return torch.cat([whole.narrow(dim, start, length) for start, _, length in runs], dim=dim).contiguous()


def _all_gather_and_chunk(original, input, gather_dim, shard_dim, mesh, mesh_dim):
    """Shard(gather_dim) -> Shard(shard_dim) on a CPU mesh: what DTensor does there (gloo has no
    all-to-all), without its log line, which every process would print once."""
    if mesh.device_type != "cpu":
        return original(input, gather_dim, shard_dim, mesh, mesh_dim)
    from torch.distributed import _functional_collectives as funcol

    out = funcol.all_gather_single(input, gather_dim, (mesh, mesh_dim))
    if isinstance(out, funcol.AsyncCollectiveTensor):
        out = out.wait()
    return Shard._custom_chunk(out, mesh.size(mesh_dim), dim=shard_dim)[mesh.get_local_rank(mesh_dim)].contiguous()


@contextlib.contextmanager
def _shard_to_shard_by_all_gather() -> Iterator[None]:
    """For one `redistribute_local_tensor` call: a shard-dim change on a CPU mesh is traced as
    all-gather + chunk (DTensor's own CPU path, so the graph is the same) instead of through
    DTensor's fallback, which logs "CPU process group does not support alltoall yet" on every rank.
    torch's function is back on exit, as in `propagation()`."""
    original = _placement_types.shard_dim_alltoall
    _placement_types.shard_dim_alltoall = functools.partial(_all_gather_and_chunk, original)
    try:
        yield
    finally:
        _placement_types.shard_dim_alltoall = original


def _gather_strided(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec) -> torch.Tensor | None:
    """_StridedShard(d, sf) -> Replicate (or -> Shard(e), e another dim no other mesh dim shards) on
    one mesh dim: one all-gather, the gathered blocks put back in order (then this rank's chunk of
    dim e). (Heads sharded over tp and then folded into the batch dim, [B, H, T, d] -> [B*H, T, d],
    and sequence-parallel rows flattened with the batch are such shards.) When sf x the mesh dim's
    size divides the tensor dim, the blocks are one transpose apart; otherwise (2 kv heads over 4
    ranks) each rank's piece is padded to the largest, and the pieces' runs are cut out of the
    gathered tensor and concatenated in order (`strided_runs`). DTensor's general path rebuilds the
    order from per-rank index tensors, which costs 0.2-0.5 s per call to trace and leaves an
    index_select in the graph. None when the case does not apply."""
    changed = [i for i, (a, b) in enumerate(zip(src.placements, dst.placements)) if a != b]
    if len(changed) != 1:
        return None
    i = changed[0]
    placement, target = src.placements[i], dst.placements[i]
    if not isinstance(placement, StridedShard):
        return None
    d = placement.dim
    if any(_shards(p, d) for j, p in enumerate(src.placements) if j != i):
        return None
    if not target.is_replicate():
        if type(target) is not Shard or target.dim == d or any(
                _shards(p, target.dim) for spec in (src, dst) for j, p in enumerate(spec.placements) if j != i):
            return None
    whole = _strided_whole(local, d, int(placement.split_factor), int(src.shape[d]), src.mesh, i)
    if target.is_replicate():
        return whole
    return Shard._custom_chunk(whole, src.mesh.size(i), dim=target.dim)[src.mesh.get_local_rank(i)].contiguous()


def _strided_whole(local: torch.Tensor, d: int, sf: int, size: int, mesh, i: int) -> torch.Tensor:
    """The `size` elements of dim `d` that mesh dim `i` shards _StridedShard(d, sf), gathered from
    every rank's piece and put back in order (see `_gather_strided`)."""
    from torch.distributed import _functional_collectives as funcol

    n = mesh.size(i)
    if size % (sf * n) == 0:
        gathered = funcol.all_gather_tensor(local.contiguous(), gather_dim=d, group=(mesh, i))
        shape = list(gathered.shape)
        blocks = gathered.view(*shape[:d], n, sf, size // (sf * n), *shape[d + 1:])  # [rank, piece, chunk]
        return blocks.transpose(d, d + 1).reshape(*shape[:d], size, *shape[d + 1:])
    runs = strided_runs(size, sf, n)
    widest = max(sum(length for _, _, length in rank) for rank in runs)
    if local.shape[d] < widest:
        pad = [0, 0] * (local.dim() - 1 - d) + [0, widest - local.shape[d]]
        local = torch.nn.functional.pad(local, pad)
    gathered = funcol.all_gather_tensor(local.contiguous(), gather_dim=d, group=(mesh, i))
    return strided_in_order(gathered, runs, widest, d)


def strided_in_order(gathered: torch.Tensor, runs: list, widest: int, dim: int) -> torch.Tensor:
    """The whole dim from every rank's piece (`strided_runs`), each padded to `widest` and gathered
    in rank order along `dim`: the pieces' runs cut out and concatenated in global order."""
    pieces = sorted((start, r * widest + offset, length) for r, rank in enumerate(runs)
                    for start, offset, length in rank if length)
    return torch.cat([gathered.narrow(dim, at, length) for _, at, length in pieces], dim=dim)


def strided_runs(size: int, split_factor: int, ranks: int) -> list[list[tuple[int, int, int]]]:
    """Where each rank's piece of a dim of `size` under _StridedShard(split_factor) over `ranks`
    comes from: per rank, its runs (global start, offset in its piece, length) in its piece's order.
    torch.chunk's semantics twice, as DTensor splits: the dim into `split_factor` pieces, each piece
    into `ranks` chunks (fewer chunks than asked are empty), rank r holding every piece's chunk r."""
    def chunks(start: int, length: int, k: int) -> list[tuple[int, int]]:
        return [(start + at, width) for at, width in (chunk_span(length, k, j) for j in range(k))]

    runs: list[list[tuple[int, int, int]]] = [[] for _ in range(ranks)]
    filled = [0] * ranks
    for start, length in chunks(0, size, split_factor):
        for r, (begin, width) in enumerate(chunks(start, length, ranks)):
            runs[r].append((begin, filled[r], width))
            filled[r] += width
    return runs


def local_shape(spec: DTensorSpec) -> tuple[int, ...]:
    return local_shape_and_offset(spec)[0]


def local_shape_and_offset(spec: DTensorSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's piece of a global tensor (torch.chunk semantics, uneven shards included)."""
    shape, offset = compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)
    return tuple(shape), tuple(offset)

