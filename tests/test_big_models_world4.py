"""Models larger than one device, on 4 gloo processes: a Hugging Face Llama built on the meta device
gets its weights shard-wise (a save_pretrained directory read box by box, its own initialization, a
torch.distributed.checkpoint resharded on load), trains as the same model whole on one device, and
is saved back readable on one process; the errors a user meets name the fix."""
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist

import hotswitch as hs
from hotswitch.models import build_hf_model
from hotswitch.train.trainer import Trainer
from tests.distributed import dist_fixture
from tests.test_trainer_world4 import LR, VOCAB, _batches, _reference_steps, _steps_against

pytestmark = pytest.mark.slow  # spawns gloo processes and compiles; `-m 'not slow'` leaves it out

# One directory for the module, shared by the parent and the workers (they read it from the env).
ROOT = os.environ.get("HS_BIG_MODELS_TEST_ROOT") or tempfile.mkdtemp(prefix="hotswitch-big-models-test-")
HF_DIR, SAVED, DCP_DIR = (os.path.join(ROOT, d) for d in ("hf", "saved", "dcp"))


def _llama(meta: bool = False):
    """The trainer tests' 2-layer Llama (hidden 64, vocabulary 1001), whole or on the meta device."""
    with warnings.catch_warnings(), torch.device("meta" if meta else "cpu"):
        warnings.simplefilter("ignore")
        return build_hf_model("llama", vocab_size=VOCAB).model


def _batch():
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    return dict(input_ids=ids, labels=ids)


def _bytes(t) -> int:
    return t.numel() * t.element_size()


class _SliceSpy:
    """safetensors' file handle, recording every box read and refusing whole-tensor reads."""

    def __init__(self, handle, reads):
        self.handle, self.reads = handle, reads

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_slice(self, key):
        spy, sliced = self, self.handle.get_slice(key)

        class Slice:
            def get_shape(self):
                return sliced.get_shape()

            def __getitem__(self, box):
                piece = sliced[box]
                spy.reads.append((key, tuple(piece.shape)))
                return piece

        return Slice()

    def get_tensor(self, key):
        raise AssertionError(f"a whole tensor ({key}) was read")


def check_hf_checkpoint_trains_and_saves():
    """A save_pretrained directory (several files and the index) read box by box into the Trainer's
    base under a meta model; 3 AdamW steps under dp2tp2, tp4sp and fsdp4 equal the model loaded whole
    on one device; saved back, from_pretrained reads the trained weights."""
    import safetensors
    import safetensors.torch
    import transformers

    torch.manual_seed(0)
    whole = _llama()
    if dist.get_rank() == 0:
        whole.save_pretrained(HF_DIR, max_shard_size="100KB")
    dist.barrier()
    reference = transformers.LlamaForCausalLM.from_pretrained(HF_DIR)  # loaded whole, on one device
    batches = _batches()
    ref = _reference_steps(reference, batches)
    reads, real = [], safetensors.safe_open
    safetensors.safe_open = lambda *a, **k: _SliceSpy(real(*a, **k), reads)
    try:
        trainer = Trainer(_llama(meta=True), ["dp2tp2", "tp4sp", "fsdp4"], dict(name="adamw", lr=LR),
                          buckets=[8, 16, 128], bucket_configs=["dp2tp2", "tp4sp", "fsdp4"], micro_batch_tokens=64,
                          weights=HF_DIR, prefetch=False)
    finally:
        safetensors.safe_open = real
    mine = trainer.cm.local_shapes(trainer.base)
    read = dict(base=trainer.base, elements=sum(torch.Size(s).numel() for _, s in reads),
                held=sum(torch.Size(s).numel() for s in mine.values()),
                model=sum(p.numel() for p in whole.parameters()),
                boxes_are_shards=all(s == mine["model." + k] for k, s in reads), files=len(os.listdir(HF_DIR)))
    steps = _steps_against(trainer, batches, ref)
    written, save_file = [], safetensors.torch.save_file
    safetensors.torch.save_file = lambda tensors, *a, **k: (written.extend(_bytes(t) for t in tensors.values()),
                                                            save_file(tensors, *a, **k))
    try:
        trainer.save_pretrained(SAVED, max_shard_bytes=200_000)
    finally:
        safetensors.torch.save_file = save_file
    read["written"] = sum(written)  # this rank's files: its share, never the whole model
    back = None
    if dist.get_rank() == 0:
        loaded = transformers.LlamaForCausalLM.from_pretrained(SAVED).state_dict()
        trained = ref[-1][2]
        back = dict(keys=set(loaded) ^ set(trained),
                    error=max(float((loaded[k] - v).norm() / v.norm()) for k, v in trained.items()),
                    files=sorted(os.listdir(SAVED)))
    dist.barrier()
    return read, [{k: v for k, v in s.items() if k != "report"} for s in steps], back


def check_meta_init_equals_one_device_and_dcp_reshards():
    """weights="init": the assembled state is bit-equal to one device's `init_weights()` with the same
    seed, no rank holding more than one module whole at a time; saved by DCP under tp4sp and loaded
    under fsdp2tp2 (resharded) and on one process, equal. The first check's save_pretrained directory
    loads under tp4sp and dp2tp2 too (`load_weights`), equal to the model saved."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers.initialization import no_init_weights

    torch.manual_seed(7)
    cm = hs.compile(build_hf_model_meta(), _batch(), ["dp2tp2", "tp4sp"], weights="init", lazy=True)
    torch.manual_seed(7)
    with no_init_weights(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = build_hf_model("llama", vocab_size=VOCAB)
    reference.model.init_weights()
    expected = reference.state_dict()
    full = cm.full_state_dict()
    largest = max(sum(_bytes(t) for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))
                  for m in reference.modules())
    out = dict(keys=set(full) ^ set(expected), equal=all(torch.equal(full[k], v) for k, v in expected.items()),
               peak=cm.last_load.peak_bytes, largest_module=largest,
               model=sum(_bytes(p) for p in reference.parameters()),
               held=sum(_bytes(p) for p in cm.local_params.values()))
    cm.switch("tp4sp")
    cm.save_checkpoint(DCP_DIR)
    resharded = hs.compile(build_hf_model_meta(), _batch(), ["fsdp2tp2"], weights=DCP_DIR, lazy=True)
    again = resharded.full_state_dict()
    out["resharded"] = all(torch.equal(again[k], v) for k, v in expected.items())
    out["dcp_source"] = resharded.last_load.source
    torch.manual_seed(0)
    saved = {"model." + k: v for k, v in _llama().state_dict().items()}  # what the first check saved
    for config in ("tp4sp", "dp2tp2"):
        cm.switch(config)
        cm.load_weights(HF_DIR)
        loaded = cm.full_state_dict()
        out[f"hf_{config}"] = all(torch.equal(loaded[k], v) for k, v in saved.items()) and cm.last_load.prefix == (
            "model.", "")
    if dist.get_rank() == 0:
        dcp_to_torch_save(DCP_DIR, os.path.join(ROOT, "one.pt"))
        one = torch.load(os.path.join(ROOT, "one.pt"))
        out["one_process"] = set(one) == set(expected) and all(torch.equal(one[k], v) for k, v in expected.items())
    dist.barrier()
    return out


def build_hf_model_meta():
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return build_hf_model("llama", vocab_size=VOCAB)


def _error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    raise AssertionError("no ValueError raised")


def check_errors_name_the_fix():
    """A meta model without weights, a checkpoint missing a key (with an extra one), a shape that
    differs, ranks seeded differently for weights="init": each a ValueError on every rank."""
    from safetensors.torch import save_file

    batch, configs = _batch(), ["dp4"]
    torch.manual_seed(0)
    state = _llama().state_dict()
    missing, wrong = os.path.join(ROOT, "missing"), os.path.join(ROOT, "wrong")
    if dist.get_rank() == 0:
        os.makedirs(missing, exist_ok=True)
        os.makedirs(wrong, exist_ok=True)
        save_file({**{k: v for k, v in state.items() if k != "model.norm.weight"}, "model.extra.weight": torch.ones(2)},
                  os.path.join(missing, "model.safetensors"), metadata={"format": "pt"})
        save_file({**state, "model.embed_tokens.weight": torch.zeros(VOCAB + 1, 64)},
                  os.path.join(wrong, "model.safetensors"), metadata={"format": "pt"})
    dist.barrier()
    meta = build_hf_model_meta  # the model check_meta_init_... traced: its graph is reused
    out = dict(
        no_weights=_error(lambda: hs.compile(meta(), batch, configs)),
        trainer_no_weights=_error(lambda: Trainer(_llama(meta=True), configs)),
        missing=_error(lambda: hs.compile(meta(), batch, configs, weights=missing, lazy=True)),
        shape=_error(lambda: hs.compile(meta(), batch, configs, weights=wrong, lazy=True)),
        not_a_checkpoint=_error(lambda: hs.compile(meta(), batch, configs, weights=ROOT + "-none")),
    )
    torch.manual_seed(dist.get_rank())
    out["seeds"] = _error(lambda: hs.compile(meta(), batch, configs, weights="init", lazy=True))
    return out


def check_readme_big_model_lines():
    """The README's big-model lines as they stand (`_readme_python_blocks()[1]`), on the checkpoint
    `check_hf_checkpoint_trains_and_saves` wrote: built on meta, compiled reading each rank's
    shards, saved back; from_pretrained reads the same weights."""
    import transformers

    from tests.test_examples import _readme_python_blocks

    block = _readme_python_blocks()[1]
    out = os.path.join(ROOT, "readme-out")
    code = block.replace('"path/to/hf_dir"', repr(HF_DIR))
    code = code.replace('save_pretrained("out")', f"save_pretrained({out!r})")
    assert code != block and repr(out) in code, "the README's lines no longer read a directory and save one"
    exec(code, {"torch": torch, "transformers": transformers, "hs": hs, "batch": _batch(),
                "config": transformers.LlamaConfig.from_pretrained(HF_DIR)})
    dist.barrier()
    if dist.get_rank() != 0:
        return None
    saved = transformers.LlamaForCausalLM.from_pretrained(out).state_dict()
    original = transformers.LlamaForCausalLM.from_pretrained(HF_DIR).state_dict()
    return set(saved) ^ set(original), all(torch.equal(saved[k], original[k]) for k in original)


CHECKS = [check_hf_checkpoint_trains_and_saves, check_meta_init_equals_one_device_and_dcp_reshards,
          check_errors_name_the_fix, check_readme_big_model_lines]
ENV = {"HS_BIG_MODELS_TEST_ROOT": ROOT}
results = dist_fixture(4, CHECKS, env=ENV, timeout=600)


def test_hf_checkpoint_read_shard_wise_trains_and_saves(results):
    values = results["check_hf_checkpoint_trains_and_saves"].raise_if_failed()
    for read, steps, _ in values:
        assert read["files"] > 2  # several safetensors files and the index
        # each rank read exactly its base shards, box by box (never a whole tensor: the spy refuses)
        assert read["boxes_are_shards"] and read["elements"] == read["held"] < read["model"]
        assert 0 < read["written"] < 4 * read["model"] / 2  # fp32 bytes: each rank wrote a part of the model
        for s in steps:
            assert abs(s["loss"] - s["ref_loss"]) < 1e-5 * max(1.0, abs(s["ref_loss"]))
            assert s["weights"] < 1e-5 and s["worst_tensor"] < 1e-5 and s["grads"] < 1e-5
    assert sum(read["written"] for read, _, _ in values) == 4 * values[0][0]["model"]  # every tensor once
    back = values[0][2]
    assert back["keys"] == set() and back["error"] < 1e-5
    assert "model.safetensors.index.json" in back["files"] and "config.json" in back["files"]
    assert sum(f.endswith(".safetensors") for f in back["files"]) > 1


def test_meta_init_is_one_devices_and_dcp_reshards(results):
    values = results["check_meta_init_equals_one_device_and_dcp_reshards"].raise_if_failed()
    for v in values:
        assert v["keys"] == set() and v["equal"], "init must equal one device's, bit for bit"
        assert v["peak"] == v["largest_module"] < v["model"] / 2  # one module (the embedding) whole at a time
        assert v["held"] < v["model"]
        assert v["resharded"] and v["dcp_source"] == "dcp"
        assert v["hf_tp4sp"] and v["hf_dp2tp2"]
    assert values[0]["one_process"]


def test_errors_name_the_problem_and_the_fix(results):
    for v in results["check_errors_name_the_fix"].raise_if_failed():
        assert "meta device" in v["no_weights"] and "weights='init'" in v["no_weights"]
        assert "meta device" in v["trainer_no_weights"]
        assert "model.norm.weight" in v["missing"] and "model.extra.weight" in v["missing"]
        assert "other shapes" in v["shape"] and f"({VOCAB + 1}, 64)" in v["shape"]
        assert "no such directory" in v["not_a_checkpoint"]
        assert "torch.manual_seed" in v["seeds"]


def test_the_readmes_big_model_lines_load_and_save(results):
    keys, equal = results["check_readme_big_model_lines"].raise_if_failed()[0]
    assert keys == set() and equal
