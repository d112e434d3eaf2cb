"""The Trainer's data path, property-tested on one process: whatever the lengths, the buckets, rows,
filler rows, micro-batch counts and token weights it chooses give exactly the single-device
gradient of the batch's mean next-token loss.

Each micro-batch runs through the same loss module the Trainer compiles (`PackedCausalLMLoss`,
eager here; that a compiled ExecGraph equals its eager micro-batch on every config is what the
multi-process tests check), weighted as `Trainer.step` weights it (`data.weighted_micro_batches`).
"""
import copy

import torch
import torch.nn.functional as F
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hotswitch.models import PackedCausalLMLoss, build_model
from hotswitch.train import data as D

VOCAB = 97


def _gpt():
    torch.manual_seed(0)
    return build_model("gpt-tiny", vocab_size=VOCAB, dim=32, n_layers=1, n_heads=4, n_kv_heads=2)


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   use_cache=False)
    return transformers.LlamaForCausalLM(cfg)


def _logits(model, ids):
    out = model(input_ids=ids)
    return out.logits if hasattr(out, "logits") else out


def _reference_grads(model, sequences):
    """One device, every sequence alone: loss = sum of token losses / the batch's target tokens."""
    model = copy.deepcopy(model)
    total = D.target_tokens([len(s) for s in sequences])
    loss = sum(F.cross_entropy(_logits(model, s[None])[0, :-1].float(), s[1:], reduction="sum")
               for s in sequences if len(s) > 1) / total
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _trainer_path_grads(model, sequences, *, num_buckets, multiple, dp, micro_batch_tokens):
    """The Trainer's step on one process: its buckets (from the batch's lengths), packing, micro-batch
    shapes for `dp` replicas, filler rows and token weights, each micro-batch's loss its own mean."""
    model = copy.deepcopy(model)
    loss_module = PackedCausalLMLoss(model)
    lengths = [len(s) for s in sequences]
    total = D.target_tokens(lengths)
    bounds = D.choose_boundaries(lengths, num_buckets, multiple)
    loss, shapes = 0.0, []
    for bucket in D.make_buckets(lengths, bounds):
        rows = D.rows_per_micro_batch(dp, bucket.high, micro_batch_tokens)
        for mb, weight in D.weighted_micro_batches(sequences, bucket, rows, total):
            shapes.append(tuple(mb.input_ids.shape))
            mb_loss = loss_module(*mb.inputs)
            (mb_loss * weight).backward()
            loss += float(mb_loss.detach()) * weight
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}, shapes


def _assert_same(ref, got):
    """Loss and every gradient within 1e-5 relative. A gradient that is zero in exact arithmetic (the
    queries when every target attends to one key: softmax over one element) is fp32 noise on both
    sides, so it is compared against 1e-6 of the whole gradient's norm instead."""
    ref_loss, ref_grads = ref
    loss, grads = got[:2]
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    scale = float(torch.sqrt(sum(g.pow(2).sum() for g in ref_grads.values())))
    for n, g in ref_grads.items():
        diff = float((grads[n] - g).norm())
        assert diff <= 1e-5 * float(g.norm()) + 1e-6 * scale, (n, diff, float(g.norm()), scale)


lengths_st = st.lists(st.integers(1, 300), min_size=1, max_size=14).filter(lambda ls: sum(n - 1 for n in ls) > 0)
shape_st = dict(num_buckets=st.integers(1, 4), multiple=st.sampled_from([1, 16, 48]), dp=st.sampled_from([1, 2, 4]),
                micro_batch_tokens=st.sampled_from([16, 100, 256, 2048]), seed=st.integers(0, 2**16))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=lengths_st, **shape_st)
def test_any_lengths_give_the_single_device_gradient_gpt(lengths, num_buckets, multiple, dp, micro_batch_tokens, seed):
    g = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]  # token 0 too: the filler's id
    model = _gpt()
    got = _trainer_path_grads(model, sequences, num_buckets=num_buckets, multiple=multiple, dp=dp,
                              micro_batch_tokens=micro_batch_tokens)
    _assert_same(_reference_grads(model, sequences), got)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=lengths_st, **shape_st)
def test_any_lengths_give_the_single_device_gradient_hf_llama(lengths, num_buckets, multiple, dp, micro_batch_tokens,
                                                               seed):
    g = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    model = _llama()
    got = _trainer_path_grads(model, sequences, num_buckets=num_buckets, multiple=multiple, dp=dp,
                              micro_batch_tokens=micro_batch_tokens)
    _assert_same(_reference_grads(model, sequences), got)


def test_the_issue_batches_several_micro_batches_and_filler_rows():
    """The held-out lengths (log-normal, 4..400) with small micro-batches: many micro-batches per
    bucket, a filled last one, rows longer than 128."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.exp(3.3 + 0.9 * torch.randn(13, generator=g)).clamp(4, 400).long().tolist() + [300, 200]
    sequences = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    model = _gpt()
    got = _trainer_path_grads(model, sequences, num_buckets=3, multiple=16, dp=4, micro_batch_tokens=64)
    assert max(s[1] for s in got[2]) > 128 and len(got[2]) > 3
    _assert_same(_reference_grads(model, sequences), got)


def test_batch_digest_tells_batches_apart():
    a = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    assert D.batch_digest(a) == D.batch_digest([t.clone() for t in a])
    assert D.batch_digest(a) != D.batch_digest(a[::-1])  # order matters: buckets index into it
    assert D.batch_digest(a) != D.batch_digest([torch.tensor([1, 2]), torch.tensor([3, 4, 5])])  # same tokens
    assert D.batch_digest(a) != D.batch_digest([torch.tensor([1, 2, 3]), torch.tensor([4, 6])])
