"""A meta-device model's initialization one unit at a time (`runtime.meta_init`) against one
device's, bit for bit, and the matching of a checkpoint's names (`runtime.weights`). One process."""
import os
import warnings

import pytest
import torch
import transformers  # a required package (pyproject.toml): builds HF models from configs
from torch import nn
from transformers.initialization import no_init_weights

from hotswitch.models import GPT, GPTConfig
from hotswitch.runtime.meta_init import initialized
from hotswitch.runtime.weights import check_buffers, check_source, computed_buffers, match_keys


def _initialize(model, init, seed):
    """Every tensor of `model` by name, the random generator's next draw, the peak held whole."""
    torch.manual_seed(seed)
    stats = {}
    values = {n: v for names, v in initialized(model, init, stats=stats) for n in names}
    return values, torch.rand(4), stats["peak_bytes"]


def _hf(cls, config, meta):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if meta:
            with torch.device("meta"):
                return cls(config)
        with no_init_weights():  # one device: built uninitialized (tied as its constructor ties it)
            return cls(config)


def _differs(reference: dict, values: dict) -> list:
    assert set(reference) == set(values)
    return [k for k, v in reference.items() if not torch.equal(v, values[k])]


def _state(model) -> dict:
    return {**model.state_dict(), **dict(model.named_buffers())}


@pytest.mark.parametrize("tied", [False, True])
def test_hf_llama_equals_one_device_init_weights(tied):
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=tied)
    meta = _hf(transformers.LlamaForCausalLM, config, meta=True)
    values, after, peak = _initialize(meta, "init", seed=3)
    assert all(t.device.type == "meta" for t in (*meta.parameters(), *meta.buffers()))  # the model is left as it was
    torch.manual_seed(3)
    one = _hf(transformers.LlamaForCausalLM, config, meta=False)
    one.init_weights()  # initialize_weights(), then the ties (the embedding's draw stays)
    assert _differs(_state(one), values) == []
    assert torch.equal(after, torch.rand(4))  # as many random numbers drawn
    embedding = 101 * 32 * 4
    assert peak == embedding  # one module (the largest) whole at a time, not the model


def test_gpt2_init_writing_submodules_runs_as_one_unit():
    """GPT-2's `_init_weights` of an attention or MLP block rescales its child's projection: the pass
    on meta placeholders finds that, and the block is initialized as one unit."""
    config = transformers.GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    values, after, _ = _initialize(_hf(transformers.GPT2LMHeadModel, config, meta=True), "init", seed=5)
    torch.manual_seed(5)
    one = _hf(transformers.GPT2LMHeadModel, config, meta=False)
    one.init_weights()
    assert _differs(_state(one), values) == []
    assert torch.equal(after, torch.rand(4))


def _gpt_init(module):
    GPT._init(module)
    if type(module).__name__ == "Norm":
        nn.init.ones_(module.weight)


@pytest.mark.parametrize("tied", [False, True])
def test_init_fn_equals_apply_on_one_device(tied):
    config = GPTConfig(vocab_size=101, dim=32, n_layers=2, n_heads=4, tie_embeddings=tied)
    with torch.device("meta"):
        meta = GPT(config)
    values, after, _ = _initialize(meta, _gpt_init, seed=1)
    one = GPT(config)  # tied as the constructor ties it: apply writes the tied weight twice, the last draw stays
    torch.manual_seed(1)
    with torch.no_grad():
        one.apply(_gpt_init)
    assert _differs(one.state_dict(), values) == []
    assert torch.equal(after, torch.rand(4))


def test_a_tensor_no_init_writes_is_an_error():
    with torch.device("meta"):
        meta = GPT(GPTConfig(vocab_size=101, dim=32, n_layers=1, n_heads=4))
    with pytest.raises(ValueError, match=r"layers\.0\.attn_norm\.weight \(Norm\) was not written"):
        list(initialized(meta, GPT._init))


class _Reads(nn.Module):
    """A parent whose init reads a value (no pass on meta tensors) and writes its child's weight."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(64))
        self.child = nn.Linear(4, 4)

    def init(self, module):
        if module is self:
            nn.init.ones_(self.scale)
            self.child.weight.mul_(float(self.scale.sum()))
        elif isinstance(module, nn.Linear):
            module.reset_parameters()


def test_an_init_writing_outside_its_unit_is_an_error():
    with torch.device("meta"):
        meta = _Reads()
    with pytest.raises(ValueError, match=r"wrote child\.weight, which belongs to a module outside its unit"):
        list(initialized(meta, meta.init))
    assert meta.child.weight.device.type == "meta"


PARAMS = ["model.embed.weight", "model.layer.weight", "model.head.weight"]
SHAPES = {"model.embed.weight": (10, 4), "model.layer.weight": (4, 4), "model.head.weight": (10, 4)}


def test_names_match_up_to_a_prefix_on_either_side_and_tied_aliases():
    source = {"embed.weight": (10, 4), "layer.weight": (4, 4), "head.weight": (10, 4)}
    found = match_keys(PARAMS, {}, [], source, SHAPES, "ckpt")
    assert found.prefix == ("model.", "") and found.keys["model.head.weight"] == "head.weight"
    wrapped = {"outer." + k: v for k, v in source.items()}
    assert match_keys(["embed.weight", "layer.weight", "head.weight"], {}, [], wrapped,
                      {k.removeprefix("model."): v for k, v in SHAPES.items()}, "ckpt").prefix == ("", "outer.")
    # a tied weight saved under its other name only (Hugging Face drops the tied copy)
    tied = {"embed.weight": (10, 4), "layer.weight": (4, 4)}
    found = match_keys(["model.embed.weight", "model.layer.weight"], {"model.head.weight": "model.embed.weight"}, [],
                       {**tied, "head.weight": (10, 4)}, SHAPES, "ckpt")
    assert found.keys["model.embed.weight"] == "embed.weight"
    # an elastic job's checkpoint: its weights are "param:NAME"
    found = match_keys(PARAMS, {}, [], {"param:" + k: v for k, v in SHAPES.items()}, SHAPES, "ckpt")
    assert found.prefix == ("", "param:") and found.keys["model.head.weight"] == "param:model.head.weight"


def test_names_that_do_not_fit_are_errors_naming_them():
    with pytest.raises(ValueError, match=r"no value for 1 parameter\(s\) \['model.head.weight \(key head.weight\)'\]"
                                         r".*1 key\(s\) that name nothing of the model \['tail.weight'\]"):
        match_keys(PARAMS, {}, [], {"embed.weight": (10, 4), "layer.weight": (4, 4), "tail.weight": (1,)}, SHAPES,
                   "ckpt")
    with pytest.raises(ValueError, match=r"other shapes: layer.weight \(4, 5\) where the model's model.layer.weight"):
        match_keys(PARAMS, {}, [], {"embed.weight": (10, 4), "layer.weight": (4, 5), "head.weight": (10, 4)}, SHAPES,
                   "ckpt")


def test_weights_arguments_are_checked(tmp_path):
    with torch.device("meta"):
        meta = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"meta device \('weight' has no values\).*weights='init'"):
        check_source(None, meta)
    assert check_source(None, nn.Linear(2, 2)) == "model"
    assert check_source("init", meta) == "init" and check_source(print, meta) == "init_fn"
    with pytest.raises(ValueError, match="neither \\*.safetensors files"):
        check_source(tmp_path, meta)
    (tmp_path / ".metadata").write_bytes(b"")
    assert check_source(os.fspath(tmp_path), meta) == "dcp"
    with pytest.raises(ValueError, match="must be None, 'init'"):
        check_source(3, meta)


class _Table(nn.Module):
    """A buffer its module's init never writes (no reset_parameters)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.arange(4.0), persistent=False)


def test_meta_buffers_are_computed_by_their_modules_init():
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    names = ["model.rotary_emb.inv_freq"]
    torch.manual_seed(0)
    before = torch.get_rng_state()
    got = computed_buffers(_hf(transformers.LlamaForCausalLM, config, meta=True), names, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), before)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = transformers.LlamaForCausalLM(config).model.rotary_emb.inv_freq
    assert torch.equal(got[0], expected)
    with torch.device("meta"):
        table = _Table()
    left = computed_buffers(table, ["table"], torch.device("cpu"))
    assert left[0].device.type == "meta"  # for a checkpoint to fill, else:
    with pytest.raises(ValueError, match=r"buffer\(s\) \['table'\] have no value"):
        check_buffers(["table"], left, "some/dir")
