"""Pipeline parallelism on 4 gloo processes: pp=2 with dp=2 and with tp=2, micro-batches (1F1B, GPipe),
equal to single-device training; switching across pipeline degrees, bit-exact.

Four configs: (dp, tp, pp) = (1, 2, 2), (2, 1, 2), (4, 1, 1), (2, 2, 1). The global
batch of 5 rows splits 3 + 2 over dp = 2 and micro-batches split those again (2 + 1, 1 + 1): every
shape is uneven somewhere.
"""
import pytest
import torch

import hotswitch as hs
from hotswitch.distconfig import Topology
from tests.compile_checks import batch, collective_counts, forward_collectives_per_block, make_model, reference, rel_err
from tests.distributed import dist_fixture

pytestmark = pytest.mark.slow  # spawns gloo processes and compiles; `-m 'not slow'` leaves it out

CONFIGS = [
    hs.DistConfig("tp2pp2", tp=2, pp=2),
    hs.DistConfig("dp2pp2", dp=2, pp=2),
    hs.DistConfig("dp4", dp=4),
    hs.DistConfig("dp2tp2", dp=2, tp=2),
    hs.DistConfig("tp2pp2sp", tp=2, pp=2, sp=True),
]
PIPELINED = ("tp2pp2", "dp2pp2")
TOPOLOGY = Topology(4, devices_per_node=2)
TOL = 1e-5

_cms = {}


def _compiled(kind="gpt"):
    if kind not in _cms:
        configs = CONFIGS if kind == "gpt" else [c for c in CONFIGS if c.name in PIPELINED]
        configs = [c for c in configs if c.name != "tp2pp2sp"] + [c for c in configs if c.name == "tp2pp2sp"]
        _cms[kind] = hs.compile(make_model(kind), batch(), configs=configs, topology=TOPOLOGY, lazy=True)
    return _cms[kind]


def _assert_step(cm, ids, labels, loss_ref, grads_ref, what, **kwargs):
    cm.zero_grad()
    loss = cm.forward_backward(*cm.shard_inputs(ids, labels), **kwargs)
    assert abs(loss.item() - loss_ref.item()) <= TOL * abs(loss_ref.item()), (what, loss.item(), loss_ref.item())
    grads = cm.full_grads()
    assert set(grads) == set(grads_ref), set(grads) ^ set(grads_ref)
    worst = max(grads_ref, key=lambda n: rel_err(grads[n], grads_ref[n]))
    assert rel_err(grads[worst], grads_ref[worst]) <= TOL, (what, worst, rel_err(grads[worst], grads_ref[worst]))
    return cm.last_step


def _equivalence(kind, cases, extra=()):
    """Every pipelined config, each (micro_batches, schedule) case: loss and every full gradient
    within 1e-5 relative of one device, forward-only loss too, weights untouched. `extra` configs
    run the first case only."""
    cm = _compiled(kind)
    model = make_model(kind)
    ids, labels = batch()
    loss_ref, grads_ref = reference(model, ids, labels)
    state_ref = {k: v.clone() for k, v in model.state_dict().items()}
    report = {}
    for name in PIPELINED + tuple(extra):
        cm.switch(name)
        for k, schedule in cases if name in PIPELINED else cases[:1]:
            step = _assert_step(
                cm, ids, labels, loss_ref, grads_ref, (name, k, schedule), micro_batches=k, schedule=schedule
            )
            report[(name, k, schedule)] = (step.order, step.sends, step.recvs)
        forward_only = cm(*cm.shard_inputs(ids, labels))
        assert abs(forward_only.item() - loss_ref.item()) <= TOL * abs(loss_ref.item()), (name, forward_only)
        state = cm.full_state_dict()
        assert set(state) == set(state_ref) and all(torch.equal(state[k], state_ref[k]) for k in state_ref), name
        st = cm._states[name]
        report[(name, "reductions")] = [collective_counts(gm) for gm in st.reductions.values()]
        report[(name, "held")] = sorted(cm.local_params)
        report[(name, "forward per block")] = forward_collectives_per_block(cm.exec_graph(name))
    cm.zero_grad()
    return report


def check_gpt_pipeline_equivalence():
    report = _equivalence("gpt", [(1, "1f1b"), (2, "1f1b"), (2, "gpipe")], extra=["tp2pp2sp"])
    # other sequence lengths lower on demand (the stage graphs are dynamic in it too); from the second
    # length of the first micro-batch shape on, the stage programs are written from a fit (compiler.lengths)
    cm = _compiled("gpt")
    cm.switch("tp2pp2")
    for seq in (7, 9, 10):
        ids, labels = batch(seq=seq, seed=1)
        loss_ref, grads_ref = reference(make_model("gpt"), ids, labels)
        _assert_step(cm, ids, labels, loss_ref, grads_ref, f"seq {seq}", micro_batches=2)
    cm.zero_grad()
    report["fitted"] = [p.fitted for p in cm._states["tp2pp2"].programs.values()]
    return report


def check_llama_pipeline_equivalence():
    """Also the batched point-to-point path NCCL takes (sends held back to go out with the next receive)."""
    from hotswitch.runtime import pipeline

    pipeline.BATCH_P2P = True
    try:
        return _equivalence("llama", [(1, "1f1b"), (2, "1f1b")])
    finally:
        pipeline.BATCH_P2P = None


def check_micro_batches_without_pipeline():
    """pp = 1: micro-batches run one after the other, weighted exactly; one DP reduction per step."""
    cm = _compiled("gpt")
    ids, labels = batch()
    loss_ref, grads_ref = reference(make_model("gpt"), ids, labels)
    cm.switch("dp2tp2")
    _assert_step(cm, ids, labels, loss_ref, grads_ref, "dp2tp2 k=2", micro_batches=2)
    cm.zero_grad()
    return [collective_counts(gm) for gm in cm._states["dp2tp2"].reductions.values()]


def _snapshot(cm):
    return {n: t.clone() for n, t in cm.local_params.items()}


def check_round_trip_across_pipeline_degrees():
    """Every ordered pair of the four configs (an Euler circuit through all 12), with gradients and
    attached fp64 state moving too: weights bit-identical all along and back at the start."""
    cm = _compiled("gpt")
    cm.switch("dp4")
    cm.zero_grad()
    start, full = _snapshot(cm), cm.full_state_dict()
    g = torch.Generator().manual_seed(7)
    moments = {n: torch.randn(p.shape, generator=g) for n, p in cm.full_state_dict(canonical=True).items()}
    master = {n: p.to(torch.float64) for n, p in cm.full_state_dict(canonical=True).items()}
    cm.attach_state("exp_avg", cm.shard_like_params(moments))
    cm.attach_state("master", cm.shard_like_params(master))
    circuit = ["dp4", "tp2pp2", "dp2pp2", "dp4", "dp2tp2", "tp2pp2", "dp2tp2", "dp2pp2", "tp2pp2", "dp4", "dp2pp2",
               "dp2tp2", "dp4"]
    pairs = set(zip(circuit, circuit[1:]))
    assert len(pairs) == 12
    held, moved = {}, {}
    for name in circuit[1:]:
        stats = cm.switch(name)
        moved[(stats.source, name)] = stats.bytes_sent
        held[name] = len(cm.local_params)
        assert all(torch.equal(full[k], v) for k, v in cm.full_state_dict().items()), name
        assert all(torch.equal(moments[n], t) for n, t in cm.full_state("exp_avg").items()), name
        full_master = cm.full_state("master")
        assert all(full_master[n].dtype == torch.float64 and torch.equal(master[n], full_master[n]) for n in master), (
            name
        )
        assert set(cm.state("master")) == set(cm.local_params)
    assert all(torch.equal(start[n], t) for n, t in cm.local_params.items())
    cm.detach_state("exp_avg"), cm.detach_state("master")
    plans = {(a, b): cm.plan_switch(a, b).summary()["bytes_moved"] for a, b in pairs}
    return held, moved, plans


def check_gradients_accumulate_across_pipeline_switches():
    """Three micro-batches under dp2pp2, tp2pp2 and dp4, gradients moved by the switches in between:
    their sum equals the single-device sum."""
    cm = _compiled("gpt")
    model = make_model("gpt")
    data = [batch(seed=1), batch(batch=7, seed=2), batch(batch=4, seed=3)]
    refs = [reference(model, *d)[1] for d in data]
    cm.switch("dp2pp2")
    cm.zero_grad()
    for name, (ids, labels) in zip(("dp2pp2", "tp2pp2", "dp4"), data):
        cm.switch(name)
        cm.forward_backward(*cm.shard_inputs(ids, labels))
    grads = cm.full_grads()
    worst = max(rel_err(grads[n], sum(r[n] for r in refs)) for n in refs[0])
    assert worst < TOL, worst
    cm.zero_grad()
    return worst


def check_point_to_point_per_step():
    """What one pipelined step sends: one activation per micro-batch forward, one gradient back."""
    cm = _compiled("gpt")
    cm.switch("dp2pp2")
    ids, labels = batch()
    cm.zero_grad()
    cm.forward_backward(*cm.shard_inputs(ids, labels), micro_batches=2, schedule="1f1b")
    step = cm.last_step
    cm.zero_grad()
    return step.stage, step.order, step.sends, step.recvs, step.bytes_sent


def check_tied_embedding_across_stages():
    """HF GPT-2 (LM head tied to the token embedding): a copy in each stage, their gradients summed
    (Megatron); equal to one device, and the copies stay equal through switches."""
    model = make_model("gpt2")
    ids, labels = batch()
    loss_ref, grads_ref = reference(model, ids, labels)
    cm = hs.compile(model, (ids, labels), configs=[hs.DistConfig("dp2pp2", dp=2, pp=2), hs.DistConfig("dp4", dp=4)],
                    topology=TOPOLOGY, lazy=True)
    full = cm.full_state_dict()
    _assert_step(cm, ids, labels, loss_ref, grads_ref, "gpt2 dp2pp2", micro_batches=2)
    tied = "model.transformer.wte.weight"
    local_grad = cm.local_grads[tied]  # both stages hold the summed gradient
    for name in ("dp4", "dp2pp2", "dp4"):
        cm.switch(name)
        assert all(torch.equal(full[k], v) for k, v in cm.full_state_dict().items()), name
    return sorted(cm._states["dp2pp2"].copy_groups), repr(cm.layouts("dp2pp2")[tied]), local_grad.norm().item()


results = dist_fixture(4, [check_gpt_pipeline_equivalence, check_llama_pipeline_equivalence,
                           check_micro_batches_without_pipeline, check_round_trip_across_pipeline_degrees,
                           check_gradients_accumulate_across_pipeline_switches, check_point_to_point_per_step,
                           check_tied_embedding_across_stages], env={"HOTSWITCH_PACK_BACKEND": "torch"})


def _stage(rank):
    return 0 if rank < 2 else 1  # (pp, dp, tp) mesh: stage 0 on ranks 0-1, stage 1 on ranks 2-3


def _check_report(reports):
    for rank, report in enumerate(reports):
        stage = _stage(rank)
        for name in PIPELINED:
            # 1F1B on 2 stages: stage 0 warms up with one forward, stage 1 alternates; GPipe: all forwards first
            assert report[(name, 2, "1f1b")][0] == (
                ["F0", "F1", "B0", "B1"] if stage == 0 else ["F0", "B0", "F1", "B1"]
            )
            assert report[(name, 2, "gpipe")][0] == ["F0", "F1", "B0", "B1"] if (name, 2, "gpipe") in report else True
            order, sends, recvs = report[(name, 1, "1f1b")]
            assert order == ["F0", "B0"] and sends == 1 and recvs == 1  # one activation forward, one gradient back
            # the gradient reduction: one program per step, whatever the number of micro-batches
            for counts in report[(name, "reductions")]:
                assert set(counts) <= {"all_reduce"} and counts.get("all_reduce", 0) <= 1, counts
            held = report[(name, "held")]
            assert held and all(("layers.0." in n or "embed" in n) == (stage == 0) for n in held), held
        # tp2pp2: Megatron's collectives inside each stage, one all-reduce per attention and MLP block;
        # dp2pp2: none in the forward
        blocks = report[("tp2pp2", "forward per block")]
        assert all(v == {"all_reduce": 1} for b, v in blocks.items() if b != "outside blocks"), blocks
        assert len([b for b in blocks if b != "outside blocks"]) == 2, blocks
        assert report[("dp2pp2", "forward per block")] == {}, report[("dp2pp2", "forward per block")]
        if ("tp2pp2sp", "forward per block") in report:  # TP + SP: one all-gather and one reduce-scatter per block
            blocks = report[("tp2pp2sp", "forward per block")]
            assert all(
                v == {"all_gather": 1, "reduce_scatter": 1} for b, v in blocks.items() if b != "outside blocks"
            ), blocks


def test_gpt_pipeline_matches_single_device(results):
    reports = results["check_gpt_pipeline_equivalence"].raise_if_failed()
    _check_report(reports)
    for report in reports:  # lengths 7, 9 and 10 of micro-batches of 3 and 2 rows: fitted from 12 and 7
        assert sorted(f for f in report["fitted"] if f is not None) == [(12, 7)] * 6, report["fitted"]


def test_hf_llama_pipeline_matches_single_device(results):
    _check_report(results["check_llama_pipeline_equivalence"].raise_if_failed())


def test_micro_batches_without_pipeline_reduce_once(results):
    for reductions in results["check_micro_batches_without_pipeline"].raise_if_failed():
        assert reductions and all(c == {"all_reduce": 1} for c in reductions), reductions  # one bucket, once


def test_round_trip_across_pipeline_degrees_is_bit_exact(results):
    values = results["check_round_trip_across_pipeline_degrees"].raise_if_failed()
    held, moved, plans = values[0]
    n_params = held["dp4"]
    assert held["dp2tp2"] == n_params and 0 < held["tp2pp2"] < n_params and 0 < held["dp2pp2"] < n_params
    # a rank keeps what it needs of what it has: replicated -> sharded or dropped moves nothing...
    assert plans[("dp4", "dp2tp2")] == plans[("dp4", "dp2pp2")] == plans[("dp2pp2", "tp2pp2")] == 0, plans
    # ...while a pipeline config gathering all stages, or moving layers to other devices, does move
    assert all(plans[(a, b)] > 0 for a, b in [("tp2pp2", "dp4"), ("dp2pp2", "dp4"), ("dp2tp2", "dp2pp2"),
                                             ("tp2pp2", "dp2pp2"), ("dp2pp2", "dp2tp2")]), plans


def test_gradients_accumulate_across_pipeline_switches(results):
    results["check_gradients_accumulate_across_pipeline_switches"].raise_if_failed()


def test_point_to_point_per_step(results):
    for rank, (stage, order, sends, recvs, sent) in enumerate(
        results["check_point_to_point_per_step"].raise_if_failed()
    ):
        assert stage == _stage(rank)
        assert sends == 2 and recvs == 2, (rank, sends, recvs)  # 2 micro-batches: 2 activations / 2 gradients
        # the residual stream of this rank's rows: (rows, 12 tokens, 64 wide) fp32, per micro-batch
        rows = 3 if rank % 2 == 0 else 2
        assert sent == rows * 12 * 64 * 4, (rank, sent)


def test_tied_embedding_has_a_copy_per_stage(results):
    values = results["check_tied_embedding_across_stages"].raise_if_failed()
    groups, layout, _ = values[0]
    assert groups == [(0, 1)] and "('copy', 'dp')=(2, 2)" in layout, layout  # replicated over the two stages' copies
    norms = [v[2] for v in values]
    assert norms[0] == norms[1] == norms[2] == norms[3] > 0  # every copy holds the same summed gradient
