"""Compiled ExecGraphs on 4 gloo processes: equal to single-device training, Megatron's collectives."""

import os

import pytest
import torch

import hotswitch as hs
from tests.compile_checks import (
    assert_equivalent,
    batch,
    collective_counts,
    fitted_equals_replayed,
    forward_collectives_per_block,
    lowering_equals_make_fx,
    make_model,
    rel_err,
    replay_equals_fresh,
)
from tests.distributed import dist_fixture

pytestmark = pytest.mark.slow  # spawns gloo processes and compiles; `-m 'not slow'` leaves it out

CONFIGS = [hs.DistConfig("dp4", dp=4), hs.DistConfig("dp2tp2", dp=2, tp=2),
           hs.DistConfig("tp4sp", tp=4, sp=True), hs.DistConfig("tp4", tp=4)]


def check_gpt_equivalence():
    return assert_equivalent("gpt", CONFIGS)


def check_llama_equivalence():
    return assert_equivalent("llama", CONFIGS)


def check_gpt2_equivalence():
    return assert_equivalent("gpt2", CONFIGS, extra_seq=None)


def _compiled_mha(kind, names=("tp4", "tp4sp", "dp4", "dp2tp2")):
    """Models whose heads tp=4 divides (MHA), so every block is tensor-parallel end to end."""
    over = {"n_kv_heads": 4} if kind == "gpt" else {"num_key_value_heads": 4}
    model = make_model(kind, **over)
    ids, labels = batch()
    configs = {"tp4": hs.DistConfig("tp4", tp=4), "tp4sp": hs.DistConfig("tp4sp", tp=4, sp=True),
               "dp4": hs.DistConfig("dp4", dp=4), "dp2tp2": hs.DistConfig("dp2tp2", dp=2, tp=2)}
    cm = hs.compile(model, (ids, labels), configs=[configs[n] for n in names])
    return {
        name: (forward_collectives_per_block(cm.exec_graph(name)), collective_counts(cm.exec_graph(name), "forward"),
               collective_counts(cm.exec_graph(name), "backward"))
        for name in names
    }


def check_collectives_gpt():
    return _compiled_mha("gpt")


def check_collectives_llama():
    return _compiled_mha("llama", ("tp4", "tp4sp"))  # the DP and 2-D patterns are checked on GPT (suite time)


def check_wrong_device_count():
    try:
        hs.compile(make_model("gpt"), batch(), configs=[hs.DistConfig("dp8", dp=8)])
    except ValueError as e:
        return str(e)
    raise AssertionError("a config of 8 devices compiled on 4 processes")


def check_replayed_decisions_equal_a_fresh_lowering():
    """A new sequence length replays the first length's decisions (no strategy search): under a 2-D
    mesh, and under sequence parallelism, where views of sequence-sharded activations get their
    local sizes at the new length."""
    tp4sp = hs.DistConfig("tp4sp", tp=4, sp=True)
    out = {name: replay_equals_fresh("llama", config) for name, config in
           (("dp2tp2", hs.DistConfig("dp2tp2", dp=2, tp=2)), ("tp4sp", tp4sp))}
    out["tp4sp uneven"] = replay_equals_fresh("llama", tp4sp, seqs=(12, 18))  # 18 tokens on 4 ranks
    return out


def check_fitted_lengths_equal_a_replay():
    """Once a config has run at two sequence lengths, a third is written from their fit: under a
    2-D mesh with uneven rows, and under sequence parallelism, where 18 tokens on 4 ranks are
    uneven pieces and the fit refuses (that length is lowered)."""
    return {name: fitted_equals_replayed("llama", config) for name, config in
            (("dp2tp2", hs.DistConfig("dp2tp2", dp=2, tp=2)), ("tp4sp", hs.DistConfig("tp4sp", tp=4, sp=True)))}


def check_lowering_equals_make_fx_on_a_2d_mesh():
    """dp2tp2's program built node by node equals the make_fx interpreter's: gradient buckets reduced
    over both mesh dims (layer norms' gradients are partial over dp and tp), the loss divided once."""
    return lowering_equals_make_fx("gpt", [hs.DistConfig("dp2tp2", dp=2, tp=2)])


def check_dp_ranks_lower_one_program():
    """Ranks that differ only in their dp coordinate, with equal local batches, run one lowering
    between them (the others load its program) at the first length, and at a second one one sample
    and fit (the others load the fit and write their program from it, as the sampling rank does:
    the first length's program was one for all), and every rank's numbers are still exact."""
    import os

    from tests.compile_checks import reference, rel_err

    model = make_model("gpt")
    os.environ["HOTSWITCH_CACHE"] = "0"  # no disk: what is shared comes from the other ranks of this job
    try:
        cm = hs.compile(model, batch(batch=4), configs=CONFIGS[:2])  # dp4, dp2tp2
    finally:
        del os.environ["HOTSWITCH_CACHE"]
    out = {}
    for seq in (12, 16):
        ids, labels = batch(batch=4, seq=seq)
        loss_ref, grads_ref = reference(model, ids, labels)
        for config in CONFIGS[:2]:
            cm.switch(config.name)
            cm.zero_grad()
            loss = cm.forward_backward(*cm.shard_inputs(ids, labels))
            grads = cm.full_grads()
            program = cm._state(config.name).programs[next(reversed(cm._state(config.name).programs))]
            (family,) = cm._state(config.name).lengths.values()
            out[config.name, seq] = dict(
                loaded=program.loaded, propagated=program.propagate_seconds > 0, fitted=program.fitted,
                sampled=[length for length, _ in family.lowered[1:]], fit_loaded=family.fit_loaded,
                coordinate=tuple(cm._state(config.name).mesh.get_coordinate()),
                loss_err=abs(loss.item() - loss_ref.item()) / loss_ref.item(),
                grad_err=max(rel_err(grads[n], grads_ref[n]) for n in grads_ref))
    return out


def check_strided_gathers_equal_one_device():
    """Rows of packed sequences flattened with a sequence-sharded length are _StridedShards: their
    gathers run as one all-gather and the pieces put back in order (`_dtensor._gather_strided`). At
    12 tokens each piece is even (to Replicate, and to Shard(1) of the hidden dim); at 18 tokens over
    4 ranks the pieces are uneven (padded, then cut back). Loss and gradients equal one device's."""
    import copy
    from collections import Counter

    import hotswitch.compiler._dtensor as D
    from hotswitch.models import build_model
    from hotswitch.train.data import full_length_micro_batch

    taken, gather = Counter(), D._gather_strided

    def counted(local, src, dst):
        out = gather(local, src, dst)
        if out is not None:
            i = next(k for k, (a, b) in enumerate(zip(src.placements, dst.placements)) if a != b)
            p = src.placements[i]
            even = src.shape[p.dim] % (p.split_factor * src.mesh.size(i)) == 0
            taken["even" if even else "uneven", "replicate" if dst.placements[i].is_replicate() else "shard"] += 1
        return out

    os.environ["HOTSWITCH_CACHE"] = "0"  # every program lowered here
    D._gather_strided = counted
    errors = {}
    try:
        for rows, length in ((5, 12), (3, 18)):
            torch.manual_seed(0)
            model = build_model("gpt-tiny")
            ids, positions, labels = full_length_micro_batch(rows, length)
            inputs = dict(input_ids=ids, labels=labels, position_ids=positions)  # packed rows
            ref = copy.deepcopy(model)
            loss_ref = ref(**inputs)
            loss_ref.backward()
            cm = hs.compile(model, inputs, configs=[hs.DistConfig("tp4sp", tp=4, sp=True)])
            loss = cm.forward_backward(**cm.shard_inputs(**inputs))
            grads = cm.full_grads()
            errors[length] = (abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()),
                              max(rel_err(grads[n], p.grad) for n, p in ref.named_parameters()))
    finally:
        D._gather_strided = gather
        del os.environ["HOTSWITCH_CACHE"]
    return errors, dict(taken)


results = dist_fixture(4, [check_strided_gathers_equal_one_device, check_dp_ranks_lower_one_program,
                           check_lowering_equals_make_fx_on_a_2d_mesh,
                           check_fitted_lengths_equal_a_replay,
                           check_gpt_equivalence, check_llama_equivalence, check_gpt2_equivalence,
                           check_collectives_gpt, check_collectives_llama,
                           check_wrong_device_count, check_replayed_decisions_equal_a_fresh_lowering])


def test_gpt_matches_single_device(results):
    results["check_gpt_equivalence"].raise_if_failed()


def test_hf_llama_gqa_matches_single_device(results):
    ranks = results["check_llama_equivalence"].raise_if_failed()
    # 5 rows on dp4 are 2, 1, 1, 1: the three ranks of one row share one lowering, though HF Llama
    # makes its attention mask whole on each rank and cuts it into its rows (the same rows on every
    # rank: `compiler.uniform`); dp2tp2's 3 and 2 rows are four programs
    loaded = [r["loaded"] for r in ranks]
    assert sum(not r["dp4"] for r in loaded) == 2 and sum(not r["dp2tp2"] for r in loaded) == 4, loaded


def test_hf_gpt2_matches_single_device(results):
    results["check_gpt2_equivalence"].raise_if_failed()


def _assert_megatron(per_block, n_layers=2, dp_checked=True):
    tp_blocks, _, tp_backward = per_block["tp4"]
    sp_blocks, _, sp_backward = per_block["tp4sp"]
    blocks = [k for k in tp_blocks if k != "outside blocks"]
    assert len(blocks) == 2 * n_layers, tp_blocks
    for b in blocks:  # TP: one all-reduce per attention and per MLP block, nothing else
        assert tp_blocks[b] == {"all_reduce": 1}, (b, tp_blocks[b])
        assert sp_blocks[b] == {"all_gather": 1, "reduce_scatter": 1}, (b, sp_blocks[b])
    # outside the blocks: the vocab-parallel embedding's reduction (all-reduce, or reduce-scatter with SP)
    assert tp_blocks["outside blocks"] == {"all_reduce": 1}
    assert sp_blocks["outside blocks"].get("reduce_scatter") == 1
    # backward: the input-gradients of q, k, v (and of gate, up) are summed, then reduced once per
    # attention and per MLP block (each of them reduced on its own was 5 per block, not 2)
    assert tp_backward == {"all_reduce": 2 * n_layers}, tp_backward
    assert sp_backward.get("reduce_scatter") == 2 * n_layers and "all_reduce" not in sp_backward, sp_backward
    if not dp_checked:
        return
    assert per_block["dp4"][1] == {}, per_block["dp4"]  # pure DP: no collective in forward
    dp2tp2_blocks = per_block["dp2tp2"][0]
    assert all(dp2tp2_blocks[b] == {"all_reduce": 1} for b in blocks)
    assert per_block["dp2tp2"][2] == {"all_reduce": 2 * n_layers}, per_block["dp2tp2"]
    assert dp2tp2_blocks["outside blocks"] == {"all_reduce": 1}


def test_collectives_follow_megatron_gpt(results):
    (value, *_) = results["check_collectives_gpt"].raise_if_failed()
    _assert_megatron(value)


def test_collectives_follow_megatron_llama(results):
    (value, *_) = results["check_collectives_llama"].raise_if_failed()
    _assert_megatron(value, dp_checked=False)


def test_equivalence_reports_dp_has_one_gradient_bucket(results):
    (report, *_) = results["check_gpt_equivalence"].raise_if_failed()
    assert report["dp4"] == {"all_reduce": 1}  # the whole DP reduction is one bucket on this model


def test_wrong_device_count_names_problem_and_fix(results):
    (message, *_) = results["check_wrong_device_count"].raise_if_failed()
    assert "8" in message and "4" in message and "dp*tp*pp" in message, message


def test_a_new_length_replays_decisions_and_equals_a_fresh_lowering(results):
    everyone = results["check_replayed_decisions_equal_a_fresh_lowering"].raise_if_failed()
    for config in ("dp2tp2", "tp4sp", "tp4sp uneven"):
        ranks = [r[config] for r in everyone]
        # the fresh lowering searched on one rank; the others replayed what it found (hotswitch.runtime.shared)
        assert sum(out["fresh"]["replayed"] == 0 for out in ranks) == 1, config
        for out in ranks:
            replayed, fresh = out["replayed"], out["fresh"]
            assert replayed["replayed"] > 100
            if config == "tp4sp uneven":  # views of uneven pieces are searched again, not replayed
                assert any(name.startswith("view") for name in replayed["searched"]), replayed["searched"]
            else:
                assert replayed["searched"] == ()  # no strategy search at the new length
            assert replayed["placements"] == fresh["placements"]
            assert replayed["collectives"] == fresh["collectives"] and fresh["collectives"]
            assert replayed["loss"] == fresh["loss"]
            assert all(torch.equal(replayed["grads"][k], v) for k, v in fresh["grads"].items())


def test_a_third_length_is_fitted_and_equals_a_replay(results):
    everyone = results["check_fitted_lengths_equal_a_replay"].raise_if_failed()
    for config in ("dp2tp2", "tp4sp"):
        for seq in (20, 18):
            for r in everyone:
                fitted, replayed = r[config][seq]["fitted"], r[config][seq]["replayed"]
                uneven = config == "tp4sp" and seq == 18  # 18 tokens do not split into 4 equal pieces
                assert fitted["fitted"] == (None if uneven else (12, 16)), (config, seq, fitted["fitted"])
                assert replayed["fitted"] is None
                # a fitted program's code is the first's with its integers replaced, and is fx's own
                assert fitted["templated"] and fitted["code_is_the_graphs"] and replayed["code_is_the_graphs"]
                assert r[config][seq]["difference"] is None, (config, seq, r[config][seq]["difference"])
                assert fitted["loss"] == replayed["loss"]
                assert all(torch.equal(fitted["grads"][k], v) for k, v in replayed["grads"].items())
                assert fitted["loss_err"] <= 1e-5 and fitted["grad_err"] <= 1e-5, (config, seq)


def test_lowering_builds_the_program_make_fx_would_trace_on_a_2d_mesh(results):
    for differences in results["check_lowering_equals_make_fx_on_a_2d_mesh"].raise_if_failed():
        assert len(differences) == 1 and differences == [None], differences


def test_dp_ranks_lower_one_program_for_all(results):
    ranks = results["check_dp_ranks_lower_one_program"].raise_if_failed()
    assert sum(not r["dp4", 12]["loaded"] for r in ranks) == 1  # one of the four lowered dp4
    lowered = [r["dp2tp2", 12]["coordinate"] for r in ranks if not r["dp2tp2", 12]["loaded"]]
    assert sorted(c[1] for c in lowered) == [0, 1], lowered  # one rank per tp coordinate lowered dp2tp2
    # the second length: written from the fit on every rank; one rank (per tp coordinate) sampled it
    assert sum(not r["dp4", 16]["fit_loaded"] for r in ranks) == 1
    sampled = [r["dp2tp2", 16]["coordinate"] for r in ranks if not r["dp2tp2", 16]["fit_loaded"]]
    assert sorted(c[1] for c in sampled) == [0, 1], sampled
    for r in ranks:
        for name in ("dp4", "dp2tp2"):
            assert r[name, 16]["fitted"] == (12, 16) and not r[name, 16]["loaded"], (name, r)
            assert r[name, 16]["sampled"] == ([] if r[name, 16]["fit_loaded"] else [16]), (name, r)
            for seq in (12, 16):
                assert r[name, seq]["loss_err"] <= 1e-5 and r[name, seq]["grad_err"] <= 1e-5, (name, seq, r)
    # a rank that loads the program has not replayed the decisions (the decisions it received say
    # their program is shared); a fitted one replays nothing
    for r in ranks:
        for name in ("dp4", "dp2tp2"):
            assert r[name, 12]["propagated"] == (not r[name, 12]["loaded"]), (name, r)
            assert not r[name, 16]["propagated"], (name, r)


def test_strided_gathers_equal_one_device(results):
    for errors, taken in results["check_strided_gathers_equal_one_device"].raise_if_failed():
        assert all(loss <= 1e-5 and grad <= 1e-5 for loss, grad in errors.values()), errors
        assert set(taken) == {("even", "replicate"), ("even", "shard"), ("uneven", "replicate"),
                              ("uneven", "shard")}, taken
