"""The joint graph stitched from regions (`compiler.regions`), single process: each distinct repeated
block traced once, and the stitched graph the one the whole-graph trace gives."""
import warnings
from collections import Counter

import pytest
import torch

import hotswitch.compiler.regions as R
import hotswitch.compiler.trace as T
from hotswitch.compiler.regions import block_of
from hotswitch.models import PackedCausalLMLoss, build_hf_model, build_model
from hotswitch.train.data import full_length_micro_batch

IDS = torch.randint(0, 1001, (3, 16), generator=torch.Generator().manual_seed(0))


def _case(which: str):
    torch.manual_seed(0)
    if which == "llama":  # 4 blocks, packed rows (a document mask, positions): what the Trainer compiles
        return PackedCausalLMLoss(build_hf_model("llama", num_hidden_layers=4).model), full_length_micro_batch(2, 16)
    if which == "gpt2":  # the LM head tied to the token embedding: its gradient sums two regions' parts
        return build_hf_model("gpt2", n_layer=3), (IDS, IDS)
    return build_model("gpt-tiny", vocab_size=1001, n_layers=3), (IDS, IDS)


@pytest.fixture(scope="module")
def traces():
    """which -> the model traced twice, stitched from regions (and which regions were traced on their
    own) and as one graph, with the model's parameters, buffers and inputs to run the graphs on."""
    out = {}
    for which in ("llama", "gpt2", "ours"):
        model, inputs = _case(which)
        traced, trace_region = [], R._trace_region
        with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            mp.setattr(R, "_trace_region", lambda fwd, region, *a: traced.append(region.block) or  # noqa: B023
                       trace_region(fwd, region, *a))
            stitched = T.trace(model, inputs)
            # stitched, not traced whole after a region failed
            assert not [w for w in warned if "one region at a time" in str(w.message)], which
            mp.setattr(T, "stitched_joint", lambda *a, **k: None)
            whole = T.trace(model, inputs)
        state = {**dict(model.named_buffers()), **dict(model.named_parameters())}
        args = ([state[n].detach() for n in stitched.param_names],
                [state[n].detach() for n in stitched.buffer_names], list(stitched.call.flatten_example(inputs)))
        out[which] = stitched, whole, traced, args, (model, inputs)
    return out


@pytest.mark.parametrize("which", ["llama", "gpt2", "ours"])
def test_a_repeated_block_is_traced_once_and_the_stitched_graph_is_the_whole_ones(which, traces):
    stitched, whole, traced, args, _ = traces[which]
    blocks = sorted({block_of(n) for n in whole.forward.graph.nodes} - {None})
    assert len(blocks) == (4 if which == "llama" else 3)
    # the blocks' first copy, and the regions before and after them
    assert sum(b is not None for b in traced) == 1 and len(traced) == 3, traced
    assert stitched.param_names == whole.param_names
    got, expected = stitched.joint(*args), whole.joint(*args)
    assert len(got) == len(expected) == 2 + len(whole.param_names)
    for name, a, b in zip(["num", "den", *whole.param_names], got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0, msg=name)
    # the same ops, op for op; the stitched graph reads each size once per region, so it has fewer
    # size nodes, and CSE merges the zero fills of the blocks' backward that then read the same sizes
    ops = lambda lg: Counter(n.target for n in lg.joint.graph.nodes  # noqa: E731
                             if isinstance(n.target, torch._ops.OpOverload)
                             and n.target not in (torch.ops.aten.sym_size.int, torch.ops.aten.full.default))
    assert ops(stitched) == ops(whole)


def test_each_copied_block_carries_its_own_module_path(traces):
    """Pipeline stages and per-block collective counts read a node's block off its module path: a
    block's copy names its own, in the forward graph as in the whole-graph trace."""
    stitched, whole, *_ = traces["llama"]

    def per_block(lg):  # block -> its ops (sizes aside: the whole-graph trace reads them more often)
        ops: dict = {}
        for n in lg.forward.graph.nodes:
            if isinstance(n.target, torch._ops.OpOverload) and n.target is not torch.ops.aten.sym_size.int:
                ops.setdefault(block_of(n), Counter())[n.target] += 1
        return ops

    ops = per_block(stitched)
    assert [b for b in ops if b is not None] == [f"model.model.layers.{k}" for k in range(4)]
    assert ops == per_block(whole)
    assert ops["model.model.layers.1"] == ops["model.model.layers.3"]  # the first block shares CSE'd values
    # the module path as a whole, not only its block: each attention op names its own attention module
    paths = [list(n.meta["nn_module_stack"].values())[-1][0] for n in stitched.forward.graph.nodes
             if n.target is torch.ops.hotswitch.masked_attention.default]
    assert paths == [f"model.model.layers.{k}.self_attn" for k in range(4)]


def test_a_model_without_repeated_blocks_is_traced_as_one_graph(monkeypatch):
    """Nothing to reuse: no region is traced on its own (the whole-graph trace, as before)."""
    traced, trace_region = [], R._trace_region
    monkeypatch.setattr(R, "_trace_region", lambda *a: traced.append(1) or trace_region(*a))

    class TwoLinears(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x, y):
            return ((self.b(torch.relu(self.a(x))) - y) ** 2).mean()

    lg = T.trace(TwoLinears(), (torch.randn(3, 5, 8), torch.randn(3, 5, 8)))
    assert traced == [] and len(lg.param_names) == 4


def test_regions_cut_at_block_boundaries(traces):
    """Runs of one block's nodes; a node of no block inside a block's run (a size read mid-block)
    stays in it, so one block is one region."""
    regions = R.regions_of(traces["llama"][0].forward.graph)
    assert [r.block for r in regions] == [None, *[f"model.model.layers.{k}" for k in range(4)], None]
    for before, after in zip(regions, regions[1:]):
        assert set(after.inputs) & set(before.outputs)  # the residual stream crosses every boundary


def test_a_region_that_does_not_trace_on_its_own_falls_back_to_the_whole_graph(traces, monkeypatch):
    """Tracing by regions is an optimization: if a region fails, the compile warns and traces the
    whole graph, which gives the same LogicGraph."""
    def fails(*args):
        raise RuntimeError("a region this test cannot trace")

    monkeypatch.setattr(R, "_trace_region", fails)
    _, whole, _, _, (model, inputs) = traces["ours"]
    with pytest.warns(UserWarning, match="one region at a time failed .*a region this test cannot trace"):
        lg = T.trace(model, inputs)
    assert lg.joint.code == whole.joint.code


def test_pipeline_stages_are_stitched_like_the_model(traces, monkeypatch):
    """A pipeline stage's joint graph (its activations and their gradients in, theirs out) is traced
    by regions too: equal to the stage's whole-graph trace on real values, chained from stage 0. (In
    the LogicGraph the first block holds the values CSE merged for all blocks, so a stage with two
    blocks stitches only if it is not the first: stage 1 here.)"""
    from hotswitch.compiler.stages import split_stages, stage_joint

    lg, _, _, (params, buffers, inputs), _ = traces["llama"]
    split = split_stages(lg, 2)
    traced, trace_region = [], R._trace_region
    monkeypatch.setattr(R, "_trace_region", lambda *a: traced.append(1) or trace_region(*a))
    acts: list = []
    by_name = dict(zip(lg.param_names, params))
    for stage in split.stages:
        stitched = stage_joint(lg, stage)
        stage.joint = None
        with monkeypatch.context() as m:
            m.setattr(T, "stitched_joint", lambda *a, **k: None)
            whole = stage_joint(lg, stage)
        mine = [by_name[n] for n in stage.param_names]
        sent = stage.forward(*mine, *buffers, *inputs, *acts)[:len(stage.acts_out)]
        grads_out = [torch.randn_like(t) for t in sent if t.is_floating_point()]
        args = (mine, list(buffers), list(inputs), list(acts), grads_out)
        for a, b in zip(stitched(*args), whole(*args)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
        acts = list(sent)
    assert traced, "no stage was traced by regions"
