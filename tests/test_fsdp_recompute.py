"""FSDP (ZeRO-3) and activation recomputation as parts of a DistConfig, on 2 and 4 gloo processes:
equal to one device, FSDP2's collectives per block, switching to and from every other kind of config."""
from collections import Counter

import pytest
import torch

import hotswitch as hs
from hotswitch.compiler.lower import collectives
from hotswitch.compiler.memory import estimate_peak_bytes
from hotswitch.distconfig import parse_configs
from tests.compile_checks import _kind, assert_equivalent, batch, make_model, reference, rel_err
from tests.distributed import dist_fixture

pytestmark = pytest.mark.slow  # spawns gloo processes and compiles; `-m 'not slow'` leaves it out


def check_fsdp_gpt_equivalence():
    return assert_equivalent("gpt", parse_configs("fsdp4,fsdp2tp2sp-sel"), extra_seq=None)


def check_fsdp_llama_equivalence():
    return assert_equivalent("llama", parse_configs("fsdp2tp2sp-full"), extra_seq=None)


def check_fsdp_collectives_per_block():
    """Per block (an fsdp unit): one all-gather before its forward, one before its backward, one
    reduce-scatter of its gradients; each forward gather issued before the block ahead of it computes."""
    cm = hs.compile(make_model("gpt"), batch(), configs=parse_configs("fsdp4"))
    gm = cm.exec_graph("fsdp4")
    gathers = Counter((n.meta["custom"]["phase"], n.meta["custom"].get("unit")) for n in collectives(gm)
                      if _kind(n) == "all_gather")
    scatters = [n for n in collectives(gm) if _kind(n) == "reduce_scatter"]
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}

    def first_compute(unit):  # the first op that reads a value the unit's forward gather made
        gather = next(n for n in collectives(gm, "forward") if n.meta["custom"].get("unit") == unit
                      and _kind(n) == "all_gather")
        seen, stack = set(), [gather]
        while stack:
            n = stack.pop()
            for u in n.users:
                if u not in seen:
                    seen.add(u)
                    if u.meta.get("custom", {}).get("fsdp") != "gather":
                        yield position[u]
                    else:
                        stack.append(u)

    gather_of = {n.meta["custom"]["unit"]: position[n] for n in collectives(gm, "forward") if _kind(n) == "all_gather"}
    prefetched = gather_of["layers.1"] < min(first_compute("layers.0"))
    return dict(gathers), len(scatters), prefetched, sorted(Counter(_kind(n) for n in collectives(gm)).items())


def _step(cm, name, ids, labels):
    cm.switch(name)
    cm.zero_grad()
    loss = cm.forward_backward(*cm.shard_inputs(ids, labels))
    return loss.detach(), cm.full_grads()


def check_recompute_equals_keeping_activations():
    """Recomputation changes which values the backward reads, never the numbers (1e-6, bit-exact
    here), and lowers the program's peak of live intermediate values."""
    names = ["dp2tp2", "dp2tp2-sel", "dp2tp2-full"]
    model = make_model("llama", num_hidden_layers=3)  # activations, not the logits, make the peak
    ids, labels = batch(seq=48)
    cm = hs.compile(model, (ids, labels), configs=parse_configs(",".join(names)))
    out = {}
    for name in names:
        out[name] = _step(cm, name, ids, labels)
    worst = {}
    for name in names:
        base = name.split("-")[0]
        (loss, grads), (loss0, grads0) = out[name], out[base]
        worst[name] = max([abs(loss.item() - loss0.item()) / abs(loss0.item())]
                          + [rel_err(grads[n], grads0[n]) for n in grads0])
    peaks = {name: estimate_peak_bytes(cm.exec_graph(name)) for name in names}
    return worst, peaks


# (tp4sp-full recomputes sequence parallelism's collectives in the backward)
KINDS = ["fsdp4", "dp4-full", "tp2pp2", "fsdp2cp2", "tp4sp-full", "fsdp2tp2-sel", "dp2tp2"]


def check_switch_between_every_kind():
    """One micro-batch under each config in turn, gradients moving with every switch: their sum
    equals one device's, and the weights come back bit-exact from a round through every layout."""
    model = make_model("gpt")
    cm = hs.compile(model, batch(), configs=parse_configs(",".join(KINDS)), lazy=True)
    cm.switch(KINDS[0])
    start = cm.full_state_dict()
    cm.zero_grad()
    expected = None
    for i, name in enumerate(KINDS):
        ids, labels = batch(batch=4, seed=i + 1)
        cm.switch(name)
        cm.forward_backward(*cm.shard_inputs(ids, labels))
        _, grads = reference(model, ids, labels)
        expected = grads if expected is None else {n: expected[n] + grads[n] for n in grads}
    cm.switch(KINDS[0])
    total = cm.full_grads()
    worst = max(rel_err(total[n], expected[n]) for n in expected)
    exact = all(torch.equal(start[k], v) for k, v in cm.full_state_dict().items())
    return worst, exact


def check_fsdp_world2_gpt():
    return assert_equivalent("gpt", parse_configs("fsdp2,fsdp2-full"))


def check_fsdp_world2_hf():
    """HF Llama, and HF GPT-2: learned positions and a tied embedding (one parameter, two uses)."""
    return (assert_equivalent("llama", parse_configs("fsdp2-sel"), extra_seq=None),
            assert_equivalent("gpt2", parse_configs("fsdp2"), extra_seq=None))


def check_trainer_with_fsdp_and_recomputation():
    """The mixed-length Trainer over fsdp and recomputation configs, the optimizer on fsdp's shards:
    every step equal to single-device AdamW."""
    from hotswitch.train.trainer import Trainer
    from tests.test_trainer_world4 import LR, _batches, _model, _reference_steps, _steps_against

    model = _model("gpt")
    batches = _batches()
    ref = _reference_steps(model, batches)
    configs = ["fsdp4", "dp2tp2-sel", "tp4sp-full"]
    trainer = Trainer(model, configs, dict(name="adamw", lr=LR), buckets=[8, 16, 128], bucket_configs=configs,
                      micro_batch_tokens=64, base="fsdp4")
    return _steps_against(trainer, batches, ref)


def check_unflatten_of_strided_rows_agrees_with_dtensor():
    """[b*s, V] -> [b, s, V] with rows sharded over dp and positions over tp (sp): where DTensor's
    view rule answers (b divides over tp), `propagate._unflatten_strided` answers the same."""
    from torch.distributed.device_mesh import init_device_mesh

    from hotswitch.compiler import _dtensor as dt
    from hotswitch.compiler.propagate import _unflatten_strided

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = []
    for b, s in ((2, 8), (4, 6)):
        flat = dt.make_spec(mesh, (dt.Shard(0), dt.StridedShard(0, split_factor=b // 2)),
                            torch.empty(b * s, 5, device="meta"))
        node = torch.fx.Graph().placeholder("x")
        ours = _unflatten_strided(torch.ops.aten.view.default, (flat, [b, s, 5]), {}, [node], {node: flat})
        with dt.propagation():
            theirs = dt.propagate(torch.ops.aten.view.default, (flat, [b, s, 5]), {}, frozenset())
        out.append((tuple(ours.out_spec.placements), tuple(theirs.output_spec.placements), ours.args[1],
                    list(dt.local_shape(theirs.output_spec))))
    return out


results2 = dist_fixture(2, [check_fsdp_world2_gpt, check_fsdp_world2_hf], name="results2")
results = dist_fixture(4, [check_fsdp_gpt_equivalence, check_fsdp_llama_equivalence, check_fsdp_collectives_per_block,
                           check_recompute_equals_keeping_activations, check_switch_between_every_kind,
                           check_trainer_with_fsdp_and_recomputation,
                           check_unflatten_of_strided_rows_agrees_with_dtensor],
                        env={"HOTSWITCH_PACK_BACKEND": "torch"})


def test_fsdp_equals_one_device(results):
    for check in ("check_fsdp_gpt_equivalence", "check_fsdp_llama_equivalence"):
        results[check].raise_if_failed()


def test_fsdp_equals_one_device_world2(results2):
    for check in ("check_fsdp_world2_gpt", "check_fsdp_world2_hf"):
        results2[check].raise_if_failed()


def test_fsdp_collectives_per_block(results):
    for gathers, scatters, prefetched, kinds in results["check_fsdp_collectives_per_block"].raise_if_failed():
        for block in ("layers.0", "layers.1"):
            assert gathers[("forward", block)] == 1 and gathers[("backward", block)] == 1, gathers
        # the embedding, the blocks, the final norm, the head: a unit each, a reduce-scatter each
        assert scatters == 5, scatters
        assert prefetched, "the next block's all-gather is not issued before this block computes"
        assert dict(kinds).get("all_reduce", 0) == 1, kinds  # the loss alone; gradients are reduce-scattered


def test_recompute_equals_keeping_activations(results):
    for worst, peaks in results["check_recompute_equals_keeping_activations"].raise_if_failed():
        assert max(worst.values()) <= 1e-6, worst
        assert peaks["dp2tp2-full"] <= peaks["dp2tp2-sel"] < peaks["dp2tp2"], peaks


def test_switch_between_every_kind(results):
    for worst, exact in results["check_switch_between_every_kind"].raise_if_failed():
        assert worst < 1e-5, worst
        assert exact


def test_trainer_with_fsdp_and_recomputation_equals_single_device_adamw(results):
    from tests.test_trainer_world4 import _assert_equivalent

    steps = results["check_trainer_with_fsdp_and_recomputation"].raise_if_failed()[0]
    _assert_equivalent(steps, worst_tensor=1e-5, configs=["fsdp4", "dp2tp2-sel", "tp4sp-full"])
    assert {b.config for s in steps for b in s["report"].buckets} == {"fsdp4", "dp2tp2-sel", "tp4sp-full"}


def test_unflatten_of_strided_rows_agrees_with_dtensor(results):
    for ours, theirs, our_shape, their_shape in results["check_unflatten_of_strided_rows_agrees_with_dtensor"] \
            .raise_if_failed()[0]:
        assert ours == theirs and our_shape == their_shape, (ours, theirs, our_shape, their_shape)
