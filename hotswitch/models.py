"""Built-in models: a configurable GPT/LLaMA-style causal LM and wrappers for Hugging Face models.

The built-in model is deliberately ordinary PyTorch (nn.Linear, F.scaled_dot_product_attention,
RoPE, RMSNorm or LayerNorm, GQA) so that the compiler is tested on the same shapes of code that real
models are written in; Hugging Face models are covered by `HFCausalLMLoss`.
"""
from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 1000
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: multi-head attention; fewer than n_heads: GQA
    ffn_dim: int | None = None  # None: 4 * dim (gelu) or 8/3 * dim rounded (swiglu)
    max_seq_len: int = 1024
    norm: str = "rms"  # "rms" | "layer"
    mlp: str = "swiglu"  # "swiglu" | "gelu"
    position: str = "rope"  # "rope" | "learned"
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.kv_heads}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        return 4 * self.dim if self.mlp == "gelu" else 64 * math.ceil(8 * self.dim / 3 / 64)


# Named configurations for the CLI, benchmarks and tests.
MODEL_CONFIGS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(vocab_size=1001, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=256),
    "gpt-small": GPTConfig(vocab_size=8003, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=512),
    # GPT-2 small sized (12 layers, 768 wide, 12 heads); used by the compile-time benchmark.
    "gpt2-small": GPTConfig(vocab_size=50257, dim=768, n_layers=12, n_heads=12, norm="layer", mlp="gelu",
                            position="learned", tie_embeddings=True, max_seq_len=1024),
    # About 23M parameters, GPT-2 style (8 heads: tp 2, 4 and 8 divide them): the switching benchmark's model.
    "gpt2-23m": GPTConfig(vocab_size=8192, dim=384, n_layers=9, n_heads=8, norm="layer", mlp="gelu",
                          position="learned", max_seq_len=512),
}


class Norm(nn.Module):
    def __init__(self, dim: int, kind: str, eps: float = 1e-5):
        super().__init__()
        self.kind, self.eps = kind, eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if kind == "layer" else None

    def forward(self, x):
        if self.kind == "layer":
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq_len: int, head_dim: int, device=None, base: float = 10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.dim // cfg.n_heads
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        self.rope = cfg.position == "rope"

    def forward(self, x, cos, sin, mask=None, positions=None, documents=None):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.rope:
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        if documents is not None:  # the mask from data: tokens may be laid out in any order
            from hotswitch.kernels.attention import document_attention

            y = document_attention(q, k, v, positions, documents)
            return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # [B, 1, T, T] bool, True = attend (causal and, for packed rows, within one sequence)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        if self.swiglu:
            self.gate_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=not self.swiglu)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=not self.swiglu)

    def forward(self, x):
        if self.swiglu:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn_norm, self.attn = Norm(cfg.dim, cfg.norm), Attention(cfg)
        self.mlp_norm, self.mlp = Norm(cfg.dim, cfg.norm), MLP(cfg)

    def forward(self, x, cos, sin, mask=None, positions=None, documents=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, positions, documents)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Causal LM. `forward(input_ids, labels)` returns the mean next-token cross-entropy
    (labels are the targets already aligned with `input_ids`; -100 is ignored), or logits without labels.

    `position_ids` ([B, T]) and a boolean `attention_mask` ([B, 1, T, T], True = attend) let a row
    hold several packed sequences, as Hugging Face models take them. With `document_ids` ([B, T],
    unique per batch) instead of a mask, attention is `hotswitch.kernels.attention.document_attention`:
    its mask comes from the ids and positions, not from the tokens' order, so context parallelism may
    lay tokens out as it likes (zigzag chunks, whole documents per rank).
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        if cfg.position == "learned":
            self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = Norm(cfg.dim, cfg.norm)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.apply(self._init)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, input_ids, labels=None, position_ids=None, attention_mask=None, document_ids=None):
        t = input_ids.shape[1]
        if document_ids is not None and position_ids is None:
            raise ValueError("document_ids need position_ids: the document-causal mask compares positions")
        x = self.embed(input_ids)
        cos = sin = None
        positions = torch.arange(t, device=input_ids.device) if position_ids is None else position_ids
        if self.cfg.position == "learned":
            x = x + self.pos_embed(positions)
        else:
            cos, sin = (r.to(x.dtype) for r in rope_tables(t, self.cfg.dim // self.cfg.n_heads, input_ids.device))
            if position_ids is not None:  # [B, 1, T, head_dim]: per-row positions, broadcast over heads
                cos, sin = F.embedding(position_ids, cos).unsqueeze(1), F.embedding(position_ids, sin).unsqueeze(1)
        for layer in self.layers:
            x = layer(x, cos, sin, attention_mask, position_ids, document_ids)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def build_model(name: str, **overrides) -> GPT:
    """A built-in model by name (see MODEL_CONFIGS), with field overrides."""
    if name not in MODEL_CONFIGS:
        raise ValueError(f"unknown model {name!r}; built-in models: {', '.join(MODEL_CONFIGS)}")
    from dataclasses import replace

    return GPT(replace(MODEL_CONFIGS[name], **overrides))


class HFCausalLMLoss(nn.Module):
    """A Hugging Face causal LM as a loss module: forward(input_ids, labels) -> mean token loss.

    `labels` are already aligned with `input_ids` (shifted by the caller; -100 ignored), so the loss
    is plain cross-entropy over logits, computed here rather than by the model's own loss helper.
    """

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.model = hf_model

    def forward(self, input_ids, labels):
        logits = self.model(input_ids=input_ids, use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def document_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool mask, True = attend: causal, and only within one packed sequence.

    A sequence starts where its position is 0 (positions restart per sequence), so a padding token
    with position 0 is a sequence of its own and still attends to itself (no all-masked row).
    """
    doc = (position_ids == 0).cumsum(dim=1)
    same_doc = doc.unsqueeze(2) == doc.unsqueeze(1)
    idx = torch.arange(position_ids.shape[1], device=position_ids.device)
    causal = idx.unsqueeze(1) >= idx.unsqueeze(0)
    return (same_doc & causal).unsqueeze(1)


def document_ids_of(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] document id of every token, unique over the batch: the flat index of its document's
    first token (a document starts where its position is 0, as in `document_causal_mask`)."""
    b, t = position_ids.shape
    starts = torch.where(position_ids == 0, torch.arange(b * t, device=position_ids.device).view(b, t), 0)
    return starts.cummax(dim=1).values


class PackedCausalLMLoss(nn.Module):
    """Any causal LM as the loss the trainer compiles: forward(input_ids, position_ids, labels[, document_ids]).

    The model's forward takes `input_ids` (and `position_ids`, `attention_mask`) and returns logits
    or an object with `.logits` (Hugging Face). Rows may hold several sequences: positions restart
    per sequence and the attention mask keeps each within its own. With `document_ids`
    (`document_ids_of(position_ids)`), a model that reads them gets those instead of a mask. The loss is written as
    `sum of token losses / number of target tokens`, which the tracer splits so that micro-batches
    and uneven data-parallel shards can be weighted by their token counts exactly.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.takes_positions = "position_ids" in params
        self.takes_mask = "attention_mask" in params
        self.takes_cache = "use_cache" in params
        # Hugging Face models route attention through their AttentionInterface: hotswitch's op is
        # registered there and chosen while a batch with document ids runs (`_hf_document_attention`)
        self.hf_attention = hasattr(getattr(model, "config", None), "_attn_implementation") and "kwargs" in params
        self.takes_documents = "document_ids" in params or self.hf_attention

    @property
    def can_pack(self) -> bool:
        """Packing several sequences per row needs both restartable positions and a mask."""
        return self.takes_positions and self.takes_mask

    def forward(self, input_ids, position_ids, labels, document_ids=None):
        kwargs = {}
        if self.takes_positions:
            kwargs["position_ids"] = position_ids
        if document_ids is not None:
            if not self.takes_documents:
                raise ValueError(f"{type(self.model).__name__}.forward takes no document_ids: give them only to a "
                                 "model whose attention reads them (hotswitch.models.GPT)")
            kwargs["document_ids"] = document_ids
            if self.hf_attention:
                with _hf_document_attention(self.model):
                    return self._loss(self.model(input_ids=input_ids, **kwargs, use_cache=False), labels)
        elif self.takes_mask:
            kwargs["attention_mask"] = document_causal_mask(position_ids)
        if self.takes_cache:
            kwargs["use_cache"] = False
        return self._loss(self.model(input_ids=input_ids, **kwargs), labels)

    @staticmethod
    def _loss(out, labels):
        logits = out.logits if hasattr(out, "logits") else out
        token_loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
        return token_loss / (labels != -100).sum()


HF_DOCUMENT_ATTENTION = "hotswitch_document"  # the name hotswitch's attention has in Hugging Face's registry


@contextlib.contextmanager
def _hf_document_attention(model: nn.Module):
    """The model's attention as `document_attention` inside the block (its config names it; Hugging
    Face then builds no mask either, as for any attention it has no mask function for)."""
    import transformers

    from hotswitch.kernels.attention import document_attention

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if dropout:
            raise ValueError("document_attention has no dropout: train with attention_dropout=0")
        if scaling is not None and not math.isclose(scaling, query.shape[-1] ** -0.5):
            raise ValueError(f"document_attention scales scores by 1/sqrt(head_dim); this model uses {scaling}")
        if kwargs.get("position_ids") is None or kwargs.get("document_ids") is None:
            raise ValueError(f"{type(module).__name__} does not pass position_ids and document_ids on to its attention "
                             "function, which document_attention needs: use cp_layout='contiguous' for this model")
        out = document_attention(query, key, value, kwargs["position_ids"], kwargs["document_ids"])
        return out.transpose(1, 2).contiguous(), None

    transformers.AttentionInterface.register(HF_DOCUMENT_ATTENTION, attention)
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = HF_DOCUMENT_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


def build_hf_model(kind: str, vocab_size: int = 1001, **overrides) -> HFCausalLMLoss:
    """A small Hugging Face model from a config with random weights (nothing is downloaded)."""
    import transformers

    decoder = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   attn_implementation="sdpa")
    if kind in ("llama", "qwen2", "phi3"):
        # Llama: grouped-query attention, RoPE, untied head; Qwen2: the same with biased q/k/v and a tied
        # head; Phi-3: q/k/v fused into one projection and gate/up into another (split along features)
        cfg = {**decoder, "tie_word_embeddings": kind == "qwen2"}
        if kind == "phi3":
            cfg.update(pad_token_id=0, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0)
        cfg.update(overrides)
        config, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                               "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM)}[kind]
        model = model_class(config(**cfg))
    elif kind == "gpt2":
        cfg = dict(
            vocab_size=vocab_size,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=256,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation="sdpa",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        cfg.update(overrides)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg))
    else:
        raise ValueError(f"unknown Hugging Face model kind {kind!r}; choose 'llama', 'qwen2', 'phi3' or 'gpt2'")
    return HFCausalLMLoss(model.train())
