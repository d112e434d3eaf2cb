"""The lowering's shape oracle (`compiler.propagate.meta_run`): meta kernels, memoized by op and input
shapes; pure, no process group."""
import torch

from hotswitch.compiler.propagate import meta_run

aten = torch.ops.aten


def _same(meta, real):
    assert meta.device.type == "meta"
    assert (meta.shape, meta.stride(), meta.dtype) == (real.shape, real.stride(), real.dtype)


def test_meta_results_equal_real_ones_and_the_memo_tells_scalars_apart():
    ints = torch.arange(6).view(2, 3)
    for scalar in (1, 1.0, True, 1, 1.0):  # repeated: the second time comes from the memo
        _same(meta_run(aten.add.Tensor, (ints, scalar), {}), aten.add.Tensor(ints, scalar))
    x = torch.randn(4, 6)
    _same(meta_run(aten.t.default, (x,), {}), x.t())  # strides of a view
    _same(meta_run(aten.view.default, (x, [2, 12]), {}), x.view(2, 12))
    _same(meta_run(aten.view.default, (x, [24]), {}), x.view(24))  # same input, other argument
    _same(meta_run(aten.mm.default, (x, x.t()), {}), x @ x.t())


def test_factory_ops_run_on_the_meta_device():
    out = meta_run(aten.full.default, ([3, 5], 0.5), {"dtype": torch.float16, "device": torch.device("cpu")})
    _same(out, torch.full([3, 5], 0.5, dtype=torch.float16))


def test_multi_output_ops_give_every_output():
    x = torch.randn(2, 3, 8)
    w, b = torch.randn(8), torch.randn(8)
    metas = meta_run(aten.native_layer_norm.default, (x, [8], w, b, 1e-5), {})
    for meta, real in zip(metas, aten.native_layer_norm.default(x, [8], w, b, 1e-5)):
        _same(meta, real)
