"""Document-causal attention under context parallelism on 4 gloo processes, the token placement as
data (`runtime.cp_attention` over `distconfig.tokens`): outputs and gradients equal one device's,
and the keys/values move in one all-to-all of exactly the planned sizes, or not at all."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hotswitch.distconfig.tokens import Documents, document_placement, zigzag_placement
from hotswitch.models import PackedCausalLMLoss, build_model, document_causal_mask, document_ids_of
from hotswitch.runtime.cp_attention import CPAttentionPlan, cp_attention
from tests.distributed import dist_fixture

BATCHES = {
    "mixed rows": ([[7, 5, 4], [3, 13], [16], [1, 2, 11]], 16),  # the last row padded by 2 tokens
    "one long document": ([[64]], 64),
    "skewed": ([[40, 9, 6, 4, 3, 2], [22, 21, 13, 7, 1], [50, 14]], 64),
}


def _attention_on_one_device(docs, heads, kv_heads, head_dim=8, seed=0):
    """q, k, v, the output's weight w ([rows, T, heads, d]) and the reference output and gradients."""
    g = torch.Generator().manual_seed(seed)
    shape = (docs.num_rows, docs.row_length)
    q, w = torch.randn(*shape, heads, head_dim, generator=g), torch.randn(*shape, heads, head_dim, generator=g)
    k, v = torch.randn(*shape, kv_heads, head_dim, generator=g), torch.randn(*shape, kv_heads, head_dim, generator=g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = document_causal_mask(torch.tensor(docs.positions()))
    y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), attn_mask=mask,
                                       enable_gqa=heads != kv_heads).transpose(1, 2)
    (y * w).sum().backward()
    return (q, k, v, w), (y.detach(), *(t.grad for t in leaves))


def _worst_error(placement, heads, kv_heads):
    inputs, expected = _attention_on_one_device(placement.documents, heads, kv_heads)
    plan = CPAttentionPlan.build(placement, dist.get_rank())
    q, k, v = (plan.shard(t).requires_grad_() for t in inputs[:3])
    out = cp_attention(q, k, v, plan)
    (out * plan.shard(inputs[3])).sum().backward()
    got = (out, q.grad, k.grad, v.grad)
    return max((a - plan.shard(b)).abs().max().item() for a, b in zip(got, expected))


def check_outputs_and_gradients_match_one_device():
    """Every batch, both placements, multi-head and grouped-query attention; plus the cut of the
    long document (the document placement has to split it, with zero exchange elsewhere)."""
    errors = {}
    for name, (rows, row_length) in BATCHES.items():
        docs = Documents.from_rows(rows, row_length)
        for placement in (zigzag_placement(docs, 4), document_placement(docs, 4)):
            for heads, kv_heads in ((4, 4), (4, 2)):
                errors[name, placement.kind, heads, kv_heads] = _worst_error(placement, heads, kv_heads)
    return errors


class _CountAllToAll:
    """Records the (received, sent) row counts of every all_to_all_single, and counts all_gathers
    (the cp plan's ids and positions); restores both on exit."""

    def __enter__(self):
        self.calls, self.gathers = [], 0
        self._original, self._gather = dist.all_to_all_single, dist.all_gather

        def counting(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
            self.calls.append((list(output_split_sizes), list(input_split_sizes)))
            return self._original(output, input, output_split_sizes, input_split_sizes, **kwargs)

        def gathering(*args, **kwargs):
            self.gathers += 1
            return self._gather(*args, **kwargs)

        dist.all_to_all_single, dist.all_gather = counting, gathering
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single, dist.all_gather = self._original, self._gather


def check_collectives_follow_the_plan():
    """Short documents only: the document placement sends nothing (no collective at all), the
    zigzag one runs one all-to-all forward and one backward, sized by its fetch plan."""
    docs = Documents.from_rows([[8] * 8, [8] * 8])
    rank, calls = dist.get_rank(), {}
    for placement in (document_placement(docs, 4), zigzag_placement(docs, 4)):
        with _CountAllToAll() as counter:
            error = _worst_error(placement, 4, 2)
        planned = [sum(len(s) for s in placement.fetch[rank][src]) for src in range(4)]
        calls[placement.kind] = (counter.calls, planned, error)
    return calls


def check_wrong_shard_names_the_fix():
    plan = CPAttentionPlan.build(document_placement(Documents.from_rows([[8] * 8]), 4), dist.get_rank())
    x = torch.zeros(3, 2, 4)
    try:
        cp_attention(x, x, x, plan)
    except ValueError as e:
        return str(e)
    return None


def _packed_gpt_batch(vocab=97, seed=4):
    """4 rows of 16 tokens holding documents of 1-16 tokens, with their ids (`document_ids_of`)."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths])
                             for lengths in ([7, 5, 4], [3, 13], [16], [1, 2, 12, 1])])
    ids = torch.randint(0, vocab, positions.shape, generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[positions.roll(-1, dims=1) == 0] = -100
    return ids, positions, labels, document_ids_of(positions)


def check_compiled_layouts_match_one_device():
    """Our GPT with document_ids (attention = document_attention) compiled under three cp configs
    (dp x cp, tp x cp: the op's batch and head rules too); every layout (contiguous, zigzag,
    document-aware) gives the single-device loss and gradients. Keys and values move inside the op
    (all-to-all), not as the ExecGraph's all-gathers."""
    import copy

    import hotswitch as hs
    from hotswitch.compiler.lower import collective_kind, collectives

    torch.manual_seed(0)
    model = PackedCausalLMLoss(build_model("gpt-tiny", vocab_size=97))
    inputs = _packed_gpt_batch()
    ref = copy.deepcopy(model)
    loss_ref = ref(*inputs)
    loss_ref.backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    configs = ["cp4", "dp2cp2", "tp2cp2"]
    cm = hs.compile(model, inputs, configs=configs)
    errors, fetched, gathers = {}, {}, {}
    for layout in hs.runtime.inputs.CP_LAYOUTS:
        cm.cp_layout = layout
        for name in configs:
            cm.switch(name)
            cm.zero_grad()
            with _CountAllToAll() as counter:
                loss = cm.forward_backward(*cm.shard_inputs(*inputs))
            full = cm.full_grads()
            errors[layout, name] = (abs(loss.item() - loss_ref.item()),
                                    max((full[n] - g).abs().max().item() for n, g in grads.items()))
            fetched[layout, name] = sum(sum(received) for received, _ in counter.calls)
            gathers[layout, name] = counter.gathers
    cm.switch("cp4")
    forward = [collective_kind(n) for n in collectives(cm.exec_graph("cp4"), "forward")]
    return errors, fetched, forward, gathers


def check_hf_llama_layouts_match_one_device():
    """Hugging Face Llama (GQA) with document ids: its attention, through Hugging Face's
    AttentionInterface, is document_attention; cp4 and tp2cp2 in the zigzag and document layouts
    give the single-device loss and gradients."""
    import copy

    import hotswitch as hs
    from hotswitch.models import build_hf_model

    torch.manual_seed(0)
    model = PackedCausalLMLoss(build_hf_model("llama", vocab_size=97).model)
    inputs = _packed_gpt_batch()
    ref = copy.deepcopy(model)
    loss_ref = ref(*inputs)
    loss_ref.backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    cm = hs.compile(model, inputs, configs=["cp4", "tp2cp2"])
    errors = {}
    for layout in ("zigzag", "document"):
        cm.cp_layout = layout
        for name in ("cp4", "tp2cp2"):
            cm.switch(name)
            cm.zero_grad()
            loss = cm.forward_backward(*cm.shard_inputs(*inputs))
            full = cm.full_grads()
            errors[layout, name] = (abs(loss.item() - loss_ref.item()),
                                    max((full[n] - g).abs().max().item() for n, g in grads.items()))
    return errors


def check_all_gather_cp_on_long_packed_rows():
    """No document ids (all-gather cp), 4 packed rows of 1024 tokens under cp4: at this size DTensor
    moves the batch onto the cp axis mid-graph, so the logits' rows arrive as a plain Shard while the
    labels' rows are strided; the loss once paired them unaligned (off by 1e-3). Now equal."""
    import copy

    import hotswitch as hs
    from hotswitch.bench.cp import skewed_batch

    docs = skewed_batch(1024, 4)
    positions = torch.tensor(docs.positions())
    ids = torch.randint(1, 1001, positions.shape, generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[positions.roll(-1, dims=1) == 0] = -100
    torch.manual_seed(0)
    model = PackedCausalLMLoss(build_model("gpt-tiny", vocab_size=1001, max_seq_len=1024))
    ref = copy.deepcopy(model)
    loss_ref = ref(ids, positions, labels)
    loss_ref.backward()
    cm = hs.compile(model, (ids, positions, labels), configs=["cp4"])
    loss = cm.forward_backward(*cm.shard_inputs(ids, positions, labels))
    full = cm.full_grads()
    return abs(loss.item() - loss_ref.item()), max((full[n] - p.grad).abs().max().item()
                                                   for n, p in ref.named_parameters())


def check_moving_tokens_needs_document_ids():
    import hotswitch as hs

    torch.manual_seed(0)
    model = PackedCausalLMLoss(build_model("gpt-tiny", vocab_size=97))
    ids, positions, labels, _ = _packed_gpt_batch()
    cm = hs.compile(model, (ids, positions, labels), configs=["cp4"], cp_layout="zigzag")
    try:
        cm.shard_inputs(ids, positions, labels)
    except ValueError as e:
        return str(e)
    return None


def check_trainer_with_document_layout_matches_single_device():
    """Mixed lengths, rows to 8 under dp4 and the longer ones under cp4 with documents placed per
    micro-batch (cp_layout="document"): the optimizer's steps equal single-device AdamW."""
    from hotswitch.train.trainer import Trainer
    from tests.test_trainer_world4 import LR, _batches, _model, _reference_steps, _steps_against

    model, batches = _model("gpt"), _batches(steps=2)
    ref = _reference_steps(model, batches)
    trainer = Trainer(model, ["dp4", "cp4"], dict(name="adamw", lr=LR), buckets=[8, 128],
                      bucket_configs=["dp4", "cp4"], micro_batch_tokens=64, cp_layout="document")
    return _steps_against(trainer, batches, ref)


pytestmark = pytest.mark.slow  # spawns gloo processes
results = dist_fixture(4, [check_outputs_and_gradients_match_one_device, check_collectives_follow_the_plan,
                           check_wrong_shard_names_the_fix, check_compiled_layouts_match_one_device,
                           check_moving_tokens_needs_document_ids, check_hf_llama_layouts_match_one_device,
                           check_all_gather_cp_on_long_packed_rows,
                           check_trainer_with_document_layout_matches_single_device])


def test_outputs_and_gradients_equal_one_device(results):
    for errors in results["check_outputs_and_gradients_match_one_device"].raise_if_failed():
        assert len(errors) == 12 and all(e <= 1e-5 for e in errors.values()), errors


def test_keys_and_values_move_as_planned(results):
    for rank, calls in enumerate(results["check_collectives_follow_the_plan"].raise_if_failed()):
        assert calls["document"][0] == []  # every document whole on one rank: no all-to-all
        zigzag_calls, planned, error = calls["zigzag"]
        assert len(zigzag_calls) == 2, zigzag_calls  # forward, backward
        forward, backward = zigzag_calls
        assert forward[0] == planned and backward[1] == planned  # gradients go back the way values came
        assert sum(planned) > 0 and error <= 1e-5 and calls["document"][2] <= 1e-5


def test_a_wrong_shard_is_refused_with_the_fix(results):
    for message in results["check_wrong_shard_names_the_fix"].raise_if_failed():
        assert message and "plan.shard" in message and "holds 16 tokens" in message


def test_compiled_cp_layouts_equal_one_device_and_move_keys_in_the_op(results):
    values = results["check_compiled_layouts_match_one_device"].raise_if_failed()
    for errors, fetched, forward, gathers in values:
        # the plan's ids and positions gathered once per step, not per layer and op (2 layers, fwd + bwd)
        assert set(gathers.values()) == {1}, gathers
        assert len(errors) == 9 and all(loss <= 1e-5 and grad <= 1e-5 for loss, grad in errors.values()), errors
        assert "all_gather" not in forward, forward  # attention's keys and values are the op's business
    totals = {layout: sum(v[1][layout, name] for v in values for name in ("cp4", "dp2cp2", "tp2cp2"))
              for layout in ("contiguous", "zigzag", "document")}
    assert 0 < totals["document"] < totals["zigzag"], totals  # whole documents need no keys from elsewhere


def test_moving_tokens_without_document_ids_names_the_fix(results):
    for message in results["check_moving_tokens_needs_document_ids"].raise_if_failed():
        assert message and "document_ids" in message and "cp_layout='contiguous'" in message


def test_trainer_with_document_aware_cp_equals_single_device_adamw(results):
    from tests.test_trainer_world4 import _assert_equivalent

    steps = results["check_trainer_with_document_layout_matches_single_device"].raise_if_failed()[0]
    _assert_equivalent(steps, worst_tensor=1e-5, configs=["dp4", "cp4"])
    assert {b.config for s in steps for b in s["report"].buckets} == {"dp4", "cp4"}


def test_hf_llama_in_moved_layouts_equals_one_device(results):
    for errors in results["check_hf_llama_layouts_match_one_device"].raise_if_failed():
        assert len(errors) == 4 and all(loss <= 1e-5 and grad <= 1e-5 for loss, grad in errors.values()), errors


def test_all_gather_cp_on_long_packed_rows_equals_one_device(results):
    for loss_err, grad_err in results["check_all_gather_cp_on_long_packed_rows"].raise_if_failed():
        assert loss_err <= 1e-5 and grad_err <= 1e-5, (loss_err, grad_err)
