"""Models as they come, on 2 gloo processes: a raw Hugging Face model called with keyword inputs,
forward returning a dict or an object with `.loss`, string configs, and the errors a new user meets
(missing or extra inputs, the global batch passed without shard_inputs, untraceable code, a type
torch.export cannot flatten), each naming the fix. Also: no "alltoall" fallback line from DTensor."""
import copy
import dataclasses
import logging
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hotswitch as hs
from hotswitch.compiler.signature import InputError
from hotswitch.compiler.trace import TraceError
from tests.compile_checks import rel_err
from tests.distributed import dist_fixture

pytestmark = pytest.mark.slow  # spawns gloo processes and compiles; `-m 'not slow'` leaves it out

VOCAB = 97


def hf_batch(batch=5, seq=12, seed=0):
    """Keyword inputs as a Hugging Face causal LM takes them: labels are the ids (the model shifts
    them), a few positions ignored. 5 rows: the dp=2 split is uneven."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    return dict(input_ids=ids, labels=labels)


def qwen2():
    import transformers

    torch.manual_seed(0)  # identical weights on every rank
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation="sdpa")
    return transformers.Qwen2ForCausalLM(config)


def check_raw_hf_model_with_keyword_inputs_and_string_configs():
    """A raw Hugging Face model: Qwen2ForCausalLM as it comes, configs=["dp=2", "tp2"], keyword inputs;
    loss, forward-only loss and every gradient within 1e-5 of one device."""
    model = qwen2()
    batch = hf_batch()
    ref = copy.deepcopy(model)
    out = ref(**batch)
    out.loss.backward()
    grads_ref = {n: p.grad for n, p in ref.named_parameters()}
    cm = hs.compile(model, batch, configs=["dp=2", "tp2"])
    assert [c.name for c in cm.configs] == ["dp2", "tp2"]
    report = {}
    for name in ("dp2", "tp2"):
        cm.switch(name)
        cm.zero_grad()
        local = cm.shard_inputs(**batch)
        assert isinstance(local, dict) and set(local) == {"input_ids", "labels"}
        loss = cm.forward_backward(**local)
        forward_only = cm(**local)
        grads = cm.full_grads()
        assert set(grads) == set(grads_ref)
        worst = max(grads_ref, key=lambda n: rel_err(grads[n], grads_ref[n]))
        report[name] = dict(loss=abs(loss.item() - out.loss.item()), forward=abs(forward_only.item() - out.loss.item()),
                            grad=rel_err(grads[worst], grads_ref[worst]), worst=worst,
                            mask_rows=_mask_rows(cm.exec_graph(name)))
    return report


def _mask_rows(gm) -> int:
    """The most rows of an attention-mask-shaped value ([rows, 1, T, T] booleans) the program makes."""
    return max(v.shape[0] for n in gm.graph.nodes if isinstance(v := n.meta.get("val"), torch.Tensor)
               and v.dtype == torch.bool and v.dim() == 4 and v.shape[1] == 1 and v.shape[2] == v.shape[3])


def check_dp_ranks_make_only_their_rows_of_the_mask_in_one_program():
    """HF builds its causal mask from positions alone, [rows, 1, T, T] for the whole batch; each dp
    rank makes only its own rows of it (at 32K tokens and 64 rows, 1 GiB instead of 64), and the dp
    ranks still lower one program between them (the batch `arange` that picks the mask's rows is cut
    to rank 0's rows in it: the rows it picks are alike). Loss and gradients equal one device."""
    import os

    model = qwen2()
    batch = hf_batch(batch=4)
    loss_ref, grads_ref = _reference(model, **batch)
    os.environ["HOTSWITCH_CACHE"] = "0"  # no disk: a program one rank lowered comes from it
    try:
        cm = hs.compile(model, batch, configs=["dp2"])
    finally:
        del os.environ["HOTSWITCH_CACHE"]
    loss = cm.forward_backward(**cm.shard_inputs(**batch))
    grads = cm.full_grads()
    state = cm._state("dp2")
    program = state.programs[next(reversed(state.programs))]
    return dict(loaded=program.loaded, mask_rows=_mask_rows(cm.exec_graph("dp2")),
                loss=abs(loss.item() - loss_ref.item()), grad=max(rel_err(grads[n], grads_ref[n]) for n in grads_ref))


class DictLoss(nn.Module):
    """forward(ids, targets, scale=...) -> {"loss": ..., "logits": ...}: a dict output, positional inputs
    and a non-tensor input fixed at compile time."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids, targets, scale=1.0):
        logits = self.head(self.embed(ids)) * scale
        return {"loss": F.cross_entropy(logits.flatten(0, 1), targets.flatten()), "logits": logits}


@dataclasses.dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor


class ObjectLoss(DictLoss):
    def forward(self, ids, targets, scale=1.0):
        out = super().forward(ids, targets, scale)
        return Output(out["loss"], out["logits"])


def _reference(model, *args, **kwargs):
    ref = copy.deepcopy(model)
    out = ref(*args, **kwargs)
    loss = out if isinstance(out, torch.Tensor) else out["loss"] if isinstance(out, dict) else out.loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in ref.named_parameters()}


def check_dict_and_object_outputs_positional_and_mixed_calls():
    ids = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(1))
    out = {}
    for cls in (DictLoss, ObjectLoss):
        torch.manual_seed(0)
        model = cls()
        loss_ref, grads_ref = _reference(model, ids, ids, scale=0.5)
        cm = hs.compile(model, (ids, ids, 0.5), configs=["dp2"])
        local = cm.shard_inputs(ids, ids, 0.5)
        assert isinstance(local, tuple) and local[2] == 0.5 and local[0].shape == (2, 6)
        loss = cm.forward_backward(local[0], targets=local[1], scale=0.5)  # positional, keyword, mixed: all bind
        grads = cm.full_grads()
        out[cls.__name__] = (abs(loss.item() - loss_ref.item()),
                             max(rel_err(grads[n], grads_ref[n]) for n in grads_ref))
        with pytest.raises(InputError, match=r"scale=0\.25, but the model was compiled with scale=0\.5"):
            cm.forward_backward(*local[:2], scale=0.25)
    return out


def check_missing_and_extra_inputs_name_the_expected_ones():
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (4, 6))
    cm = hs.compile(DictLoss(), dict(ids=ids, targets=ids), configs=["dp2"])
    local = cm.shard_inputs(ids=ids, targets=ids)
    messages = []
    for call in (lambda: cm.forward_backward(ids=local["ids"]),                       # one missing
                 lambda: cm.forward_backward(**local, scale=2.0),                      # one not given when compiled
                 lambda: cm.forward_backward(**local, mask=local["ids"]),              # not a parameter at all
                 lambda: cm.shard_inputs(local["ids"])):
        with pytest.raises(InputError) as info:
            call()
        messages.append(str(info.value))
    assert "missing 'targets'" in messages[0] and "compiled with inputs (ids, targets)" in messages[0], messages[0]
    assert "'scale' not given at compile time" in messages[1] and "(ids, targets)" in messages[1], messages[1]
    assert "unexpected keyword argument 'mask'" in messages[2] and "DictLoss.forward(ids, targets)" in messages[2]
    assert "missing 'targets'" in messages[3], messages[3]
    return messages


def check_global_batch_without_shard_inputs_warns_once():
    """Every dp rank given the whole batch: exact (a mean over copies), but each rank computes all of it;
    one warning in the job, naming shard_inputs: every rank sees it alike, so rank 0 alone says it."""
    torch.manual_seed(0)
    model = DictLoss()
    ids = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(2))
    loss_ref, _ = _reference(model, ids=ids, targets=ids)
    cm = hs.compile(model, dict(ids=ids, targets=ids), configs=["dp2"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [cm.forward_backward(ids=ids, targets=ids).item() for _ in range(3)]
        cm.forward_backward(**cm.shard_inputs(ids=ids, targets=ids))  # the right way: silent
    mine = [str(w.message) for w in caught if "hotswitch" in str(w.message)]
    assert len(mine) == (dist.get_rank() == 0), (dist.get_rank(), mine)
    assert all("cm.forward_backward(**cm.shard_inputs(**batch))" in m and "same inputs" in m for m in mine), mine
    assert all(abs(v - loss_ref.item()) < 1e-6 for v in losses), (losses, loss_ref)
    return mine


def check_positional_inputs_to_a_hf_model_explain_the_binding():
    """(ids, labels) positionally bind labels to attention_mask: no loss comes back; the error says so."""
    batch = hf_batch(batch=2, seq=6)
    with pytest.raises(InputError) as info:
        hs.compile(qwen2(), (batch["input_ids"], batch["labels"]), configs=["dp2"])
    message = str(info.value)
    assert "without a loss" in message and "labels=" in message, message
    assert "attention_mask=Tensor[2, 6]" in message and "dict(input_ids=ids, labels=labels)" in message, message
    return message


class Branchy(DictLoss):
    def forward(self, ids, targets):
        h = self.embed(ids)
        if h.sum() > 0:  # a Python branch on a tensor's value
            h = h * 2
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def check_untraceable_model_names_the_line_and_the_cause():
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (4, 6))
    with pytest.raises(TraceError) as info:
        hs.compile(Branchy(), (ids, ids), configs=["dp2"])
    message = str(info.value)
    assert "could not trace Branchy" in message and "depends on a tensor's values" in message, message
    assert "test_models_world2.py" in message and "if h.sum() > 0:" in message and "torch.where" in message, message
    return message


class Batch:  # a container torch.export cannot look into until registered
    def __init__(self, ids, targets):
        self.ids, self.targets = ids, targets


@dataclasses.dataclass
class RegisteredBatch:
    ids: torch.Tensor
    targets: torch.Tensor


class BatchLoss(DictLoss):
    def forward(self, batch):
        return F.cross_entropy(self.head(self.embed(batch.ids)).flatten(0, 1), batch.targets.flatten())


def check_unflattenable_input_names_the_type_and_registering_it_works():
    torch.manual_seed(0)
    model = BatchLoss()
    ids = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(3))
    with pytest.raises(InputError) as info:
        hs.compile(model, dict(batch=Batch(ids, ids)), configs=["dp2"])
    message = str(info.value)
    assert "input batch is a tests.test_models_world2.Batch" in message, message
    assert "torch.export.register_dataclass(Batch)" in message, message
    torch.export.register_dataclass(RegisteredBatch)
    loss_ref, grads_ref = _reference(model, RegisteredBatch(ids, ids))
    cm = hs.compile(model, dict(batch=RegisteredBatch(ids, ids)), configs=["dp2"])
    local = cm.shard_inputs(batch=RegisteredBatch(ids, ids))
    assert isinstance(local["batch"], RegisteredBatch) and local["batch"].ids.shape == (2, 6)
    loss = cm.forward_backward(**local)
    grads = cm.full_grads()
    return message, abs(loss.item() - loss_ref.item()), max(rel_err(grads[n], grads_ref[n]) for n in grads_ref)


def check_no_alltoall_fallback_line():
    """Packed rows under tp2sp redistribute Shard(seq) -> Shard(heads): DTensor's gloo fallback would
    log "does not support alltoall" once per process; hotswitch traces the same all-gather + chunk
    without it, and the results stay exact."""
    from torch._logging._internal import warning_once

    from hotswitch.models import PackedCausalLMLoss, build_model

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("torch.distributed.tensor._collective_utils")
    warning_once.cache_clear()  # a line printed earlier in this process would hide a repeat
    logger.addHandler(handler)
    try:
        torch.manual_seed(0)
        model = PackedCausalLMLoss(build_model("gpt-tiny", n_layers=1, vocab_size=VOCAB))
        ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
        positions = torch.cat([torch.arange(10), torch.arange(6)]).expand(2, 16).contiguous()
        inputs = (ids, positions, ids)
        ref = copy.deepcopy(model)
        loss_ref = ref(*inputs)
        loss_ref.backward()
        cm = hs.compile(model, inputs, configs=["tp2sp"])
        loss = cm.forward_backward(*cm.shard_inputs(*inputs))
        grads = cm.full_grads()
    finally:
        logger.removeHandler(handler)
    err = max(rel_err(grads[n], p.grad) for n, p in ref.named_parameters())
    return [r.getMessage() for r in records], abs(loss.item() - loss_ref.item()), err


def check_configs_as_strings_at_every_entry_point():
    """hs.compile and the Trainer read configs with the one parser (distconfig.parse_configs): a list
    of strings in either spelling, or one string of several; a wrong one gets the one message that
    lists the accepted forms."""
    from hotswitch.distconfig import GRAMMAR

    torch.manual_seed(0)
    model = DictLoss()
    ids = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(1))
    cm = hs.compile(model, (ids, ids), configs="dp=2;tp=2")
    names = [c.name for c in cm.configs]
    messages = []
    for bad in ("dp2;banana", ["dp2", 2], ["dp2,tp2"]):
        for entry in (lambda c: hs.compile(model, (ids, ids), configs=c), lambda c: hs.Trainer(qwen2(), c)):
            with pytest.raises(ValueError) as e:
                entry(bad)
            messages.append(str(e.value))
    with pytest.raises(ValueError, match=r"repeat the name\(s\) \['dp2'\]"):
        hs.Trainer(qwen2(), ["dp2", "dp=2"])
    assert all(GRAMMAR in m for m in messages), messages
    return names


CHECKS = [
    check_raw_hf_model_with_keyword_inputs_and_string_configs,
    check_dp_ranks_make_only_their_rows_of_the_mask_in_one_program,
    check_dict_and_object_outputs_positional_and_mixed_calls,
    check_missing_and_extra_inputs_name_the_expected_ones,
    check_global_batch_without_shard_inputs_warns_once,
    check_positional_inputs_to_a_hf_model_explain_the_binding,
    check_untraceable_model_names_the_line_and_the_cause,
    check_unflattenable_input_names_the_type_and_registering_it_works,
    check_no_alltoall_fallback_line,
    check_configs_as_strings_at_every_entry_point,
]
results = dist_fixture(2, CHECKS)


def test_raw_hf_model_keyword_inputs_equal_single_device(results):
    reports = results["check_raw_hf_model_with_keyword_inputs_and_string_configs"].raise_if_failed()
    for report in reports:
        for name, r in report.items():
            assert r["loss"] <= 1e-5 and r["forward"] <= 1e-5, (name, r)
            assert r["grad"] <= 1e-5, (name, r)
    # each rank makes only its rows of HF's mask: 5 rows are 3 and 2 under dp2, all 5 under tp2
    assert [(r["dp2"]["mask_rows"], r["tp2"]["mask_rows"]) for r in reports] == [(3, 5), (2, 5)], reports


def test_dp_ranks_make_only_their_rows_of_the_mask_in_one_program(results):
    ranks = results["check_dp_ranks_make_only_their_rows_of_the_mask_in_one_program"].raise_if_failed()
    assert all(r["mask_rows"] == 2 for r in ranks), ranks  # 4 rows over dp2
    assert sorted(r["loaded"] for r in ranks) == [False, True], ranks  # one rank lowered it for both
    assert all(r["loss"] <= 1e-5 and r["grad"] <= 1e-5 for r in ranks), ranks


def test_dict_and_object_outputs(results):
    for report in results["check_dict_and_object_outputs_positional_and_mixed_calls"].raise_if_failed():
        assert set(report) == {"DictLoss", "ObjectLoss"}
        assert all(loss <= 1e-6 and grad <= 1e-5 for loss, grad in report.values()), report


def test_missing_and_extra_inputs(results):
    results["check_missing_and_extra_inputs_name_the_expected_ones"].raise_if_failed()


def test_global_batch_warns_once(results):
    said = results["check_global_batch_without_shard_inputs_warns_once"].raise_if_failed()
    assert [len(m) for m in said] == [1, 0], said  # once in the job: rank 0's


def test_hf_positional_inputs_error(results):
    results["check_positional_inputs_to_a_hf_model_explain_the_binding"].raise_if_failed()


def test_untraceable_model_error(results):
    results["check_untraceable_model_names_the_line_and_the_cause"].raise_if_failed()


def test_unflattenable_input_error_and_registration(results):
    check = "check_unflattenable_input_names_the_type_and_registering_it_works"
    for _, dloss, dgrad in results[check].raise_if_failed():
        assert dloss <= 1e-6 and dgrad <= 1e-5, (dloss, dgrad)


def test_no_alltoall_fallback_line(results):
    for records, dloss, dgrad in results["check_no_alltoall_fallback_line"].raise_if_failed():
        assert records == [], records
        assert dloss <= 1e-5 and dgrad <= 1e-5, (dloss, dgrad)


def test_configs_as_strings_at_every_entry_point(results):
    assert results["check_configs_as_strings_at_every_entry_point"].raise_if_failed() == [["dp2", "tp2"]] * 2


def test_grad_bucket_bytes_must_be_a_positive_byte_count():
    """Checked before anything else (no process group needed): the message names the unit and the default."""
    ids = torch.zeros(4, 6, dtype=torch.long)
    for bad in (0, -1, 2.5, True, "25MB"):
        with pytest.raises(ValueError, match=r"grad_bucket_bytes must be a positive number of bytes .* 25 MiB"):
            hs.compile(DictLoss(), dict(ids=ids, targets=ids), configs=["dp2"], grad_bucket_bytes=bad)
