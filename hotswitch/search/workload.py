"""What the config search needs to know of a model: its transformer shape, read off the model.

The search prices configs without compiling them, so it describes a model the way the cluster model
(`hotswitch.switch.cluster`) already does: a `ModelConfig` (layers, width, heads, kv heads, MLP width,
vocabulary; family "llama2" = gated MLP, untied head; "gpt3" = GELU MLP, tied head). The parameter
list, the tensor-parallel roles, the pipeline split and the switch plans then come from that one
description, as they do for `hotswitch plan`. A `Workload` adds what differs between a model that
hotswitch compiles and the Megatron layout the cluster model assumes: hotswitch's compiler keeps the
LM head replicated over tp (`compiler.tp_rules`: a column weight feeding a log-softmax), Megatron
shards it over the vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass

from hotswitch.switch.cluster import MODELS, ModelConfig

__all__ = ["Workload", "describe_workload"]


@dataclass(frozen=True, slots=True)
class Workload:
    """A model as the cost model sees it. `compute_bytes`: bytes per weight and activation element
    (2 for bf16, 4 for fp32); `head_sharded`: whether tp shards the LM head (Megatron) or every tp
    rank computes it whole (hotswitch's compiler); `pipeline`: whether pp > 1 configs are candidates
    (the Trainer runs pp = 1 configs only); `flash_attention`: a fused causal kernel that skips the
    masked half of the L x L FLOPs (Megatron on GPUs) or one that computes every score (torch's flop
    counter counts SDPA so; hotswitch's `masked_attention` with a mask); `fused_attention`: whether
    no L x L tensor is written or kept for backward (a fused kernel: flash attention, and hotswitch's
    compiler, which keeps attention one op) or the scores are materialised (the math decomposition);
    `reduce_every_micro_batch`: whether data-parallel gradients are all-reduced in every micro-batch
    (hotswitch's pp = 1 graphs reduce inside each `forward_backward`) or once per step (Megatron, and
    hotswitch's pipelines)."""

    name: str
    model: ModelConfig
    compute_bytes: int = 2
    head_sharded: bool = True
    pipeline: bool = True
    flash_attention: bool = True
    fused_attention: bool = True
    reduce_every_micro_batch: bool = False

    def __post_init__(self) -> None:
        if self.compute_bytes not in (1, 2, 4, 8):
            raise ValueError(f"Workload compute_bytes must be 1, 2, 4 or 8 (bytes per element), got "
                             f"{self.compute_bytes!r}")

    @property
    def gated_mlp(self) -> bool:
        return self.model.family == "llama2"


def describe_workload(model, *, compute_bytes: int | None = None) -> Workload:
    """The Workload of a cluster model name ("gpt3-175b"), a `ModelConfig`, or an nn.Module: a built-in
    `hotswitch.models.GPT`, a Hugging Face Llama/GPT-2 style causal LM, or either wrapped in
    `PackedCausalLMLoss` / `HFCausalLMLoss`. Cluster models are priced in bf16 with Megatron's layout;
    modules in their parameters' dtype with hotswitch's compiler layout (replicated LM head, pp = 1)."""
    if isinstance(model, Workload):
        return model
    if isinstance(model, str):
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}, pass a ModelConfig "
                             "or an nn.Module")
        return Workload(model, MODELS[model], compute_bytes or 2)
    if isinstance(model, ModelConfig):
        return Workload("custom", model, compute_bytes or 2)
    return _from_module(model, compute_bytes)


def _from_module(module, compute_bytes: int | None) -> Workload:
    import torch

    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"cannot describe {type(module).__name__} as a transformer: pass a model name, a "
                         "ModelConfig or an nn.Module")
    inner = module
    while hasattr(inner, "model") and isinstance(inner.model, torch.nn.Module) and not hasattr(inner, "cfg") \
            and getattr(inner, "config", None) is None:
        inner = inner.model  # PackedCausalLMLoss / HFCausalLMLoss wrappers
    first = next(module.parameters(), None)
    nbytes = compute_bytes or (first.element_size() if first is not None else 4)
    name = type(inner).__name__
    cfg = getattr(inner, "cfg", None)
    if cfg is not None and hasattr(cfg, "n_layers") and hasattr(cfg, "dim"):  # hotswitch.models.GPT
        family = "llama2" if cfg.mlp == "swiglu" else "gpt3"
        mc = ModelConfig(family, cfg.n_layers, cfg.dim, cfg.n_heads, cfg.hidden_dim, cfg.vocab_size,
                         n_kv_heads=cfg.kv_heads, max_seq_len=cfg.max_seq_len)
        return Workload(name, mc, nbytes, head_sharded=False, pipeline=False,
                        flash_attention=False, reduce_every_micro_batch=True)
    hf = getattr(inner, "config", None)
    if hf is not None:
        get = lambda *keys: next((getattr(hf, k) for k in keys if getattr(hf, k, None) is not None), None)  # noqa: E731
        hidden, layers, heads = get("hidden_size", "n_embd"), get("num_hidden_layers", "n_layer"), \
            get("num_attention_heads", "n_head")
        if None not in (hidden, layers, heads):
            gated = get("intermediate_size") is not None  # Llama-style gated MLP; GPT-2 has n_inner
            ffn = get("intermediate_size", "n_inner") or 4 * hidden
            family = "llama2" if gated else "gpt3"
            mc = ModelConfig(family, layers, hidden, heads, ffn, get("vocab_size"),
                             n_kv_heads=get("num_key_value_heads"),
                             max_seq_len=get("max_position_embeddings", "n_positions") or 2048)
            return Workload(name, mc, nbytes, head_sharded=False, pipeline=False,
                        flash_attention=False, reduce_every_micro_batch=True)
    raise ValueError(f"cannot read a transformer shape off {type(inner).__name__}: hotswitch.search knows "
                     "hotswitch.models.GPT and Hugging Face causal LMs with a standard config; pass "
                     "workload=hotswitch.search.Workload(name, ModelConfig(...)) instead")
