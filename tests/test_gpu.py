"""On a CUDA machine: one NCCL process compiles and trains as one device does. The ExecGraph (eager
and Inductor, which emits Triton there) gives one device's loss and gradients in fp32; the bf16
Trainer (bf16 compute, fp32 masters and AdamW) tracks fp32 single-device AdamW within bf16's
precision. Without CUDA the module is skipped: CPU paths are tested everywhere else (gloo)."""
import copy

import pytest
import torch
import torch.nn.functional as F

import hotswitch as hs
from tests.compile_checks import batch, make_model, rel_err
from tests.test_trainer_world4 import LR, _reference_steps

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL, bf16, Triton on the device)"),
    pytest.mark.slow,
]


def _compiled_vs_one_device(rank, kind, backend):
    """Rank 0 of 1 on NCCL: loss and full gradients of `kind` under dp1 against the model on the same GPU."""
    import torch.distributed as dist

    assert dist.get_backend() == "nccl"
    model = make_model(kind)
    ids, labels = batch()
    ref = copy.deepcopy(model).cuda()
    loss_ref = ref(ids.cuda(), labels.cuda())
    loss_ref.backward()
    cm = hs.compile(model, (ids, labels), configs=["dp1"], backend=backend)
    loss = cm.forward_backward(*cm.shard_inputs(ids, labels))
    grads = cm.full_grads()
    devices = {str(p.device) for p in cm.local_params.values()}
    worst = max(rel_err(grads[n].cuda(), p.grad) for n, p in ref.named_parameters())
    return dict(loss=float(loss), ref=float(loss_ref), grads=worst, devices=devices)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_nccl_rank_equals_one_device(kind, backend):
    out = hs.launch(_compiled_vs_one_device, 1, kind, backend, backend="nccl")
    assert out["devices"] == {"cuda:0"}, out
    assert abs(out["loss"] - out["ref"]) <= 1e-5 * abs(out["ref"]), out
    assert out["grads"] <= 1e-4, out  # fp32 on the GPU: other kernels, other summation orders


def _bf16_trainer(rank, batches):
    from hotswitch.train.trainer import Trainer

    # one bucket at the traced length: on torch 2.11 (the GPU image's) the trace specializes the causal
    # mask of `scaled_dot_product_attention(is_causal=True)` to that length (2.13 keeps it symbolic)
    trainer = Trainer(make_model("gpt"), ["name=dp1,dp=1"], dict(name="adamw", lr=LR), buckets=[64],
                      length_multiple=64, micro_batch_tokens=128, compute_dtype=torch.bfloat16)
    out = []
    for seqs in batches:
        report = trainer.step(seqs)
        out.append(dict(loss=report.loss, weights={k: v.cpu() for k, v in trainer.full_state_dict().items()},
                        compute_dtypes={str(v.dtype) for v in trainer.cm.local_params.values()},
                        master_dtypes={str(v.dtype) for v in trainer.full_state_dict().values()}))
    return out


def test_bf16_trainer_on_nccl_tracks_fp32_adamw():
    from hotswitch.train import data as D

    batches = [D.synthetic_skewed(12, 1001, 64, seed=s, min_length=2) for s in range(3)]
    ref = _reference_steps(make_model("gpt"), batches)  # single-device AdamW at the Trainer's LR
    steps = hs.launch(_bf16_trainer, 1, batches, backend="nccl")
    for (ref_loss, _, ref_weights), step in zip(ref, steps):
        assert step["compute_dtypes"] == {"torch.bfloat16"} and step["master_dtypes"] == {"torch.float32"}, step
        assert abs(step["loss"] - ref_loss) <= 2e-2 * abs(ref_loss), (step["loss"], ref_loss)
        assert max(rel_err(step["weights"][k], v) for k, v in ref_weights.items()) <= 1e-2


def test_masked_attention_runs_a_fused_kernel_in_bf16():
    """The op's forward and backward on CUDA in bf16 track an fp32 reference (the math form on the same
    GPU), and its peak memory is that of a fused kernel: far below the [B, H, T, T] scores."""
    from hotswitch.kernels.attention import masked_attention, masked_call

    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, kv, t, d = 2, 16, 4, 2048, 64
    q = torch.randn(b, h, t, d, device="cuda", generator=g)
    k, v = (torch.randn(b, kv, t, d, device="cuda", generator=g) for _ in range(2))
    w = torch.randn(b, h, t, d, device="cuda", generator=g)

    def grads(fn, dtype):
        leaves = [x.to(dtype).detach().requires_grad_() for x in (q, k, v)]
        y = fn(*leaves)
        (y * w.to(dtype)).sum().backward()
        return [y.float(), *(x.grad.float() for x in leaves)]

    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        want = grads(lambda *x: F.scaled_dot_product_attention(*x, is_causal=True, enable_gqa=True), torch.float32)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    got = grads(lambda *x: masked_attention(*masked_call(*x, is_causal=True, enable_gqa=True)), torch.bfloat16)
    extra = torch.cuda.max_memory_allocated() - before
    for a, r in zip(got, want):
        assert rel_err(a, r) <= 2e-2, rel_err(a, r)
    assert extra < b * h * t * t * 2, extra  # not even one bf16 copy of the scores


@pytest.mark.parametrize("kernel", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"])
@pytest.mark.parametrize("case", ["causal", "causal, a shard of the queries", "boolean, keys not 8-aligned"])
def test_fused_kernels_on_cuda_equal_the_op(kernel, case):
    """Each of torch's CUDA kernels that `fused_kernels` writes (SDPA restricted to it), forward and
    its own backward in bf16, equal to the op's program (the op's forward recomputed under autograd)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hotswitch.compiler.attention import fused_kernels
    from hotswitch.kernels.attention import masked_attention, masked_attention_backward, masked_call

    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, kv, d = 2, 8, 2, 64
    keys = 100 if case.startswith("boolean") else 128
    queries = keys // 2 if "shard" in case else keys
    q = torch.randn(b, h, queries, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(b, kv, keys, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    grad = torch.randn_like(q)
    causal = case.startswith("causal")
    if causal:
        mask = masked_call(q.new_empty(b, h, keys, d), k, v, is_causal=True, enable_gqa=True)[3][:, :, keys - queries:]
    else:
        mask = torch.rand(b, 1, queries, keys, device="cuda", generator=g) > 0.3
        mask[..., 0] = True

    def joint(q, k, v, mask, grad):
        out = masked_attention(q, k, v, mask, d ** -0.5, causal)
        return (out, *masked_attention_backward(grad, q, k, v, mask, d ** -0.5, causal))

    program = make_fx(joint)(q, k, v, mask, grad)
    want = program(q, k, v, mask, grad)
    whole = causal and queries == keys  # the causal kernel, no mask read
    with sdpa_kernel(getattr(SDPBackend, kernel)):
        fused = fused_kernels(program, torch.device("cuda"))
    if kernel == "FLASH_ATTENTION" and not whole:
        assert fused is program  # flash reads no mask: the op stays (unrestricted, SDPA picks another kernel)
        return
    if fused is program:  # kept only where torch has no such kernel (cuDNN attention is off in some builds)
        kr, vr = (x.repeat_interleave(h // kv, 1) for x in (k, v))
        with sdpa_kernel(getattr(SDPBackend, kernel)), pytest.raises(RuntimeError):
            F.scaled_dot_product_attention(q, kr, vr, attn_mask=None if whole else mask, is_causal=whole)
        return
    targets = [str(n.target) for n in fused.graph.nodes if n.op == "call_function"]
    assert not any(t.startswith("hotswitch.") for t in targets), targets
    got = fused(q, k, v, mask, grad)
    for a, r in zip(got, want):
        assert a.shape == r.shape and a.is_contiguous()
        assert rel_err(a.float(), r.float()) <= 2e-2, (kernel, case, rel_err(a.float(), r.float()))
