"""Megatron's tensor-parallel roles, read off the graph instead of module names.

A 2-D parameter used as a matmul weight is *column-parallel* when its activation comes (through
element-wise ops, views, norms' inputs) from the replicated residual stream: an embedding, a norm, a
model input. It is *row-parallel* when its activation comes only from other matmul outputs, i.e. it
closes a block (attention out-projection: its input derives from q/k/v; MLP down: from up/gate).
Refinements, each a case Megatron handles the same way:
- a column weight whose output is split along its features (GPT-2's fused `c_attn`) is replicated:
  sharding it contiguously would mix q, k and v slices;
- a column weight whose output is viewed into heads that tp does not divide is replicated when a
  sibling projection has more heads (GQA with tp > kv heads: kv heads replicated), else an error;
- the LM head (a column weight feeding a log-softmax) is replicated; the token embedding is
  vocab-parallel (Shard(0)) unless it is tied to the head.
Roles are computed once per model; placements per config come from `param_placements`, and the
heads rule (`heads_sharded`) is the one the cluster model (`hotswitch.switch.cluster`) prices too.
"""
from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx as fx

aten = torch.ops.aten

VIEW_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
            aten.permute.default, aten.transpose.int, aten.unsqueeze.default, aten.squeeze.dim,
            aten.squeeze.dims, aten.expand.default, aten.clone.default, aten.alias.default,
            aten._to_copy.default, aten.contiguous.default}
# views whose argument 1 is the output's size (-1: inferred), and those of them that keep the numel
RESHAPE_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
SIZED_VIEW_OPS = RESHAPE_OPS | {aten.expand.default}
_TRANSPOSE_OPS = {aten.t.default, aten.transpose.int, aten.permute.default}
_MATMUL_OPS = {aten.mm.default, aten.addmm.default}
_BARRIER_OPS = {aten.native_layer_norm.default, aten.embedding.default, aten.rsqrt.default}
_SIZE_TYPES = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)


def param_views(graph: fx.Graph, num_params: int) -> set[fx.Node]:
    """The first `num_params` placeholders (the parameters) and every view of them: the nodes whose
    placement a config pins (Megatron's layout), so propagation may not redistribute them."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"][:num_params]
    derived = set(placeholders)
    for n in graph.nodes:
        if n.op == "call_function" and n.target in VIEW_OPS and n.args and n.args[0] in derived:
            derived.add(n)
    return derived


def _is_size(node: fx.Node) -> bool:
    """A (symbolic) size rather than data: sym_size and arithmetic on sizes."""
    return isinstance(node.meta.get("val"), _SIZE_TYPES)


_SOFTMAX_OPS = {aten._log_softmax.default, aten._softmax.default}


@dataclass(frozen=True)
class MatmulUse:
    node: fx.Node  # the mm/addmm
    param: str
    out_dim: int  # the parameter dim that indexes output features
    bias: str | None


class Role(str, enum.Enum):
    """A parameter's tensor-parallel role (a str, so it compares equal to its value)."""

    COLUMN = "column"  # output features sharded: Shard(out dim)
    COLUMN_BIAS = "column_bias"  # the bias of a column weight: Shard(0)
    ROW = "row"  # input features sharded; its output is partial (all-reduced or reduce-scattered)
    VOCAB = "vocab"  # a token embedding sharded over the vocabulary: Shard(0)
    REPLICATE = "replicate"  # whole on every tensor-parallel rank

    def __str__(self) -> str:
        return self.value


_SHARDED = (Role.COLUMN, Role.ROW, Role.VOCAB, Role.COLUMN_BIAS)


@dataclass(frozen=True)
class TPRoles:
    """role per parameter; shard_dims: the parameter dim to shard; heads: attention heads a column
    weight's output is viewed into; reasons: why, for error messages and `hotswitch` reports."""

    roles: dict[str, Role]
    shard_dims: dict[str, int]
    reasons: dict[str, str]
    heads: dict[str, int]

    def placement_dim(self, name: str) -> int | None:
        return self.shard_dims.get(name) if self.roles.get(name) in _SHARDED else None


def heads_sharded(heads: int, tp: int, query_heads: Iterable[int] = (), *, what: str = "a projection",
                  config: str = "") -> bool:
    """Megatron's rule for a projection viewed into `heads` attention heads under tensor parallelism
    `tp`: shard it (True) when tp divides its heads, since a rank must hold whole heads; replicate it
    (False) when it is a key/value projection of grouped-query attention with fewer heads than tp
    (`query_heads`: the heads of its sibling query projections, which tp divides) and tp is a
    multiple of its heads; anything else is a ValueError naming the tp degrees that work."""
    if heads % tp == 0:
        return True
    if tp % heads == 0 and any(q > heads and q % tp == 0 for q in query_heads):
        return False  # GQA with tp > kv heads: the kv projections are replicated, as Megatron does
    ok = [d for d in range(1, heads + 1) if heads % d == 0]
    where = f"config {config!r}: " if config else ""
    if tp % heads and any(q % tp == 0 for q in query_heads):
        raise ValueError(f"{where}tp={tp} and the {heads} key/value heads of {what} must divide one another (each rank "
                         f"keeps whole kv heads); use a tp that divides {heads} or is a multiple of it")
    raise ValueError(f"{where}tp={tp} does not divide the {heads} attention heads of {what}; choose tp from {ok} "
                     "(a tensor-parallel rank must hold whole heads)")


def param_placements(roles: TPRoles, param_names: list[str], tp: int, tp_axis: int | None, ndim: int,
                     config: str = "") -> dict[str, tuple]:
    """Megatron's placement of every parameter on a mesh of `ndim` axes whose tensor-parallel axis
    is `tp_axis` (None without TP): its role's shard dim on that axis (whole heads per rank, see
    `heads_sharded`), Replicate() everywhere else."""
    from ._dtensor import Replicate, Shard

    out = {}
    for name in param_names:
        placements = [Replicate()] * ndim
        dim = roles.placement_dim(name)
        if tp > 1 and dim is not None:
            heads = roles.heads.get(name)
            block = name.rsplit(".", 2)[0]
            siblings = [roles.heads[n] for n in param_names
                        if n != name and n.rsplit(".", 2)[0] == block and n in roles.heads]
            if heads is None or heads_sharded(heads, tp, siblings, what=name, config=config):
                placements[tp_axis] = Shard(dim)
        out[name] = tuple(placements)
    return out


def _param_of(node, placeholders: dict[fx.Node, str]) -> tuple[str, int] | None:
    """Follow view-like ops back to a parameter; return (name, number of transposes)."""
    flips = 0
    while isinstance(node, fx.Node):
        if node in placeholders:
            return placeholders[node], flips
        if node.target not in VIEW_OPS:
            return None
        if node.target in _TRANSPOSE_OPS:
            flips += 1
        node = node.args[0]
    return None


def _matmul_uses(graph: fx.Graph, params: dict[fx.Node, str]) -> list[MatmulUse]:
    uses = []
    for n in graph.nodes:
        if n.target not in _MATMUL_OPS:
            continue
        a, b = (n.args[1], n.args[2]) if n.target is aten.addmm.default else (n.args[0], n.args[1])
        found = _param_of(b, params)
        if found is None:
            continue
        name, flips = found
        bias = _param_of(n.args[0], params) if n.target is aten.addmm.default else None
        uses.append(MatmulUse(n, name, 0 if flips % 2 else 1, bias[0] if bias else None))
    return uses


def _origins(start: fx.Node, mm_param: dict[fx.Node, str], param_free: set[fx.Node], params) -> set[str]:
    """Where an activation comes from: names of matmul weights, or 'barrier' for the residual stream.
    Integer and boolean values are not followed: a document mask built from the input positions
    reaches attention's output through `where`, yet the out-projection still closes the block."""
    out, seen, stack = set(), set(), [start]
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen or n in param_free:
            continue
        seen.add(n)
        val = n.meta.get("val")
        if n in mm_param:
            out.add(mm_param[n])
        elif isinstance(val, torch.Tensor) and not (val.dtype.is_floating_point or val.dtype.is_complex):
            continue  # ids, positions, masks: they select or mask the activations, they are not one
        elif n.op == "placeholder" or n.target in _BARRIER_OPS or n in params:
            out.add("barrier")
        elif n.target in (aten.mean.dim, aten.sum.dim_IntList, aten.var_mean.correction, aten.var.correction) \
                and n.args[1] and list(n.args[1])[-1] in (-1, n.args[0].meta["val"].dim() - 1):
            out.add("barrier")  # a reduction over features: a norm
        else:  # data edges only: sizes (sym_size of a parameter or input) are not where data comes from
            stack.extend(a for a in n.all_input_nodes if not _is_size(a))
    return out


def _follow_views(node: fx.Node):
    """Users of `node` reached through view-like ops (yielding (user, value-it-consumed))."""
    stack = [node]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u.target in VIEW_OPS:
                stack.append(u)
            yield u, n


def _head_count(mm: fx.Node, features: int) -> int | None:
    """The number of heads when the matmul output is viewed [..., features] -> [..., heads, head_dim]."""
    stack = [mm]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u.target in RESHAPE_OPS:
                shape = [int(s) if not isinstance(s, fx.Node) else None for s in u.args[1]]
                if len(shape) >= 2 and shape[-1] and shape[-1] > 0 and shape[-2] == -1 and features % shape[-1] == 0:
                    return features // shape[-1]  # view(*batch, -1, head_dim), as Hugging Face writes it
                if len(shape) >= 2 and shape[-1] and shape[-2] and shape[-1] * shape[-2] == features:
                    return shape[-2]
                stack.append(u)
    return None


def _split_on_features(mm: fx.Node, features: int) -> bool:
    for u, src in _follow_views(mm):
        if u.target in (aten.split_with_sizes.default, aten.split.Tensor, aten.slice.Tensor, aten.chunk.default):
            dim = u.args[1] if u.target is not aten.slice.Tensor else (u.args[1] if len(u.args) > 1 else 0)
            if u.target in (aten.split_with_sizes.default, aten.split.Tensor, aten.chunk.default):
                dim = u.args[2] if len(u.args) > 2 else 0
            ndim = src.meta["val"].dim()
            if dim in (-1, ndim - 1) and src.meta["val"].shape[-1] == features:
                return True
    return False


def _feeds_softmax(mm: fx.Node) -> bool:
    return any(u.target in _SOFTMAX_OPS for u, _ in _follow_views(mm))


def infer_tp_roles(graph: fx.Graph, param_names: list[str], num_buffers: int = 0) -> TPRoles:
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    params = {n: name for n, name in zip(placeholders, param_names)}
    uses = _matmul_uses(graph, params)
    mm_param = {u.node: u.param for u in uses}
    # Nodes that depend on no parameter and no user input are constants (RoPE tables, masks).
    # Sizes (sym_size and arithmetic on them) are not data, so they count as constants too.
    param_free: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "call_function" and (_is_size(n) or all(a in param_free for a in n.all_input_nodes)):
            param_free.add(n)
    buffer_nodes = set(placeholders[len(param_names): len(param_names) + num_buffers])
    # buffers (e.g. inv_freq) and their descendants without params/user inputs are constants too
    inputs_nodes = {n for n in placeholders if n not in params and n not in buffer_nodes}
    for n in graph.nodes:
        if n.op == "call_function" and n not in param_free and all(
                a in param_free or (a in buffer_nodes) for a in n.all_input_nodes) and not any(
                a in inputs_nodes or a in params for a in n.all_input_nodes):
            param_free.add(n)
    param_free |= buffer_nodes

    roles, dims, reasons, heads_of = {}, {}, {}, {}
    embed_users: dict[str, fx.Node] = {}
    for n in graph.nodes:
        if n.target is aten.embedding.default and n.args[0] in params:
            embed_users[params[n.args[0]]] = n
    used_in_mm = {u.param for u in uses}
    by_param: dict[str, list[MatmulUse]] = {}
    for u in uses:
        by_param.setdefault(u.param, []).append(u)

    for name, us in by_param.items():
        if name in embed_users:
            roles[name], reasons[name] = Role.REPLICATE, "tied to an embedding"
            continue
        origin = set().union(*(_origins(u.node.args[1] if u.node.target is aten.addmm.default else u.node.args[0],
                                        mm_param, param_free, params) for u in us))
        u = us[0]
        if origin and "barrier" not in origin:
            roles[name], dims[name] = Role.ROW, 1 - u.out_dim
            reasons[name] = f"input comes from {sorted(origin)}"
            if u.bias:
                roles[u.bias], reasons[u.bias] = Role.REPLICATE, f"bias of row-parallel {name}"
            continue
        features = u.node.meta["val"].shape[-1]
        if _feeds_softmax(u.node):
            roles[name], reasons[name] = Role.REPLICATE, "LM head (feeds a log-softmax)"
        elif _split_on_features(u.node, features):
            roles[name], reasons[name] = Role.REPLICATE, "fused projection split along its features"
        else:
            roles[name], dims[name] = Role.COLUMN, u.out_dim
            reasons[name] = "input is the replicated residual stream"
            heads = _head_count(u.node, int(features))
            if heads is not None:
                reasons[name] += f"; {heads} heads"
                heads_of[name] = heads
        if u.bias and roles[name] == Role.COLUMN:
            roles[u.bias], dims[u.bias], reasons[u.bias] = Role.COLUMN_BIAS, 0, f"bias of column-parallel {name}"
        elif u.bias:
            roles[u.bias], reasons[u.bias] = Role.REPLICATE, f"bias of replicated {name}"
    for name, node in embed_users.items():
        if name in used_in_mm:
            continue
        idx = node.args[1]
        from_input = any(a.op == "placeholder" for a in _ancestors(idx))
        if from_input:
            roles[name], dims[name], reasons[name] = Role.VOCAB, 0, "token embedding (vocab-parallel)"
        else:
            roles[name], reasons[name] = Role.REPLICATE, "positional embedding"
    for name in param_names:
        roles.setdefault(name, Role.REPLICATE)
        reasons.setdefault(name, "norm, bias or other small parameter")
    return TPRoles(roles, dims, reasons, heads_of)


def _ancestors(node: fx.Node):
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        yield n
        stack.extend(a for a in n.all_input_nodes if not _is_size(a))
