"""Context parallelism (cp) on 4 gloo processes: the sequence sharded over cp ranks, attention
exchanging keys and values; losses and gradients equal to one device, switches in and out exact.
Hugging Face models under cp (GPT-2, Llama, Qwen2, Phi-3; uneven lengths): test_cp_hf_models_world4.py."""

import copy

import pytest
import torch

import hotswitch as hs
from hotswitch.compiler.lower import collective_kind, collectives
from hotswitch.models import PackedCausalLMLoss, build_model
from tests.compile_checks import VOCAB, assert_equivalent, batch, make_model, reference, rel_err
from tests.distributed import dist_fixture

pytestmark = pytest.mark.slow  # spawns gloo processes and compiles; `-m 'not slow'` leaves it out

CP_CONFIGS = [hs.DistConfig.parse(c) for c in ("cp4", "dp2cp2", "tp2cp2")]


def check_gpt_equivalence():
    """Plain causal rows (is_causal attention), an uneven dp split (5 rows), and cp under pipeline
    parallelism (cp2pp2: one block per stage), there also at a second length and at one cp does not
    divide (4 and 3 positions)."""
    return assert_equivalent("gpt", [*CP_CONFIGS, hs.DistConfig.parse("cp2pp2")], extra_seq=(8, 7))


def _packed_batch(rows=3, seq=16, seed=4):
    """Rows of several documents each (positions restart at every document start)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in
                             ([7, 5, 4], [3, 13], [16], [1, 2, 12, 1])[:rows]])
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[positions.roll(-1, dims=1) == 0] = -100  # no target across a document boundary
    return ids, positions, labels


def check_packed_documents_and_round_trips():
    """Packed documents (document-causal mask from the positions) under every cp config, 3 rows
    (uneven over dp = 2 and tp = 2); then dp2tp2 -> cp4 -> tp2cp2 -> dp2cp2 -> dp2tp2 moves
    weights and gradients bit-exactly. A batch smaller than dp is refused with the fix."""
    torch.manual_seed(0)
    model = PackedCausalLMLoss(build_model("gpt-tiny", vocab_size=VOCAB))
    inputs = _packed_batch()
    ref = copy.deepcopy(model)
    loss_ref = ref(*inputs)
    loss_ref.backward()
    grads_ref = {n: p.grad for n, p in ref.named_parameters()}
    try:
        hs.compile(model, inputs, configs=["dp4"])
        too_small = None
    except ValueError as e:
        too_small = str(e)
    cm = hs.compile(model, inputs, configs=["dp2tp2", *CP_CONFIGS])
    errors = {}
    for name in ("cp4", "dp2cp2", "tp2cp2"):
        cm.switch(name)
        cm.zero_grad()
        loss = cm.forward_backward(*cm.shard_inputs(*inputs))
        grads = cm.full_grads()
        errors[name] = (abs(loss.item() - loss_ref.item()) / loss_ref.item(),
                        max(rel_err(grads[n], grads_ref[n]) for n in grads_ref))
    cm.switch("dp2tp2")
    cm.zero_grad()
    cm.forward_backward(*cm.shard_inputs(*inputs))
    weights, grads = cm.full_state_dict(), cm.full_grads()
    for name in ("cp4", "tp2cp2", "dp2cp2", "dp2tp2"):
        cm.switch(name)
    exact = all(torch.equal(cm.full_state_dict()[k], weights[k]) for k in weights) and all(
        torch.equal(cm.full_grads()[n], grads[n]) for n in grads)
    return errors, exact, too_small


def check_trainer_with_cp_buckets_matches_single_device():
    """Mixed lengths: rows up to 8 under dp4, to 16 under dp2cp2, the longer ones under cp4; the
    optimizer's steps equal single-device AdamW (every weight, every applied gradient)."""
    from hotswitch.train.trainer import Trainer
    from tests.test_trainer_world4 import LR, _batches, _model, _reference_steps, _steps_against

    model, batches = _model("gpt"), _batches(steps=2)
    ref = _reference_steps(model, batches)
    trainer = Trainer(model, ["dp4", "dp2cp2", "cp4"], dict(name="adamw", lr=LR), buckets=[8, 16, 128],
                      bucket_configs=["dp4", "dp2cp2", "cp4"], micro_batch_tokens=64)
    return _steps_against(trainer, batches, ref)


def check_attention_gathers_keys_and_values_over_cp():
    """cp4 on the 2-layer GPT: per layer, the forward all-gathers K and V over the cp ranks and
    nothing else (attention is one op, `masked_attention`, on the rank's queries and all keys); the
    backward reuses them and reduce-scatters their gradients onto the sequence; one bucketed
    all-reduce of the weight gradients at the end."""
    ids, labels = batch(seq=12)
    cm = hs.compile(make_model("gpt"), (ids, labels), configs=["cp4"])
    gm = cm.exec_graph("cp4")
    by_phase = {}
    for node in collectives(gm):
        phase = node.meta["custom"]["phase"]
        by_phase.setdefault(phase, []).append(collective_kind(node))
    gathered = [(n.args[0].meta["val"].numel(), n.meta["val"].numel()) for n in collectives(gm, "forward")]
    return {phase: sorted(kinds) for phase, kinds in by_phase.items()}, gathered


def check_one_long_row():
    """One row (the long-sequence case): cp4, and tp4sp, whose GQA view of 2 kv heads over 4 ranks
    DTensor refused to unflatten until the lowering learned to gather before such a view."""
    ids = torch.randint(0, VOCAB, (1, 32), generator=torch.Generator().manual_seed(5))
    labels = ids.roll(-1, 1)
    model = make_model("gpt")
    loss_ref, grads_ref = reference(model, ids, labels)
    cm = hs.compile(model, (ids, labels), configs=["tp4sp", "cp4"])
    errors = {}
    for name in ("tp4sp", "cp4"):
        cm.switch(name)
        cm.zero_grad()
        loss = cm.forward_backward(*cm.shard_inputs(ids, labels))
        grads = cm.full_grads()
        errors[name] = max(abs(loss.item() - loss_ref.item()) / loss_ref.item(),
                           max(rel_err(grads[n], grads_ref[n]) for n in grads_ref))
    return errors


def check_sequence_not_divisible_names_the_fix():
    """Contiguous chunks take any length (torch.chunk's sizes: the equivalence checks run uneven
    ones); a layout that gives every cp rank an equal share of each row needs cp to divide it."""
    cm = hs.compile(make_model("gpt"), batch(seq=12), configs=["cp4"], cp_layout="zigzag")
    ids, labels = batch(seq=10)
    try:
        cm.shard_inputs(ids, labels)
    except ValueError as e:
        return str(e)
    return None


results = dist_fixture(4, [check_gpt_equivalence, check_packed_documents_and_round_trips,
                           check_trainer_with_cp_buckets_matches_single_device,
                           check_attention_gathers_keys_and_values_over_cp, check_one_long_row,
                           check_sequence_not_divisible_names_the_fix])


def test_gpt_under_cp_configs_and_cp_pipeline_matches_single_device(results):
    r = results["check_gpt_equivalence"]
    assert r.ok, r.errors
    # the attention exchange appears under every cp config (more under tp2cp2: tp's all-reduces);
    # under cp2pp2 a stage's program holds one of the two blocks
    counts = r.values[0]
    assert all(counts[c.name]["all_gather"] == 4 and counts[c.name]["reduce_scatter"] == 4 for c in CP_CONFIGS), counts
    assert counts["cp2pp2"]["all_gather"] == 2 and counts["cp2pp2"]["reduce_scatter"] == 2, counts


def test_packed_documents_match_and_round_trips_are_bit_exact(results):
    r = results["check_packed_documents_and_round_trips"]
    assert r.ok, r.errors
    for errors, exact, too_small in r.values:
        for name, (loss_err, grad_err) in errors.items():
            assert loss_err <= 1e-5 and grad_err <= 1e-5, (name, loss_err, grad_err)
        assert exact
        assert too_small and "batch of 3" in too_small and "at least 4" in too_small


def test_trainer_with_cp_buckets_equals_single_device_adamw(results):
    from tests.test_trainer_world4 import _assert_equivalent

    steps = results["check_trainer_with_cp_buckets_matches_single_device"].raise_if_failed()[0]
    _assert_equivalent(steps, worst_tensor=1e-5, configs=["dp4", "dp2cp2", "cp4"])
    assert {b.config for s in steps for b in s["report"].buckets} == {"dp4", "dp2cp2", "cp4"}


def test_attention_gathers_keys_and_values_over_cp(results):
    r = results["check_attention_gathers_keys_and_values_over_cp"]
    assert r.ok, r.errors
    by_phase, gathered = r.values[0]
    assert by_phase["forward"] == ["all_gather"] * 4  # K and V, two layers
    assert by_phase["backward"] == ["reduce_scatter"] * 4
    assert by_phase["reduce"] == ["all_reduce"]
    # each rank's keys / values (3 of the 12 positions) gathered from the 4 cp ranks
    assert all(out == 4 * local for local, out in gathered), gathered


def test_one_long_row_under_cp4_and_tp4sp_matches_single_device(results):
    r = results["check_one_long_row"]
    assert r.ok, r.errors
    for errors in r.values:
        assert all(err <= 1e-5 for err in errors.values()), errors


def test_sequence_not_divisible_by_cp_names_the_fix(results):
    r = results["check_sequence_not_divisible_names_the_fix"]
    assert r.ok, r.errors
    message = r.values[0]
    assert message and "cp_layout='zigzag'" in message and "cp=4" in message and "10 positions" in message, message
    assert "divisible by 4" in message and "cp_layout='contiguous'" in message, message
