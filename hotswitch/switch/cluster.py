"""Large transformers described without weights, and the layout every DistConfig gives their state.

Planning a switch needs only parameter names, shapes and layouts, so a 175B-parameter model over 1024
devices is a list of a thousand shapes here, never a tensor.

**Models** (`MODELS`; `describe_model(name)`):

- GPT-3 (Brown et al. 2020, table 2.1): 1.3B ("XL"), 2.7B, 6.7B, 13B, 175B. Learned positions for
  2048 tokens, pre-LayerNorm with bias, fused QKV `[3H, H]` + bias, attention output `[H, H]` + bias,
  MLP `fc1 [4H, H]` + bias and `fc2 [H, 4H]` + bias, final LayerNorm, LM head tied to the token
  embedding. The 50257-token vocabulary is padded to 50304 (a multiple of 128, as Megatron-LM and
  nanoGPT do), the same for every config so that a switch never changes a shape. Two entries of the
  paper's table are inconsistent with its own head size of 128 and are fixed as Megatron-LM's
  published configs do: 1.3B has 16 heads (the table says 24, but 24 x 128 != 2048) and 13B is
  5120 wide (the table says 5140, not a multiple of 40 heads).
- LLaMA-2 (Touvron et al. 2023): 7B, 13B, 70B. RMSNorm (weight only), separate q/k/v/o projections
  without bias (70B: grouped-query attention with 8 key/value heads), SwiGLU MLP `gate`/`up`
  `[I, H]` and `down [H, I]` with I = 11008 / 13824 / 28672, vocabulary 32000, untied LM head.

Parameter counts (`ModelSpec.num_params`): 1.32B, 2.65B, 6.66B, 12.85B, 174.6B, 6.74B, 13.02B, 68.98B.

**Layouts** (`layouts(model, config, num_devices)`), Megatron-LM's:

- DP replicates. TP: column-parallel weights and biases (QKV, fc1, q/k/v, gate, up) are
  `Shard(0)` (the output dim of an `[out, in]` weight), row-parallel weights (attention output,
  fc2, down) `Shard(1)`, token embedding and LM head vocab-parallel `Shard(0)`, norms, row-parallel
  biases and learned positions replicated. Megatron stores the fused QKV interleaved per head, so
  `Shard(0)` gives every rank its own heads' q, k and v.
- Grouped-query attention with tp > number of kv heads (LLaMA-2 70B at tp 16): the k/v projections
  are replicated over tp, the rule the compiler builds (`hotswitch.compiler.tp_rules.heads_sharded`,
  shared), so a plan prices the layout a compiled model really has.
- SP shards activations only: it does not change a parameter's layout.
- FSDP: the dp axis shards each parameter on the first dim tp leaves whole that has at least dp
  entries (`distconfig.fsdp_dim`, the compiler's rule), so parameters, gradients and optimizer
  state are each held once per dp group.
- PP: `split_stages` cuts the layers into `pp` contiguous stages balanced by parameter count
  (`hotswitch.distconfig.balanced_split`, the compiler's split too), the
  embedding (and learned positions) counted in the first stage and the final norm and LM head in the
  last. Stage s runs on `config.ranks()[s*dp*tp : (s+1)*dp*tp]` (devices [s*dp*tp, (s+1)*dp*tp) by
  default) as a (dp, tp) mesh, tp innermost: the layout of `DistConfig.mesh()`. A tied embedding
  with pp > 1 lives in the first and the last stage (Megatron keeps the copies equal with an
  all-reduce of their gradients): a ("tied", dp, tp) mesh over both stages with `Replicate()` on the
  "tied" axis, so either copy can serve a receiver.

**State moved by a switch** (`switch_moves`), bytes per parameter:

=============  =======  =========================================================
state          bytes    TensorMove name
=============  =======  =========================================================
weights        2        `name` (bf16 compute weights; `dtype_bytes` changes it)
gradients      4        `name.grad` (fp32 accumulators; `with_grads=True`)
master copy    4        `name.master` (fp32; `with_optimizer=True`)
Adam m, v      4 + 4    `name.exp_avg`, `name.exp_avg_sq` (fp32; `with_optimizer=True`)
=============  =======  =========================================================

Weights only: 2 B/param (HotSPa's switch inside a step); all of it: 18 B/param (Tenplex's
reconfiguration of the full training state). Optimizer state follows the parameter's layout: a
ZeRO / distributed-optimizer sharding over dp is not modelled.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from hotswitch.compiler.tp_rules import heads_sharded
from hotswitch.distconfig import DistConfig, Layout, Mesh, Replicate, Shard, balanced_split, fsdp_dim
from hotswitch.distconfig.placement import Placement
from hotswitch.switch.state import StateKind

__all__ = [
    "MODELS",
    "ModelConfig",
    "ModelSpec",
    "ParamSpec",
    "STATE_BYTES",
    "check_config",
    "describe_model",
    "layouts",
    "split_stages",
    "stage_devices",
    "switch_moves",
]

# ---------------------------------------------------------------- model configs


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Enough of a transformer's hyper-parameters to list its parameters."""

    family: str  # "gpt3" (LayerNorm, biases, fused QKV, learned positions, tied head) or "llama2"
    n_layers: int
    hidden: int
    n_heads: int
    ffn_hidden: int
    vocab_size: int
    n_kv_heads: int | None = None  # None: as many as query heads
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        if self.family not in ("gpt3", "llama2"):
            raise ValueError(f"ModelConfig family must be 'gpt3' or 'llama2', got {self.family!r}")
        for name in ("n_layers", "hidden", "n_heads", "ffn_hidden", "vocab_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig {name} must be a positive int, got {value!r}")
        if self.hidden % self.n_heads:
            raise ValueError(
                f"ModelConfig hidden={self.hidden} is not a multiple of n_heads={self.n_heads}; "
                "pick a width that is n_heads x head size"
            )
        kv = self.kv_heads
        if not isinstance(kv, numbers.Integral) or kv < 1 or self.n_heads % kv:
            raise ValueError(
                f"ModelConfig n_kv_heads={self.n_kv_heads!r} must divide n_heads={self.n_heads} "
                "(grouped-query attention shares each kv head among n_heads / n_kv_heads query heads)"
            )

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def tied_embeddings(self) -> bool:
        return self.family == "gpt3"


GPT3_VOCAB = 50304  # 50257 padded to a multiple of 128 (Megatron-LM, nanoGPT), kept for every tp
LLAMA2_VOCAB = 32000


def _gpt3(n_layers: int, hidden: int, n_heads: int) -> ModelConfig:
    return ModelConfig("gpt3", n_layers, hidden, n_heads, 4 * hidden, GPT3_VOCAB)


MODELS: dict[str, ModelConfig] = {
    "gpt3-1.3b": _gpt3(24, 2048, 16),
    "gpt3-2.7b": _gpt3(32, 2560, 32),
    "gpt3-6.7b": _gpt3(32, 4096, 32),
    "gpt3-13b": _gpt3(40, 5120, 40),
    "gpt3-175b": _gpt3(96, 12288, 96),
    "llama2-7b": ModelConfig("llama2", 32, 4096, 32, 11008, LLAMA2_VOCAB, max_seq_len=4096),
    "llama2-13b": ModelConfig("llama2", 40, 5120, 40, 13824, LLAMA2_VOCAB, max_seq_len=4096),
    "llama2-70b": ModelConfig("llama2", 80, 8192, 64, 28672, LLAMA2_VOCAB, n_kv_heads=8, max_seq_len=4096),
}
MODELS["gpt3-xl"] = MODELS["gpt3-1.3b"]  # the paper's name for 1.3B (Tenplex's figures use it)

# ---------------------------------------------------------------- parameter lists

# How tensor parallelism places a parameter (the role decides; see the module doc):
#   embedding    vocab-parallel token embedding Shard(0); first stage (and last, when tied)
#   position     learned positions, replicated; first stage
#   head         vocab-parallel LM head Shard(0); last stage
#   final_norm   replicated; last stage
#   norm         replicated (LayerNorm / RMSNorm weight and bias)
#   column       Shard(0): column-parallel weight [out, in] or its bias
#   kv_column    column-parallel k/v projection; replicated when tp > n_kv_heads (heads_sharded)
#   row          Shard(1): row-parallel weight [out, in]
#   row_bias     replicated: the bias added after the row-parallel all-reduce
ROLES = ("embedding", "position", "head", "final_norm", "norm", "column", "kv_column", "row", "row_bias")
_FIRST, _LAST = ("embedding", "position"), ("head", "final_norm")


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter: `layer` is its block's index, None for the embedding, final norm and head."""

    name: str
    shape: tuple[int, ...]
    layer: int | None
    role: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    config: ModelConfig
    params: tuple[ParamSpec, ...]

    @property
    def num_params(self) -> int:
        """Distinct parameters (a tied embedding counts once)."""
        return sum(p.numel for p in self.params)

    @property
    def n_layers(self) -> int:
        return self.config.n_layers

    def layer_params(self) -> np.ndarray:
        """Parameter count of each block, (n_layers,)."""
        counts = np.zeros(self.n_layers, dtype=np.int64)
        for p in self.params:
            if p.layer is not None:
                counts[p.layer] += p.numel
        return counts


def describe_model(model: str | ModelConfig | ModelSpec) -> ModelSpec:
    """Parameter names, shapes and roles of a model in `MODELS` (or of a custom ModelConfig)."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, ModelConfig):
        return _describe("custom", model)
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)} or pass a ModelConfig")
    return _describe(model, MODELS[model])


@lru_cache(maxsize=32)
def _describe(name: str, c: ModelConfig) -> ModelSpec:
    h, f = c.hidden, c.ffn_hidden
    params: list[ParamSpec] = []

    def add(pname: str, shape: tuple[int, ...], layer: int | None, role: str) -> None:
        params.append(ParamSpec(pname, shape, layer, role))

    if c.family == "gpt3":
        add("wte.weight", (c.vocab_size, h), None, "embedding")  # also the LM head (tied)
        add("wpe.weight", (c.max_seq_len, h), None, "position")
        for i in range(c.n_layers):
            p = f"layers.{i}."
            add(p + "ln1.weight", (h,), i, "norm")
            add(p + "ln1.bias", (h,), i, "norm")
            add(p + "attn.qkv.weight", (3 * h, h), i, "column")
            add(p + "attn.qkv.bias", (3 * h,), i, "column")
            add(p + "attn.out.weight", (h, h), i, "row")
            add(p + "attn.out.bias", (h,), i, "row_bias")
            add(p + "ln2.weight", (h,), i, "norm")
            add(p + "ln2.bias", (h,), i, "norm")
            add(p + "mlp.fc1.weight", (f, h), i, "column")
            add(p + "mlp.fc1.bias", (f,), i, "column")
            add(p + "mlp.fc2.weight", (h, f), i, "row")
            add(p + "mlp.fc2.bias", (h,), i, "row_bias")
        add("ln_f.weight", (h,), None, "final_norm")
        add("ln_f.bias", (h,), None, "final_norm")
    else:
        kv = c.kv_heads * c.head_dim
        add("model.embed_tokens.weight", (c.vocab_size, h), None, "embedding")
        for i in range(c.n_layers):
            p = f"model.layers.{i}."
            add(p + "input_layernorm.weight", (h,), i, "norm")
            add(p + "self_attn.q_proj.weight", (h, h), i, "column")
            add(p + "self_attn.k_proj.weight", (kv, h), i, "kv_column")
            add(p + "self_attn.v_proj.weight", (kv, h), i, "kv_column")
            add(p + "self_attn.o_proj.weight", (h, h), i, "row")
            add(p + "post_attention_layernorm.weight", (h,), i, "norm")
            add(p + "mlp.gate_proj.weight", (f, h), i, "column")
            add(p + "mlp.up_proj.weight", (f, h), i, "column")
            add(p + "mlp.down_proj.weight", (h, f), i, "row")
        add("model.norm.weight", (h,), None, "final_norm")
        add("lm_head.weight", (c.vocab_size, h), None, "head")
    return ModelSpec(name, c, tuple(params))


# ---------------------------------------------------------------- pipeline stages


def split_stages(model: str | ModelConfig | ModelSpec, pp: int) -> tuple[tuple[int, int], ...]:
    """Cut the blocks into `pp` contiguous stages: ((first layer, stop), ...), one per stage.

    Balanced by parameter count, with the embedding (and positions) added to the first stage and the
    final norm and head (and, when tied and pp > 1, the embedding's copy) to the last: the stages'
    largest count is minimal, and among the splits that reach it the one with the least sum of
    squared stage counts (the most even) is taken; every stage has at least one block.
    """
    spec = describe_model(model)
    n = spec.n_layers
    if not isinstance(pp, numbers.Integral) or isinstance(pp, bool) or not 1 <= pp <= n:
        raise ValueError(
            f"{spec.name} has {n} layers, so it can be cut into 1..{n} pipeline stages, not pp={pp!r}; "
            f"use pp <= {n}"
        )
    return _split(spec, int(pp))


@lru_cache(maxsize=256)
def _split(spec: ModelSpec, pp: int) -> tuple[tuple[int, int], ...]:
    if pp == 1:
        return ((0, spec.n_layers),)
    cost = spec.layer_params().astype(np.float64)
    cost[0] += sum(p.numel for p in spec.params if p.role in _FIRST)
    cost[-1] += sum(p.numel for p in spec.params if p.role in _LAST)
    if spec.config.tied_embeddings:
        cost[-1] += sum(p.numel for p in spec.params if p.role == "embedding")
    return balanced_split(cost, pp)


# ---------------------------------------------------------------- layouts


def check_config(model: str | ModelConfig | ModelSpec, config: DistConfig, num_devices: int) -> None:
    """Raise ValueError (saying what to change) if `config` cannot run `model` on `num_devices`."""
    spec = describe_model(model)
    c = spec.config
    if not isinstance(config, DistConfig):
        raise ValueError(f"expected a DistConfig, got {type(config).__name__}; build one with DistConfig.parse")
    config.check_world_size(num_devices)
    tp = config.tp
    if c.n_heads % tp:
        ok = [d for d in range(1, c.n_heads + 1) if c.n_heads % d == 0]
        raise ValueError(
            f"DistConfig {config.name!r}: tp={tp} does not divide {spec.name}'s {c.n_heads} attention heads; "
            f"use tp in {ok}"
        )
    kv = c.kv_heads
    if kv % tp and tp % kv:
        raise ValueError(
            f"DistConfig {config.name!r}: tp={tp} and {spec.name}'s {kv} key/value heads must divide one "
            f"another (each rank keeps whole kv heads); use a tp that divides {kv} or is a multiple of it"
        )
    if config.pp > spec.n_layers:
        raise ValueError(
            f"DistConfig {config.name!r}: pp={config.pp} stages for {spec.name}'s {spec.n_layers} layers; "
            f"use pp <= {spec.n_layers}"
        )


def layouts(model: str | ModelConfig | ModelSpec, config: DistConfig, num_devices: int) -> dict[str, Layout]:
    """Every parameter's Layout under `config` on a job of `num_devices` devices (see the module doc)."""
    spec = describe_model(model)
    check_config(spec, config, num_devices)
    return dict(_layouts(spec, config))


@lru_cache(maxsize=64)
def _layouts(spec: ModelSpec, config: DistConfig) -> tuple[tuple[str, Layout], ...]:
    c = spec.config
    dp, tp, pp = config.dp, config.tp, config.pp
    ranks = np.asarray(config.ranks(), dtype=np.int64).reshape(pp, dp * tp)
    stages = _split(spec, pp)
    stage_of_layer = np.repeat(np.arange(pp), [b - a for a, b in stages])
    meshes = [Mesh.from_shape((dp, tp), ("dp", "tp"), ranks[s].tolist()) for s in range(pp)]
    # the compiler's rule: GQA with tp above the kv heads replicates the kv projections
    kv_sharded = heads_sharded(c.kv_heads, tp, (c.n_heads,), what=f"{spec.name}'s k/v projections", config=config.name)
    if c.tied_embeddings and pp > 1:
        tied = Mesh.from_shape((2, dp, tp), ("tied", "dp", "tp"), np.concatenate([ranks[0], ranks[-1]]).tolist())
    placements: dict[str, tuple[Placement, ...]] = {
        "embedding": (Replicate(), Shard(0)), "head": (Replicate(), Shard(0)),
        "column": (Replicate(), Shard(0)), "kv_column": (Replicate(), Shard(0)), "row": (Replicate(), Shard(1)),
        "position": (Replicate(), Replicate()), "final_norm": (Replicate(), Replicate()),
        "norm": (Replicate(), Replicate()), "row_bias": (Replicate(), Replicate()),
    }
    out = []
    for p in spec.params:
        if p.layer is not None:
            stage = int(stage_of_layer[p.layer])
        else:
            stage = 0 if p.role in _FIRST else pp - 1
        mesh, place = meshes[stage], placements[p.role]
        if p.role == "kv_column" and not kv_sharded:
            place = (Replicate(), Replicate())
        elif p.role == "embedding" and c.tied_embeddings and pp > 1:
            mesh, place = tied, (Replicate(), Replicate(), Shard(0))
        if config.fsdp:  # the dp axis shards what tp leaves whole, as the compiler stores it
            dim = fsdp_dim(p.shape, place, 0, dp)
            place = place if dim is None else (Shard(dim), *place[1:])
        out.append((p.name, Layout(p.shape, mesh, place)))
    return tuple(out)


def stage_devices(config: DistConfig) -> tuple[tuple[int, ...], ...]:
    """The devices of every pipeline stage of `config`, stage by stage."""
    ranks = config.ranks()
    k = config.dp * config.tp
    return tuple(tuple(ranks[s * k:(s + 1) * k]) for s in range(config.pp))


# ---------------------------------------------------------------- switch moves

# bytes per element of each state kind that `switch_moves` can include (weights: `dtype_bytes`)
STATE_BYTES = {StateKind.GRAD: 4, StateKind.MASTER: 4, StateKind.EXP_AVG: 4, StateKind.EXP_AVG_SQ: 4}


def switch_moves(
    model: str | ModelConfig | ModelSpec,
    src_config: DistConfig,
    dst_config: DistConfig,
    num_devices: int,
    dtype_bytes: int = 2,
    with_grads: bool = False,
    with_optimizer: bool = False,
):
    """The TensorMoves of a switch from `src_config` to `dst_config` on `num_devices` devices.

    Weights (`dtype_bytes` each; bf16 by default), plus fp32 gradients (`with_grads`) and fp32
    master weights and Adam moments (`with_optimizer`), each state with its parameter's layout. For
    a switch that changes the device set (elastic), give a config its `devices`.
    """
    from hotswitch.switch.planner import TensorMove  # the planner imports torch; only needed here

    spec = describe_model(model)
    if not isinstance(dtype_bytes, numbers.Integral) or isinstance(dtype_bytes, bool) or dtype_bytes < 1:
        raise ValueError(f"dtype_bytes must be a positive int (2 for bf16), got {dtype_bytes!r}")
    src = layouts(spec, src_config, num_devices)
    dst = layouts(spec, dst_config, num_devices)
    kinds = [("", int(dtype_bytes))]
    if with_grads:
        kinds.append((".grad", STATE_BYTES[StateKind.GRAD]))
    if with_optimizer:
        kinds += [(f".{k}", STATE_BYTES[k]) for k in (StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)]
    return [TensorMove(p.name + suffix, p.shape, itemsize, src[p.name], dst[p.name])
            for suffix, itemsize in kinds for p in spec.params]
