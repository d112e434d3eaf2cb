"""`masked_attention` on one process: a model's `scaled_dot_product_attention` kept whole by the tracer,
equal to SDPA (values and gradients: causal, boolean and additive masks, grouped queries), a
well-formed custom op, the calls it must not take refused, and its sharding rule exact where the
queries are cut (the mask's rows with them, key and value gradients partial sums). At run time a
program's op pairs become torch's fused kernel and that kernel's backward (`fused_kernels`), with the
op's numbers."""

import pytest
import torch
import torch.nn.functional as F

from hotswitch.kernels.attention import masked_attention, masked_attention_backward, masked_call


def _grads(fn, q, k, v, w):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    y = fn(*leaves)
    (y * w).sum().backward()
    return [y.detach(), *(t.grad for t in leaves)]


def _inputs(b=2, heads=4, kv_heads=2, t=11, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, t, d, generator=g)
    k, v = torch.randn(b, kv_heads, t, d, generator=g), torch.randn(b, kv_heads, t, d, generator=g)
    return q, k, v, torch.randn(b, heads, t, d, generator=g)


def _masks(b, t):
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(b, 1, t, t, generator=g) > 0.4
    keep[..., 0] = True  # no query without a key (SDPA's kernels disagree on empty rows)
    additive = torch.zeros(1, 1, t, t).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return {"causal": None, "boolean [B,1,T,T]": keep, "additive [T,T]": additive[0, 0]}


@pytest.mark.parametrize("mask_kind", ["causal", "boolean [B,1,T,T]", "additive [T,T]"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_equals_sdpa(mask_kind, heads, kv_heads):
    q, k, v, w = _inputs(heads=heads, kv_heads=kv_heads)
    mask = _masks(q.shape[0], q.shape[2])[mask_kind]
    kwargs = dict(attn_mask=mask, is_causal=mask is None, enable_gqa=heads != kv_heads)
    got = _grads(lambda *t: masked_attention(*masked_call(*t, **kwargs)), q, k, v, w)
    want = _grads(lambda *t: F.scaled_dot_product_attention(*t, **kwargs), q, k, v, w)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_is_a_well_formed_custom_op():
    q, k, v, _ = _inputs()
    for t in (q, k, v):
        t.requires_grad_()
    result = torch.library.opcheck(masked_attention, masked_call(q, k, v, is_causal=True, enable_gqa=True))
    assert all(v == "SUCCESS" for v in result.values()), result


def test_calls_it_cannot_compute_exactly_stay_with_sdpa():
    q, k, v, _ = _inputs(heads=4, kv_heads=4)
    mask = torch.ones(11, 11, dtype=torch.bool)
    assert masked_call(q, k, v, dropout_p=0.1) is None
    assert masked_call(q, k, v, attn_mask=torch.zeros(11, 11, requires_grad=True)) is None  # a learned bias
    assert masked_call(q, k, v, attn_mask=mask, is_causal=True) is None  # SDPA refuses both
    assert masked_call(q[0], k[0], v[0]) is None  # [H, T, d]
    assert masked_call(q, k[:, :3], v[:, :3], enable_gqa=True) is None  # 4 heads do not group over 3
    assert masked_call(q, k[:, :2], v[:, :2]) is None  # grouped without enable_gqa: SDPA raises
    q, k, v, mask, scale, causal = masked_call(q, k, v, attn_mask=mask, scale=0.5)
    assert mask.shape == (1, 1, 11, 11) and scale == 0.5 and not causal  # broadcast from the right, as SDPA reads it


def test_the_tracer_keeps_attention_whole_for_our_gpt_and_a_hugging_face_model():
    from hotswitch.compiler.trace import trace
    from hotswitch.models import build_hf_model, build_model

    ids = torch.randint(0, 97, (2, 12))
    for model in (build_model("gpt-tiny", vocab_size=97), build_hf_model("llama", vocab_size=97)):
        logic = trace(model, (ids, ids.roll(-1, dims=1)))
        targets = [str(n.target) for n in logic.joint.graph.nodes if n.op == "call_function"]
        layers = 2
        assert targets.count("hotswitch.masked_attention.default") == layers, type(model).__name__
        assert targets.count("hotswitch.masked_attention_backward.default") == layers
        assert "aten._softmax.default" not in targets  # no T x T scores (the loss's is a log_softmax)


@pytest.mark.parametrize("cut", ["queries", "heads", "batch"])
def test_the_sharding_rule_is_exact_shard_by_shard(cut):
    """What DTensor does with the rule, by hand on two shards: the op on each shard, the outputs
    concatenated (gradients of keys and values summed where the queries were cut)."""
    q, k, v, w = _inputs(b=2, heads=4, kv_heads=2, t=12)
    mask = _masks(2, 12)["boolean [B,1,T,T]"]
    kwargs = dict(attn_mask=mask, enable_gqa=True)
    want = _grads(lambda *t: F.scaled_dot_product_attention(*t, **kwargs), q, k, v, w)
    dim = {"queries": 2, "heads": 1, "batch": 0}[cut]
    mask_dim = {"queries": 2, "heads": None, "batch": 0}[cut]  # the mask's one head broadcasts
    parts = []
    for i in range(2):
        def chunk(t, d=dim):
            return t.chunk(2, d)[i] if d is not None else t
        qi, wi = chunk(q), chunk(w)
        ki, vi = (chunk(k), chunk(v)) if cut != "queries" else (k, v)
        mi = chunk(mask, mask_dim)
        parts.append(_grads(lambda *t: masked_attention(*t, mi, 8 ** -0.5, False), qi, ki, vi, wi))
    out, dq = (torch.cat([p[j] for p in parts], dim) for j in (0, 1))
    if cut == "queries":
        dk, dv = parts[0][2] + parts[1][2], parts[0][3] + parts[1][3]
    else:
        dk, dv = (torch.cat([p[j] for p in parts], dim) for j in (2, 3))
    for a, b in zip((out, dq, dk, dv), want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_causal_call_on_a_shard_of_the_queries_reads_its_mask_rows():
    """`causal` lets a rank holding every query run torch's causal kernel without the mask; a rank
    holding a shard of the queries (context parallelism: fewer queries than keys) must read its rows
    of the mask, since torch's `is_causal` would align them to the first keys."""
    q, k, v, w = _inputs(b=1, heads=4, kv_heads=2, t=12)
    call = masked_call(q, k, v, is_causal=True, enable_gqa=True)
    mask, scale = call[3], call[4]
    want = _grads(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True, enable_gqa=True), q, k, v, w)
    rows = slice(6, 12)  # the second of two query shards
    got = _grads(lambda q_, k_, v_: masked_attention(q_, k_, v_, mask[:, :, rows], scale, True),
                 q[:, :, rows], k, v, w[:, :, rows])
    torch.testing.assert_close(got[0], want[0][:, :, rows], atol=1e-5, rtol=1e-5)


def _joint_program(q, k, v, mask, scale, causal):
    """A program as lowering leaves one: the op's forward and, further on, its backward."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def joint(q, k, v, mask, grad):
        out = masked_attention(q, k, v, mask, scale, causal)
        dq, dk, dv = masked_attention_backward(grad * 2, q, k, v, mask, scale, causal)
        return out.sin(), dq, dk, dv

    return make_fx(joint)(q, k, v, mask, torch.randn_like(q))


_CASES = {  # heads, kv heads, keys, queries (fewer: a context-parallel rank's shard), mask, dtype
    "causal": (4, 4, 12, 12, "causal", torch.float32),
    "causal, grouped": (4, 2, 12, 12, "causal", torch.float32),
    "causal, a shard of the queries": (4, 2, 12, 6, "causal", torch.float32),
    "boolean [B,1,T,T], grouped": (4, 2, 13, 13, "boolean", torch.float32),
    "additive [1,1,T,T]": (4, 4, 13, 13, "additive", torch.float32),
    "boolean, bf16": (4, 2, 16, 16, "boolean", torch.bfloat16),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_fused_kernels_replace_the_op_with_torchs_kernel_and_its_backward(case):
    from hotswitch.compiler.attention import fused_kernels
    from hotswitch.runtime.backend import GraphRunner

    heads, kv_heads, keys, queries, kind, dtype = _CASES[case]
    q, k, v, _ = _inputs(b=2, heads=heads, kv_heads=kv_heads, t=keys)
    q, k, v = q[:, :, keys - queries:].to(dtype), k.to(dtype), v.to(dtype)
    if kind == "causal":
        causal_mask = masked_call(torch.empty(2, heads, keys, 8), k, v, is_causal=True, enable_gqa=True)[3]
        mask = causal_mask[:, :, keys - queries:]
    elif kind == "boolean":
        mask = _masks(2, keys)["boolean [B,1,T,T]"]
    else:
        mask = _masks(2, keys)["additive [T,T]"][None, None].to(dtype)
    program = _joint_program(q, k, v, mask, 8 ** -0.5, kind == "causal")
    fused = fused_kernels(program, torch.device("cpu"))
    targets = [str(n.target) for n in fused.graph.nodes if n.op == "call_function"]
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in targets
    assert "aten._scaled_dot_product_flash_attention_for_cpu_backward.default" in targets
    assert not any(t.startswith("hotswitch.") for t in targets), targets  # no forward recomputed
    grad = torch.randn_like(q)
    want, got = program(q, k, v, mask, grad), fused(q, k, v, mask, grad)
    tol = dict(atol=1e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-6)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.is_contiguous()
        torch.testing.assert_close(a, b, **tol)
    runner = GraphRunner("eager", device="cpu")  # what the runtime runs: the fused program, made once
    run = runner(program)
    assert runner(program) is run and [n.target for n in run.graph.nodes] == [n.target for n in fused.graph.nodes]


def test_fused_kernels_leave_the_op_where_sdpa_takes_its_math_path_and_pair_only_what_they_see():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hotswitch.compiler.attention import fused_kernels

    q, k, v, _ = _inputs(b=2, heads=4, kv_heads=2, t=12)
    mask = _masks(2, 12)["boolean [B,1,T,T]"]
    program = _joint_program(q, k, v, mask, 0.3, False)
    with sdpa_kernel(SDPBackend.MATH):
        assert fused_kernels(program, torch.device("cpu")) is program

    from torch.fx.experimental.proxy_tensor import make_fx

    def forward_only(q, k, v, mask):  # a pipeline stage's forward program: its backward runs elsewhere
        return masked_attention(q, k, v, mask, 0.3, False)

    def backward_only(grad, q, k, v, mask):  # ... and that backward program: no logsumexp to read, the op stays
        return masked_attention_backward(grad, q, k, v, mask, 0.3, False)

    forward = fused_kernels(make_fx(forward_only)(q, k, v, mask), torch.device("cpu"))
    assert [str(n.target) for n in forward.graph.nodes if "attention" in str(n.target)] == \
        ["aten._scaled_dot_product_flash_attention_for_cpu.default"]
    torch.testing.assert_close(forward(q, k, v, mask), masked_attention(q, k, v, mask, 0.3, False))
    backward = make_fx(backward_only)(torch.randn_like(q), q, k, v, mask)
    assert fused_kernels(backward, torch.device("cpu")) is backward


def test_a_fused_kernel_says_what_it_was_chosen_from_and_a_fit_keeps_it_only_where_sdpa_would_choose_it():
    """`fuse_attention` marks each forward kernel with its choice (`FusedSite`); `kernels_hold` asks
    SDPA again for a program's current values: the same kernel at a length written from a fit, another
    where SDPA takes another path (here its math path, by its backend flags)."""
    from dataclasses import replace

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hotswitch.compiler.attention import FusedSite, fused_kernels, kernels_hold
    from hotswitch.compiler.lengths import fit

    def fused_at(t):
        q, k, v, _ = _inputs(b=2, heads=4, kv_heads=2, t=t)
        causal_mask = masked_call(torch.empty(2, 4, t, 8), k, v, is_causal=True, enable_gqa=True)[3]
        return fused_kernels(_joint_program(q, k, v, causal_mask, 8 ** -0.5, True), torch.device("cpu"))

    def hold(graph):  # kernels_hold over a graph's own sites and values
        by_name = {n.name: n for n in graph.nodes}
        return kernels_hold([n.meta["sdpa"] for n in graph.nodes if "sdpa" in n.meta],
                            lambda name: by_name[name].meta["val"] if name in by_name else None)

    a, b = fused_at(12), fused_at(16)
    sites = [n.meta["sdpa"] for n in a.graph.nodes if "sdpa" in n.meta]
    assert sites == [FusedSite("q_1", "k_1", "mask_1", 8 ** -0.5, True, True, "cpu", "flash", True, False)]
    assert hold(a.graph) is None
    fitted = fit(a, 12, b, 16)
    at_20 = fitted.at(20)
    assert fitted.kernels_hold(20) is None and hold(at_20.graph) is None
    q, k, v, _ = _inputs(b=2, heads=4, kv_heads=2, t=20)
    mask = masked_call(torch.empty(2, 4, 20, 8), k, v, is_causal=True, enable_gqa=True)[3]
    grad = torch.randn_like(q)
    for got, want in zip(at_20(q, k, v, mask, grad), fused_at(20)(q, k, v, mask, grad)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    with sdpa_kernel(SDPBackend.MATH):
        for reason in (fitted.kernels_hold(20), hold(at_20.graph)):
            assert "takes SDPA's math kernel (causal) here, not the flash kernel (causal) of" in reason
    node = next(n for n in at_20.graph.nodes if "sdpa" in n.meta)
    node.meta["sdpa"] = replace(node.meta["sdpa"], whole=False)  # as if chosen for a shard of the queries
    assert "flash kernel (causal) here, not the flash kernel (masked) of" in hold(at_20.graph)
