"""Cutting a LogicGraph into pipeline stages, single process: balance, what crosses a boundary, and
stage graphs that chain back into the model's loss and gradients."""
import pytest
import torch

from hotswitch.compiler.stages import balanced_split, split_forward_backward, split_stages, stage_joint
from hotswitch.compiler.trace import trace
from hotswitch.models import build_model
from tests.compile_checks import batch, reference, rel_err


def test_balanced_split_minimizes_the_largest_stage_then_evens_out():
    assert balanced_split([1, 1, 1, 1], 2) == ((0, 2), (2, 4))
    assert balanced_split([5, 1, 1, 1, 1, 1], 2) == ((0, 1), (1, 6))  # a heavy first block stands alone
    assert balanced_split([1, 2, 3], 3) == ((0, 1), (1, 2), (2, 3))
    assert balanced_split([3, 1, 1, 1], 2) == ((0, 1), (1, 4))  # 3|3 rather than 4|2
    assert balanced_split([1, 1, 1, 1, 1], 1) == ((0, 5),)


@pytest.fixture(scope="module")
def four_layers():
    torch.manual_seed(0)
    model = build_model("gpt-tiny", vocab_size=1001, n_layers=4)
    ids, labels = batch()
    return model, trace(model, (ids, labels)), (ids, labels)


def _run_chain(logic, split, model, ids, labels):
    """Forward stage by stage, then backward stage by stage with the stage joint graphs."""
    params = dict(model.named_parameters())
    buffers = [b for _, b in model.named_buffers()]
    acts, saved = [], []
    for st in split.stages:
        saved.append(acts)
        outs = st.forward(*[params[n].detach() for n in st.param_names], *buffers, ids, labels, *acts)
        acts = list(outs[:len(st.acts_out)])
    num, den = outs
    grads, grads_out = {}, []
    for st in reversed(split.stages):
        outs = stage_joint(logic, st)([params[n].detach() for n in st.param_names], buffers, [ids, labels],
                                      saved[st.index], grads_out)
        first = 2 if st.is_last else len(st.acts_out) + 1
        grads.update({n: g / den for n, g in zip(st.param_names, outs[first:first + st.num_params])})
        grads_out = list(outs[first + st.num_params:])
    return num / den, grads


@pytest.mark.parametrize("pp", [2, 4])
def test_stages_chain_into_the_model(four_layers, pp):
    model, logic, (ids, labels) = four_layers
    split = split_stages(logic, pp)
    assert [b for st in split.stages for b in st.blocks] == [f"layers.{i}" for i in range(4)]
    assert all(st.blocks for st in split.stages) and pytest.approx(sum(st.cost for st in split.stages)) == 1.0
    owners = [n for st in split.stages for n in st.param_names]
    assert sorted(owners) == sorted(logic.param_names)  # each parameter in exactly one stage
    assert "embed.weight" in split.stages[0].param_names and "lm_head.weight" in split.stages[-1].param_names
    for a, b in zip(split.stages, split.stages[1:]):
        assert a.acts_out == b.acts_in and len(a.acts_out) == 1  # only the residual stream crosses
    assert split.stages[0].acts_in == [] and split.stages[-1].acts_out == []
    loss_ref, grads_ref = reference(model, ids, labels)
    loss, grads = _run_chain(logic, split, model, ids, labels)
    assert abs(loss.item() - loss_ref.item()) < 1e-6 * loss_ref.item()
    assert max(rel_err(grads[n], grads_ref[n]) for n in grads_ref) < 1e-5


def test_forward_backward_cut_reproduces_the_joint_graph(four_layers):
    model, logic, (ids, labels) = four_layers
    st = split_stages(logic, 2).stages[0]
    joint = stage_joint(logic, st)
    params = dict(model.named_parameters())
    args = [params[n].detach() for n in st.param_names] + [ids, labels]
    seed = torch.randn(ids.shape[0], ids.shape[1], 64)
    expected = joint([a for a in args[:st.num_params]], [], [ids, labels], [], [seed])
    n_fwd = len(st.acts_out) + 1
    fwd, bwd, n_saved = split_forward_backward(joint, 1, tuple(range(n_fwd)))
    outs = fwd(*args)
    back = bwd(*outs[n_fwd:], seed)
    assert len(outs) == n_fwd + n_saved
    got = list(outs[:n_fwd]) + list(back)
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


def test_tied_weights_get_a_copy_per_stage_and_too_many_stages_are_refused():
    torch.manual_seed(0)
    model = build_model("gpt-tiny", vocab_size=1001, tie_embeddings=True)  # 2 blocks, lm_head = embed
    ids, labels = batch()
    logic = trace(model, (ids, labels))
    with pytest.raises(ValueError, match="pp <= 2"):
        split_stages(logic, 3)
    split = split_stages(logic, 2)
    assert split.shared == {"embed.weight": (0, 1)}  # Megatron: the first and the last stage keep a copy
    assert all("embed.weight" in st.param_names for st in split.stages)
    loss_ref, grads_ref = reference(model, ids, labels)
    params = dict(model.named_parameters())
    buffers = [b for _, b in model.named_buffers()]
    first, last = split.stages
    (act, den), = [first.forward(*[params[n].detach() for n in first.param_names], *buffers, ids, labels)[:2]]
    outs = stage_joint(logic, last)([params[n].detach() for n in last.param_names], buffers, [ids, labels], [act], [])
    num, den = outs[:2]
    grads_last = dict(zip(last.param_names, outs[2:2 + last.num_params]))
    grad_act = outs[2 + last.num_params:]
    outs = stage_joint(logic, first)(
        [params[n].detach() for n in first.param_names], buffers, [ids, labels], [], grad_act
    )
    grads_first = dict(zip(first.param_names, outs[2:2 + first.num_params]))
    assert abs((num / den).item() - loss_ref.item()) < 1e-6 * loss_ref.item()
    tied = (grads_first["embed.weight"] + grads_last["embed.weight"]) / den  # the sum of the copies' parts
    assert rel_err(tied, grads_ref["embed.weight"]) < 1e-5
