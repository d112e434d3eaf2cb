"""`document_attention` on one process: equal to `scaled_dot_product_attention` with the document
causal mask (values and gradients, multi-head and grouped-query), independent of the tokens' order,
a well-formed custom op (torch.library.opcheck), and kept whole by the tracer."""

import pytest
import torch
import torch.nn.functional as F

from hotswitch.kernels.attention import document_attention, document_groups
from hotswitch.models import PackedCausalLMLoss, build_model, document_causal_mask, document_ids_of

ROWS = ([30, 20, 14], [64], [1, 1, 40, 22])


def _batch(heads, kv_heads, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    positions = torch.tensor([[p for n in row for p in range(n)] for row in ROWS])
    b, t = positions.shape
    q = torch.randn(b, heads, t, d, generator=g)
    k, v = torch.randn(b, kv_heads, t, d, generator=g), torch.randn(b, kv_heads, t, d, generator=g)
    return q, k, v, positions, document_ids_of(positions), torch.randn(b, heads, t, d, generator=g)


def _grads(fn, q, k, v, w):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    y = fn(*leaves)
    (y * w).sum().backward()
    return [y.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_equals_sdpa_with_the_document_causal_mask(heads, kv_heads):
    q, k, v, positions, documents, w = _batch(heads, kv_heads)
    mask = document_causal_mask(positions)
    got = _grads(lambda *t: document_attention(*t, positions, documents), q, k, v, w)
    want = _grads(lambda *t: F.scaled_dot_product_attention(*t, attn_mask=mask, enable_gqa=heads != kv_heads),
                  q, k, v, w)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_any_order_of_the_tokens_gives_the_same_result():
    """The mask comes from ids and positions: permuting the tokens (and their ids and positions)
    permutes the output, nothing else (what lets context parallelism place tokens freely)."""
    q, k, v, positions, documents, w = _batch(4, 2)
    perm = torch.randperm(q.shape[2], generator=torch.Generator().manual_seed(1))
    out = document_attention(q, k, v, positions, documents)
    moved = document_attention(q[:, :, perm], k[:, :, perm], v[:, :, perm], positions[:, perm], documents[:, perm])
    torch.testing.assert_close(moved, out[:, :, perm], atol=1e-6, rtol=1e-6)


def test_is_a_well_formed_custom_op():
    q, k, v, positions, documents, _ = _batch(4, 2)
    torch.library.opcheck(torch.ops.hotswitch.document_attention.default, (q, k, v, positions, documents))
    grad = torch.randn_like(q)
    torch.library.opcheck(torch.ops.hotswitch.document_attention_backward.default,
                          (grad, q, k, v, positions, documents))


def test_long_documents_attend_in_query_blocks_that_see_only_earlier_keys():
    docs, positions = [7] * 600, list(range(600))
    groups = document_groups(docs, positions, 600, group_queries=256)
    assert [len(q) for q, _ in groups] == [256, 256, 88]
    assert [len(k) for _, k in groups] == [256, 512, 600]  # keys up to each block's last query
    short = document_groups([1, 1, 2, 3, 3, 3], [0, 1, 0, 0, 1, 2], 6)
    assert short == [([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5])]  # short documents share one call


def test_the_tracer_keeps_the_op_whole_and_the_loss_matches_the_masked_model():
    from hotswitch.compiler.trace import trace

    torch.manual_seed(0)
    model = PackedCausalLMLoss(build_model("gpt-tiny", vocab_size=97))
    positions = torch.tensor([[p for n in row for p in range(n)] for row in ROWS])
    ids = torch.randint(0, 97, positions.shape)
    labels = ids.roll(-1, dims=1)
    documents = document_ids_of(positions)
    torch.testing.assert_close(model(ids, positions, labels, documents), model(ids, positions, labels))
    logic = trace(model, (ids, positions, labels, documents))
    targets = [str(n.target) for n in logic.joint.graph.nodes if n.op == "call_function"]
    assert targets.count("hotswitch.document_attention.default") == 2  # one per layer
    assert targets.count("hotswitch.document_attention_backward.default") == 2
    assert not any("scaled_dot_product" in t or t == "aten._softmax.default" for t in targets)  # no attention scores


def test_document_ids_share_the_sequence_dim_even_for_one_row():
    """One row specializes the batch dim, so export infers each input's dims apart; the op tells it
    that positions and ids have q's tokens, so context parallelism shards them with the sequence
    (it once left them whole, and the cp plan indexed past a rank's tokens)."""
    from hotswitch.compiler.trace import trace

    torch.manual_seed(0)
    model = PackedCausalLMLoss(build_model("gpt-tiny", vocab_size=97))
    positions = torch.tensor([[p for n in (40, 24) for p in range(n)]])
    ids = torch.randint(0, 97, positions.shape)
    logic = trace(model, (ids, positions, ids.roll(-1, dims=1), document_ids_of(positions)))
    assert logic.sequence_inputs() == (True, True, True, True)


def test_half_precision_gradients_stay_close_to_fp32():
    """bf16 inputs (the GPU's training dtype; CPU SDPA runs it too): the backward computes its
    probabilities in fp32, so its gradients match the fp32 op's to bf16 precision."""
    q, k, v, positions, documents, w = _batch(4, 2)
    full = _grads(lambda *t: document_attention(*t, positions, documents), q, k, v, w)
    half = _grads(lambda *t: document_attention(*t, positions, documents), q.bfloat16(), k.bfloat16(),
                  v.bfloat16(), w.bfloat16())
    for a, b in zip(half, full):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b, atol=3e-2, rtol=3e-2)
