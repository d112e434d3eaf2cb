"""pack / unpack: Triton against the torch fallback, bit for bit: through the interpreter on CPU, and
compiled for the GPU where CUDA is (tests/conftest.py picks which).

bf16 needs the GPU test (the interpreter gives bf16 garbage).
"""

import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hotswitch.kernels import HAS_TRITON, INTERPRET, cast, pack, pack_kernels, packed_numel, unpack

# Triton is a required package on Linux (pyproject.toml): there, without it, these tests fail
# (backend='triton' names the problem). They are left out where Triton does not ship (not Linux),
# and on a CUDA machine, where the kernels are compiled for the GPU instead of interpreted
# (tests/conftest.py) and test_gpu_kernels_native_bit_exact runs them.
needs_interpreter = pytest.mark.skipif(
    not INTERPRET or (not HAS_TRITON and sys.platform != "linux"),
    reason="Triton on CPU tensors needs TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU) and Triton "
           "(Linux only)",
)
FLOATS = (torch.float32, torch.float16)


def test_triton_is_installed_on_linux():
    assert HAS_TRITON or sys.platform != "linux", "triton is a required package on Linux: pip install -e . installs it"


def reference_pack(slices, dtype):
    return torch.cat([t[s].reshape(-1).to(dtype) for t, s in slices]) if slices else torch.empty(0, dtype=dtype)


@st.composite
def sliced_tensors(draw, dtypes=FLOATS):
    """A tensor (maybe a transposed/permuted view: non-contiguous) and a tuple of strided slices."""
    ndim = draw(st.integers(1, 4))
    shape = [draw(st.integers(1, 6)) for _ in range(ndim)]
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**31 - 1))
    base = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    perm = draw(st.permutations(range(ndim)))
    tensor = base.permute(*perm)
    index = []
    for n in tensor.shape:
        start = draw(st.integers(0, n))
        stop = draw(st.integers(start, n))
        index.append(slice(start, stop, draw(st.integers(1, 3))))
    return tensor, tuple(index)


# ---------------------------------------------------------------- triton == torch == reference


@needs_interpreter
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(sliced_tensors(), min_size=1, max_size=4), st.sampled_from(FLOATS))
def test_pack_matches_torch_bit_exact(slices, dtype):
    want = reference_pack(slices, dtype)
    got = pack(slices, dtype=dtype, backend="triton")
    fallback = pack(slices, dtype=dtype, backend="torch")
    assert got.dtype == dtype and got.shape == (packed_numel(slices),)
    assert torch.equal(got.view(torch.int16 if dtype == torch.float16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.float16 else torch.int32))
    assert torch.equal(fallback, want)


@needs_interpreter
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(sliced_tensors(), min_size=1, max_size=4), st.sampled_from(FLOATS), st.booleans())
def test_unpack_matches_torch_bit_exact(slices, buf_dtype, accumulate):
    buf = reference_pack(slices, buf_dtype)
    results = {}
    for backend in ("triton", "torch"):
        # targets: fresh tensors shaped like each source (same strides pattern: permuted views), prefilled
        targets = []
        for t, s in slices:
            target = torch.linspace(-3, 3, t.numel()).reshape(t.shape).to(t.dtype)
            targets.append((target, s))
        unpack(buf, targets, accumulate=accumulate, backend=backend)
        results[backend] = [t for t, _ in targets]
    for a, b, (t, s) in zip(results["triton"], results["torch"], slices):
        assert torch.equal(a, b)
        untouched = torch.ones_like(a, dtype=torch.bool)
        untouched[s] = False
        fresh = torch.linspace(-3, 3, t.numel()).reshape(t.shape).to(t.dtype)
        assert torch.equal(a[untouched], fresh[untouched])  # outside the slice nothing changed
    if not accumulate:  # the written region holds the (cast) source
        offset = 0
        for a, (t, s) in zip(results["torch"], slices):
            n = t[s].numel()
            assert torch.equal(a[s].reshape(-1), buf[offset:offset + n].to(t.dtype))
            offset += n


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_round_trip_with_casts(backend):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 6, generator=g)
    grads = torch.randn(6, 8, generator=g).t()  # non-contiguous
    slices = [(w, (slice(2, 6), slice(1, 5))), (grads, (slice(0, 8, 3), slice(None))), (w, (slice(0, 0), slice(None)))]
    half = pack(slices, dtype=torch.float16, backend=backend)  # fused fp32 -> fp16
    assert torch.equal(half, reference_pack(slices, torch.float16))
    w2, g2 = torch.zeros_like(w), torch.zeros(6, 8).t()
    unpack(half, [(w2, slices[0][1]), (g2, slices[1][1]), (w2, slices[2][1])], backend=backend)  # fp16 -> fp32
    assert torch.equal(w2[2:6, 1:5], w[2:6, 1:5].half().float())
    assert torch.equal(g2[0:8:3], grads[0:8:3].half().float())
    assert w2.sum() == w2[2:6, 1:5].sum()  # nothing else written
    # fused accumulate: gradient buffers add what arrives
    unpack(half, [(w2, slices[0][1]), (g2, slices[1][1]), (w2, slices[2][1])], accumulate=True, backend=backend)
    assert torch.equal(w2[2:6, 1:5], w[2:6, 1:5].half().float() * 2)


@needs_interpreter
def test_empty_and_out_and_merged_dims():
    a = torch.arange(2 * 3 * 2 * 2 * 3, dtype=torch.float32).reshape(2, 3, 2, 2, 3)
    # 5 dims that merge into one (a contiguous block) are fine; empty slices contribute nothing
    slices = [(a, ()), (a, (slice(1, 1),)), (a[0, 0], (slice(None), slice(None), slice(0, 3, 2)))]
    out = torch.full((packed_numel(slices),), -1.0)
    assert pack(slices, out=out, backend="triton") is out
    assert torch.equal(out, reference_pack(slices, torch.float32))
    assert pack([], backend="triton").numel() == 0
    unpack(torch.empty(0), [], backend="triton")
    scalar = torch.tensor(3.5)
    assert torch.equal(pack([(scalar, ())], backend="triton"), torch.tensor([3.5]))
    # 5 dims that stay 5 dims: too many for the kernel
    b = torch.zeros(3, 3, 3, 3, 3)
    with pytest.raises(ValueError, match="split it into"):
        pack([(b, (slice(None, None, 2),) * 5)], backend="triton")


def test_errors():
    a = torch.zeros(4)
    with pytest.raises(ValueError, match="pass dtype="):
        pack([(a, (slice(0, 2),)), (a.half(), (slice(0, 2),))], backend="torch")
    with pytest.raises(ValueError, match="contiguous 1-D tensor of 2 elements"):
        pack([(a, (slice(0, 2),))], out=torch.zeros(3), backend="torch")
    with pytest.raises(ValueError, match="must match"):
        unpack(torch.zeros(3), [(a, (slice(0, 2),))], backend="torch")
    with pytest.raises(ValueError, match="backend must be"):
        pack([(a, ())], backend="cuda")
    with pytest.raises(ValueError, match="does not give a view"):
        pack([(a, ([0, 2],))], backend="torch")
    with pytest.raises(ValueError, match=r"\(tensor, tuple of slices\) pair"):
        pack([a], backend="torch")


def test_auto_backend_on_cpu_matches():
    a = torch.randn(5, 5)
    slices = [(a.t(), (slice(1, 4), slice(0, 5, 2)))]
    assert torch.equal(pack(slices), reference_pack(slices, torch.float32))


# ---------------------------------------------------------------- GPU only


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                    reason="needs a CUDA GPU and the kernels compiled for it (TRITON_INTERPRET unset or 0)")
def test_gpu_kernels_native_bit_exact():
    """Compiled for the GPU (tests/conftest.py leaves the interpreter off where CUDA is): bf16/fp16/fp32
    casts, accumulate, and a switch-sized gather of 4096 strided slices, each equal to the torch
    fallback. Bandwidth is `hotswitch bench gpu`'s job."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(512, 384, device=dev, generator=g)
    # disjoint regions of one tensor (unpack's targets must not overlap: programs run concurrently on a GPU)
    slices = [(w, (slice(0, 256), slice(0, 384, 3))), (w.t(), (slice(10, 200), slice(256, 512)))]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert torch.equal(pack(slices, dtype=dtype, backend="triton"), pack(slices, dtype=dtype, backend="torch"))
        assert torch.equal(pack(slices, dtype=dtype, backend="triton"), reference_pack(slices, dtype))
    buf = pack(slices, dtype=torch.bfloat16, backend="triton")
    for accumulate in (False, True):
        outs = {}
        for backend in ("triton", "torch"):
            t = torch.ones(512, 384, device=dev, dtype=torch.float32)  # fp32 accumulators, bf16 wire
            unpack(buf, [(t, slices[0][1]), (t.t(), slices[1][1])], accumulate=accumulate, backend=backend)
            outs[backend] = t
        assert torch.equal(outs["triton"], outs["torch"])

    big = torch.randn(8192, 1024, device=dev, dtype=torch.bfloat16)
    many = [(big, (slice(2 * i, 2 * i + 1), slice(i % 7, 1024, 1 + i % 3))) for i in range(4096)]
    got = pack(many, backend="triton")
    assert torch.equal(got, reference_pack(many, torch.bfloat16))
    back = torch.zeros_like(big)
    unpack(got, [(back, s) for _, s in many], backend="triton")
    want = torch.zeros_like(big)
    for _, s in many:
        want[s] = big[s]
    assert torch.equal(back, want)

    rows = [(big, (slice(2 * i, 2 * i + 1), slice(None))) for i in range(4096)]  # 16-byte aligned: vectorized
    got = pack(rows, backend="triton")
    assert torch.equal(got, big[::2].reshape(-1))
    back.zero_()
    unpack(got, [(back, s) for _, s in rows], accumulate=True, backend="triton")
    assert torch.equal(back[::2], big[::2]) and not back[1::2].any()


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_cast_is_to_dtype_as_views_of_one_buffer(backend):
    """The Trainer's compute weights from fp32 masters: one fused cast, bit-identical to `.to()`."""
    g = torch.Generator().manual_seed(1)
    masters = {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g),
               "t": torch.randn(5, 6, generator=g).t()}  # a non-contiguous one too
    out = cast(masters, torch.float16, backend=backend)
    assert list(out) == list(masters)
    for n, t in masters.items():
        assert out[n].shape == t.shape and out[n].dtype == torch.float16
        assert torch.equal(out[n].view(torch.int16), t.to(torch.float16).view(torch.int16))
    assert len({o.untyped_storage().data_ptr() for o in out.values()}) == 1  # one buffer


@needs_interpreter
def test_pack_kernels_with_tables_built_once_equal_pack():
    a = torch.randn(6, 8)
    slices = [(a, (slice(0, 6, 2), slice(1, 7))), (a.t(), (slice(2, 5), slice(None)))]
    out = torch.zeros(packed_numel(slices))
    run = pack_kernels(slices, out)
    a.mul_(2)  # the tables hold addresses, not values: a later call packs what the tensors hold then
    run()
    assert torch.equal(out, reference_pack(slices, torch.float32))


@needs_interpreter
def test_tiles_cover_long_runs_aligned_rows_and_strided_columns():
    """One call, three launches: 16-byte aligned rows of 4096 (the launch told to vectorize), a run of
    4999 from an odd offset (two tiles per row, not aligned) and a transposed slice (innermost stride
    5000); the packed buffer and the round trip equal the reference."""
    from hotswitch.kernels.pack import _by_dtype, _plans

    a = torch.randn(3, 5000, generator=torch.Generator().manual_seed(3))
    slices = [(a, (slice(0, 3), slice(8, 4104))), (a, (slice(0, 1), slice(1, None))),
              (a.t(), (slice(4200, 4300), slice(0, 3)))]
    out = pack(slices, dtype=torch.float16, backend="triton")
    assert torch.equal(out, reference_pack(slices, torch.float16))
    plans = [p for views, offsets in _by_dtype([a[s] for a, s in slices]).values()
             for p in _plans(views, offsets, "slices", out)]
    assert {(p.rows, p.cols, p.align) for p in plans} == {(1, 4096, 1), (1, 4096, 4), (256, 16, 1)}
    back = torch.zeros(3, 5000)
    unpack(out, [(back, s) for _, s in slices[:2]] + [(back.t(), slices[2][1])], backend="triton")
    want = torch.zeros(3, 5000)
    want[:, 8:4104], want[0, 1:], want[:, 4200:4300] = a[:, 8:4104], a[0, 1:], a[:, 4200:4300]
    assert torch.equal(back, want.half().float())
    with pytest.raises(ValueError, match="do not handle torch.complex64; use backend='torch'"):
        pack([(torch.zeros(4, dtype=torch.complex64), ())], backend="triton")
