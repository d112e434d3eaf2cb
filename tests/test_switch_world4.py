"""Hot switching on 4 gloo processes (2 nodes of 2): planned, bit-exact, atomic."""
import pytest
import torch
import torch.distributed as dist

import hotswitch as hs
from hotswitch.distconfig import Topology
from hotswitch.switch.executor import SwitchAborted, inject_fault
from tests.compile_checks import batch, make_model, reference, rel_err
from tests.distributed import dist_fixture

pytestmark = pytest.mark.slow  # spawns gloo processes and compiles; `-m 'not slow'` leaves it out

CONFIGS = [hs.DistConfig("dp4", dp=4), hs.DistConfig("dp2tp2", dp=2, tp=2), hs.DistConfig("tp4sp", tp=4, sp=True),
           hs.DistConfig("tp4", tp=4)]
TOPOLOGY = Topology(4, devices_per_node=2)

_cm = None


def _compiled():
    global _cm
    if _cm is None:
        _cm = hs.compile(make_model("gpt"), batch(), configs=CONFIGS, topology=TOPOLOGY)
    return _cm


def _snapshot(cm):
    return {n: t.clone() for n, t in cm.local_params.items()}


def check_round_trip_bit_exact():
    cm = _compiled()
    cm.switch("dp4")
    start, full = _snapshot(cm), cm.full_state_dict()
    for algorithm in ("greedy", "fcfs", "round_robin", "gather"):
        for name in ("dp2tp2", "tp4sp", "tp4", "dp4"):
            cm.switch(name, algorithm=algorithm)
            assert all(torch.equal(full[k], v) for k, v in cm.full_state_dict().items()), (algorithm, name)
        assert all(torch.equal(start[n], t) for n, t in cm.local_params.items()), algorithm
    return cm.last_switch


def check_gradients_accumulate_across_switches():
    """Gradients of two micro-batches, one under tp4sp and one under dp4, moved by the switch,
    equal the single-device sum. (dp4 -> tp4sp would move nothing: replicated to sharded is a
    local slice; the other way every rank receives the three quarters it lacks.)"""
    cm = _compiled()
    cm.switch("tp4sp")
    cm.zero_grad()
    (a_ids, a_labels), (b_ids, b_labels) = batch(seed=1), batch(batch=7, seed=2)
    model = make_model("gpt")
    _, ga = reference(model, a_ids, a_labels)
    _, gb = reference(model, b_ids, b_labels)
    cm.forward_backward(*cm.shard_inputs(a_ids, a_labels))
    stats = cm.switch("dp4")
    assert stats.bytes_received > 0 and stats.bytes_sent > 0
    assert cm.plan_switch("dp4", "tp4sp", with_grads=True).bytes_moved == 0
    cm.forward_backward(*cm.shard_inputs(b_ids, b_labels))
    grads = cm.full_grads()
    worst = max(rel_err(grads[n], ga[n] + gb[n]) for n in ga)
    assert worst < 1e-5, worst
    cm.zero_grad()


def check_failed_switch_keeps_previous_config():
    cm = _compiled()
    cm.switch("dp2tp2")
    cm.zero_grad()
    before = _snapshot(cm)
    for stage, ranks in (("pack", {2}), ("unpack", {1}), ("unpack", None)):
        with inject_fault(stage, ranks):
            try:
                cm.switch("tp4")
            except SwitchAborted as e:
                assert "still" in str(e) or "before any transfer" in str(e)
            else:
                raise AssertionError(f"no SwitchAborted for a fault at {stage}")
        assert cm.active == "dp2tp2"
        assert all(torch.equal(before[n], t) for n, t in cm.local_params.items())
    ids, labels = batch()
    loss_ref, grads_ref = reference(make_model("gpt"), ids, labels)
    loss = cm.forward_backward(*cm.shard_inputs(ids, labels))  # the previous config is intact and usable
    assert abs(loss.item() - loss_ref.item()) < 1e-5 * loss_ref.item()
    assert max(rel_err(cm.full_grads()[n], grads_ref[n]) for n in grads_ref) < 1e-5
    cm.switch("tp4")  # and a later switch works
    assert cm.active == "tp4"
    cm.zero_grad()


def check_attached_state_moves_with_switches():
    """Per-parameter state (optimizer moments, fp64 'master' copies) travels with every switch."""
    cm = _compiled()
    cm.switch("tp4")
    g = torch.Generator().manual_seed(7)
    moments = {n: torch.randn(p.shape, generator=g) for n, p in cm.full_state_dict(canonical=True).items()}
    master = {n: p.to(torch.float64) for n, p in cm.full_state_dict(canonical=True).items()}
    cm.attach_state("exp_avg", cm.shard_like_params(moments))
    cm.attach_state("master", cm.shard_like_params(master))
    plan = cm.plan_switch("tp4", "dp2tp2", states=("exp_avg", "master"))
    # weights (fp32) + exp_avg (fp32) + master (fp64): 1 + 1 + 2 times the weights' bytes
    assert plan.bytes_moved == 4 * cm.plan_switch("tp4", "dp2tp2").bytes_moved
    for name in ("dp2tp2", "dp4", "tp4sp", "tp4"):
        cm.switch(name)
        assert all(torch.equal(moments[n], t) for n, t in cm.full_state("exp_avg").items()), name
        full_master = cm.full_state("master")
        assert all(full_master[n].dtype == torch.float64 and torch.equal(master[n], full_master[n]) for n in master), (
            name
        )
    cm.detach_state("exp_avg"), cm.detach_state("master")


def check_prefetched_weights_equal_a_plain_switch():
    """The weights move to dp4 in the background while tp4 computes; the switch then moves only the
    gradients. Weights bit-exact, gradients equal to the single-device sum; a prefetch into another
    config than the next switch's is waited for and dropped, and so is one the weights outgrew."""
    cm = _compiled()
    cm.switch("tp4")
    cm.zero_grad()
    full = cm.full_state_dict()
    (a_ids, a_labels), (b_ids, b_labels) = batch(seed=3), batch(batch=6, seed=4)
    model = make_model("gpt")
    _, ga = reference(model, a_ids, a_labels)
    _, gb = reference(model, b_ids, b_labels)
    cm.prefetch("dp4")
    cm.forward_backward(*cm.shard_inputs(a_ids, a_labels))  # the prefetch runs beside it
    stats = cm.switch("dp4")
    weights_only = cm.plan_switch("tp4", "dp4").bytes_moved
    grads_only = cm.plan_switch("tp4", "dp4", with_grads=True, weights=False).bytes_moved
    assert stats.overlapped_seconds > 0 and grads_only == weights_only > 0
    assert all(torch.equal(full[k], v) for k, v in cm.full_state_dict().items())
    cm.forward_backward(*cm.shard_inputs(b_ids, b_labels))
    grads = cm.full_grads()
    assert max(rel_err(grads[n], ga[n] + gb[n]) for n in ga) < 1e-5
    cm.zero_grad()
    cm.prefetch("dp2tp2")
    cm.switch("tp4sp")  # not the prefetched config: a plain switch
    assert cm.last_switch.overlapped_seconds == 0
    cm.prefetch("tp4")
    cm.set_local_params(cm.local_params)  # the weights changed (an optimizer step): the prefetch is dropped
    cm.switch("tp4")
    assert cm.last_switch.overlapped_seconds == 0
    assert all(torch.equal(full[k], v) for k, v in cm.full_state_dict().items())
    return stats.bytes_sent, weights_only, grads_only


def check_gradients_handed_off_during_the_backward():
    """dp2tp2's gradients of a second micro-batch leave for tp4's layout during its backward, bucket
    by bucket (small buckets here: several), and arrive equal to a plain switch's, bit for bit, and to
    the single-device sum. A pack fault inside the backward aborts the switch on every rank with the
    gradients intact; anything touching the gradients first drops the hand-off."""
    from hotswitch.compiler.handoff import is_hand_off
    from hotswitch.compiler.lower import count_collectives

    # small gradient buckets, so that several are reduced (and handed off) behind the backward
    cm = hs.compile(make_model("gpt"), batch(), configs=CONFIGS, topology=TOPOLOGY, logic=_compiled().logic,
                    lazy=True, grad_bucket_bytes=64 * 1024)
    (a_ids, a_labels), (b_ids, b_labels) = batch(batch=6, seq=10, seed=5), batch(batch=6, seq=10, seed=6)
    model = make_model("gpt")
    _, ga = reference(model, a_ids, a_labels)
    _, gb = reference(model, b_ids, b_labels)

    def run(hand_off: bool, fault: set[int] | None = None):
        cm.switch("dp2tp2")
        cm.zero_grad()
        cm.forward_backward(*cm.shard_inputs(a_ids, a_labels))
        if hand_off:
            assert cm.hand_off_grads("tp4")
        pending = cm._switcher.pending_hand_off
        if fault is None:
            cm.forward_backward(*cm.shard_inputs(b_ids, b_labels))
            stats = cm.switch("tp4")
            return {n: g.clone() for n, g in cm.local_grads.items()}, stats, pending
        with inject_fault("pack", fault):
            cm.forward_backward(*cm.shard_inputs(b_ids, b_labels))
        try:
            cm.switch("tp4")
        except SwitchAborted:
            return None, None, pending
        raise AssertionError("a pack fault during the hand-off did not abort the switch")

    plain, plain_stats, _ = run(False)
    handed, stats, pending = run(True)
    gm = cm.exec_graph("dp2tp2", ((6, 10), (6, 10)))
    assert all(torch.equal(plain[n], handed[n]) for n in plain)
    grads = cm.full_grads()
    assert max(rel_err(grads[n], ga[n] + gb[n]) for n in ga) < 1e-5
    assert stats.bytes_received == plain_stats.bytes_received and stats.bytes_sent == plain_stats.bytes_sent
    # the program says where: one call per bucket with gradients (the loss parts may ride alone), and
    # one for gradients no bucket reduces; most of them before the backward's last op
    nodes = list(gm.graph.nodes)
    hooks = [i for i, n in enumerate(nodes) if is_hand_off(n)]
    last_backward = max(i for i, n in enumerate(nodes) if n.meta.get("custom", {}).get("phase") == "backward")
    buckets = count_collectives(gm, "reduce")["all_reduce"]
    assert buckets >= 3 and len(hooks) >= buckets - 1, (buckets, len(hooks))
    # the last two wait for the last bucket, issued after the backward's last op
    assert sum(i < last_backward for i in hooks) >= len(hooks) - 2 >= 2, (hooks, last_backward)
    assert pending.sent_during_backward == len(pending.groups) >= 2
    # a fault while packing inside the backward: every rank aborts, dp2tp2 stays, its gradients whole
    aborted, _, _ = run(True, fault={1})
    assert aborted is None and cm.active == "dp2tp2"
    cm.switch("tp4")  # a plain switch of the same gradients
    assert all(torch.equal(plain[n], g) for n, g in cm.local_grads.items())
    # zero_grad before the switch drops the hand-off: nothing is left waiting
    cm.switch("dp2tp2")
    cm.zero_grad()
    assert cm.hand_off_grads("tp4")
    cm.forward_backward(*cm.shard_inputs(a_ids, a_labels))
    cm.zero_grad()
    assert cm._switcher.pending_hand_off is None
    cm.switch("tp4")
    assert cm.local_grads is None
    assert not cm.hand_off_grads("tp4")  # already there
    return len(hooks), buckets


def check_plans_are_pure_and_identical_on_all_ranks():
    cm = _compiled()
    summaries = {}
    for a in cm.configs:
        for b in cm.configs:
            if a.name != b.name:
                for algorithm in ("greedy", "fcfs", "round_robin", "gather"):
                    summary = cm.plan_switch(a.name, b.name, algorithm=algorithm).summary()
                    summary.pop("planning_seconds")  # a timing, not part of the plan
                    summaries[(a.name, b.name, algorithm)] = summary
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, summaries)
    assert all(g == summaries for g in gathered)
    return summaries


def check_plan_order():
    cm = _compiled()
    order = cm.plan_order(["dp4", "dp2tp2", "tp4sp"])
    assert order.order[0] == "dp4" and sorted(order.order) == ["dp2tp2", "dp4", "tp4sp"]
    assert order.exact and order.cost > 0
    return order.order, order.cost


results = dist_fixture(4, [check_round_trip_bit_exact, check_gradients_accumulate_across_switches,
                           check_failed_switch_keeps_previous_config, check_attached_state_moves_with_switches,
                           check_prefetched_weights_equal_a_plain_switch,
                           check_gradients_handed_off_during_the_backward,
                           check_plans_are_pure_and_identical_on_all_ranks,
                           check_plan_order], env={"HOTSWITCH_PACK_BACKEND": "torch"})


def test_gradients_handed_off_during_the_backward(results):
    hooks, buckets = results["check_gradients_handed_off_during_the_backward"].raise_if_failed()[0]
    assert hooks >= buckets - 1


def test_round_trip_through_all_configs_is_bit_exact(results):
    results["check_round_trip_bit_exact"].raise_if_failed()


def test_gradients_accumulate_across_a_switch(results):
    results["check_gradients_accumulate_across_switches"].raise_if_failed()


def test_failed_switch_leaves_previous_config_usable(results):
    results["check_failed_switch_keeps_previous_config"].raise_if_failed()


def test_attached_state_moves_with_switches(results):
    results["check_attached_state_moves_with_switches"].raise_if_failed()


def test_prefetched_weights_equal_a_plain_switch(results):
    sent = [r for r in results["check_prefetched_weights_equal_a_plain_switch"].raise_if_failed()]
    # all ranks together sent the weights (in the background) and the gradients (in the switch)
    weights_only, grads_only = sent[0][1], sent[0][2]
    assert sum(r[0] for r in sent) == weights_only + grads_only


def test_greedy_beats_baselines_on_two_nodes(results):
    (summaries, *_) = results["check_plans_are_pure_and_identical_on_all_ranks"].raise_if_failed()
    pairs = {(a, b) for a, b, _ in summaries}
    for a, b in pairs:
        greedy = summaries[(a, b, "greedy")]
        assert greedy["bytes_moved"] == greedy["lower_bound_bytes"], (a, b, greedy)
        # relays: each slice crosses into a node once, however many of its devices need it
        assert greedy["inter_node_bytes"] == greedy["inter_node_lower_bound_bytes"], (a, b, greedy)
        for baseline in ("fcfs", "round_robin"):
            other = summaries[(a, b, baseline)]
            assert greedy["inter_node_bytes"] <= other["inter_node_bytes"], (a, b, baseline)
            assert greedy["max_send_bytes"] <= other["max_send_bytes"], (a, b, baseline)
        assert greedy["bytes_moved"] <= summaries[(a, b, "gather")]["bytes_moved"]
    tp4_to_dp4 = summaries[("tp4", "dp4", "greedy")]  # every device needs the other node's two quarters
    assert tp4_to_dp4["num_relays"] > 0
    assert tp4_to_dp4["inter_node_bytes"] * 2 == summaries[("tp4", "dp4", "fcfs")]["inter_node_bytes"]


def test_plan_order_is_a_cycle(results):
    results["check_plan_order"].raise_if_failed()
