"""hotswitch.search without processes: the space, the cost model against torch's FLOP counter, the
Pareto sets, the choice under a budget and under switching costs, calibration, the CLI."""
import dataclasses
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from hotswitch.cli import main
from hotswitch.distconfig import DistConfig, Topology
from hotswitch.models import PackedCausalLMLoss, build_hf_model, build_model
from hotswitch.search import (
    Hardware,
    Rates,
    Workload,
    calibrate,
    describe_workload,
    enumerate_configs,
    pareto_front,
    search_configs,
)
from hotswitch.search.auto import calibration_configs, default_lengths
from hotswitch.search.cost import calibrate_switches, micro_batch_work, optimizer_seconds
from hotswitch.search.search import default_base
from hotswitch.switch.cluster import ModelConfig, switch_moves
from hotswitch.switch.order import plan_order
from hotswitch.switch.planner import plan_switch
from hotswitch.switch.simulate import gpu_cluster
from hotswitch.train.cost_model import NoConfigFits, Probe, SwitchProbe


def _meta_model(name, **overrides):
    with torch.device("meta"):
        return build_model(name, **overrides)


@pytest.mark.parametrize("name", ["gpt-small", "gpt2-23m"])
def test_flops_equal_torch_flop_counter(name):
    """The FLOPs of one forward + backward equal torch.utils.flop_counter's on the real module (attention
    in the math kernel, as the compiler traces it): GQA, SwiGLU, GELU, an untied head all counted."""
    torch.manual_seed(0)
    model = build_model(name)
    ids = torch.randint(0, model.cfg.vocab_size, (3, 48))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(ids, ids).backward()
    work = micro_batch_work(describe_workload(model), DistConfig.parse("dp1"), 48, 3, Topology(1, 1))
    assert work.flops == pytest.approx(counter.get_total_flops(), rel=1e-9)


def test_tensor_parallel_divides_all_but_the_replicated_head():
    """Under tp the blocks' FLOPs divide by tp; the compiler's replicated LM head does not."""
    w = describe_workload(_meta_model("gpt-small"))  # 8 heads, 4 kv heads
    one = micro_batch_work(w, DistConfig.parse("dp1"), 64, 4, Topology(4, 4))
    head = 3 * 2 * 4 * 64 * w.model.hidden * w.model.vocab_size
    tp4 = micro_batch_work(w, DistConfig.parse("tp4"), 64, 4, Topology(4, 4))
    assert tp4.flops == pytest.approx((one.flops - head) / 4 + head, rel=1e-9)
    sharded = micro_batch_work(dataclasses.replace(w, head_sharded=True), DistConfig.parse("tp4"), 64, 4,
                               Topology(4, 4))
    assert sharded.flops == pytest.approx(one.flops / 4, rel=1e-9)


def test_space_is_pruned_by_heads_nodes_and_layers():
    odd = Workload("odd", ModelConfig("llama2", 2, 384, 12, 1024, 1000, n_kv_heads=4))  # 12 heads, 4 kv, 2 layers
    space = enumerate_configs(odd, Topology(8, 4))
    names = {c.name for c in space.configs}
    pruned = dict(space.pruned)
    assert "dp2tp4" in names and "dp4tp2sp" in names and "dp2tp2pp2" in names
    assert "tp8" in pruned and "node" in pruned["tp8"]  # a tp group across nodes
    assert "tp2pp4" in pruned and "pp" in pruned["tp2pp4"]  # 4 stages of a 2-layer model
    gqa = Workload("gqa", ModelConfig("llama2", 4, 384, 12, 1024, 1000, n_kv_heads=2))
    assert "tp4" in {c.name for c in enumerate_configs(gqa, Topology(4, 4)).configs}  # kv heads replicated
    assert "kv" in dict(enumerate_configs(gqa, Topology(3, 3)).pruned)["tp3"]  # 3 and 2 kv heads do not divide
    trainer_space = enumerate_configs(describe_workload(_meta_model("gpt-small")), Topology(4, 4))
    assert {c.name for c in trainer_space.plain} == {"dp4", "dp2tp2", "dp2tp2sp", "tp4", "tp4sp"}
    # each with recomputation none, selective or full, and with fsdp where dp > 1
    variants = {c.name for c in trainer_space.configs} - {c.name for c in trainer_space.plain}
    assert {"dp4-sel", "dp4-full", "fsdp4", "fsdp4-full", "fsdp2tp2sp-sel", "tp4sp-full"} <= variants
    assert len(trainer_space.configs) == 3 * (2 * 3 + 2)  # dp4, dp2tp2, dp2tp2sp with fsdp or not; tp4, tp4sp


def test_pareto_front_keeps_exactly_the_undominated():
    result = search_configs("gpt3-13b", topology=gpu_cluster(64, 8), lengths=[2048, 8192])
    for length, every in result.estimates.items():
        front = result.pareto[length]
        assert front == pareto_front(every)
        assert [e.seconds for e in front] == sorted(e.seconds for e in front)
        for e in every:
            dominated = any(o.seconds <= e.seconds and o.peak_bytes <= e.peak_bytes
                            and (o.seconds, o.peak_bytes) != (e.seconds, e.peak_bytes) for o in every)
            assert (e in front) != dominated or any(
                (o.seconds, o.peak_bytes) == (e.seconds, e.peak_bytes) for o in front), e.name


def test_budget_moves_long_lengths_to_less_memory():
    """Without a budget the fastest config runs everything; a budget below its peak at the longest
    length (optimizer of the base included) makes the search pick a second config there."""
    model = _meta_model("gpt-small")
    free = search_configs(model, world_size=4, lengths=[64, 512], hardware=Hardware.cpu())
    fastest = free.assignment[512]
    assert free.assignment[64] == fastest and [c.name for c in free.chosen] == [fastest]
    peak = free.estimate(fastest, 512).standalone_bytes
    budget = int(0.8 * peak)
    tight = search_configs(model, world_size=4, lengths=[64, 512], memory_budget_bytes=budget,
                           hardware=Hardware.cpu())
    assert tight.assignment[512] != fastest
    optimizer = tight.estimate(tight.base, 512).optimizer_bytes
    for length, name in tight.assignment.items():
        assert tight.estimate(name, length).peak_bytes + optimizer <= budget
        assert tight.estimate(name, length) in tight.pareto[length]
    assert tight.expected_seconds >= free.expected_seconds
    assert "->" in tight.table()
    with pytest.raises(NoConfigFits, match="no config fits length"):
        search_configs(model, world_size=4, lengths=[64, 512], memory_budget_bytes=2**20)


def test_switching_cost_can_keep_one_config():
    """HotSPa's objective: a config a little faster at one length is not worth a switch that costs more.
    Small steps: the two lengths' fastest configs differ, but one config runs both, and that is right
    (the planner's cycle through the two costs more than it saves). Large steps: switching pays."""
    topo = gpu_cluster(16, 8)
    small = search_configs("gpt3-6.7b", topology=topo, lengths={2048: 2**15, 32768: 2**15})
    fastest = {length: small.fastest(length) for length in small.lengths}
    assert fastest[2048].name != fastest[32768].name
    assert len(small.chosen) == 1 and small.switch_seconds == 0
    saved = small.compute_seconds - sum(e.seconds for e in fastest.values())
    assert saved > 0  # it gave up compute time ...
    configs = {e.name: e.config for e in fastest.values()}
    base = default_base(list(configs.values())).name

    def switch(a, b, first):
        moves = switch_moves("gpt3-6.7b", configs[a], configs[b], 16, with_grads=not first)
        return small.rates.switch_seconds(plan_switch(moves, topo).estimated_seconds)

    assert plan_order(list(configs), switch, base=base).cost > saved  # ... because switching costs more
    large = search_configs("llama2-7b", topology=topo, lengths={2048: 2**18, 32768: 2**18})
    assert large.assignment == {length: large.fastest(length).name for length in large.lengths}
    assert len(large.chosen) == 2 and large.switch_seconds > 0 and large.switch_plans >= 2


def test_calibration_recovers_the_rates_that_made_the_measurements():
    """Probes generated from known rates (6 micro-batches of 3 configs at 2 lengths): the fitted rates
    predict the other configs' times, and the measured peaks, as the known ones do."""
    w = describe_workload(_meta_model("gpt-small"))
    topo = Topology(4, 4)
    latency = Hardware.cpu().collective_latency  # the fit scales bandwidth and latency terms together
    truth = Rates(per_flop=2e-11, per_byte=3e-10, per_comm_second=40.0, per_collective=40 * latency,
                  per_micro_batch=0.01,
                  activation_scale=2.5, head_activation_scale=0.7, graph_grad_scale=3.0)
    space = {c.name: c for c in enumerate_configs(w, topo).configs}
    measured = calibration_configs(list(space.values()))
    assert [c.name for c in measured] == ["dp4", "tp4sp", "dp2tp2"]
    probes = []
    for c in measured:
        for length in (64, 512):
            rows = c.dp * max(1, 1024 // length)
            work = micro_batch_work(w, c, length, rows // c.dp, topo)
            params = _params(w, c)
            state = params * (4 + 4)
            graph = truth.graph_grad_scale * params * 4 + truth.activation_scale * work.activation_bytes \
                + truth.head_activation_scale * work.head_activation_bytes
            probes.append(Probe(c.name, length, rows, truth.seconds(work), int(state + graph), state))
    fitted = calibrate(w, topo, probes, space, Rates.from_hardware(Hardware.cpu()))
    assert fitted.calibrated_on == 6
    for name in ("dp2tp2sp", "tp4"):
        for length in (128, 256):
            work = micro_batch_work(w, space[name], length, max(1, 1024 // length), topo)
            assert fitted.seconds(work) == pytest.approx(truth.seconds(work), rel=1e-6)
    assert fitted.activation_scale == pytest.approx(2.5, rel=1e-3)
    assert fitted.graph_grad_scale == pytest.approx(3.0, rel=1e-3)


def _params(w, config):
    from hotswitch.search.cost import params_per_rank

    return params_per_rank(w, config.tp, config.pp)


def test_cluster_scale_frontier_for_three_lengths():
    """Planning only: GPT-3 175B on 1024 GPUs (8 per node) at three lengths."""
    result = search_configs("gpt3-175b", topology=gpu_cluster(1024, 8), lengths=[2048, 8192, 32768])
    assert set(result.pareto) == {2048, 8192, 32768}
    for length, front in result.pareto.items():
        assert front and all(e.config.tp <= 8 and e.config.world_size == 1024 for e in front)
    assert result.chosen and set(result.assignment.values()) <= {c.name for c in result.chosen}
    assert math.isfinite(result.expected_seconds)


def test_default_lengths_and_workloads():
    assert default_lengths(512) == [64, 176, 512] and default_lengths(256, 32) == [128, 192, 256]
    tiny = describe_workload(PackedCausalLMLoss(build_model("gpt-tiny")))
    assert tiny.model.kv_heads == 2 and tiny.compute_bytes == 4 and not tiny.head_sharded and not tiny.pipeline
    llama = describe_workload(build_hf_model("llama"))  # HFCausalLMLoss(LlamaForCausalLM)
    assert (llama.model.family, llama.model.n_layers, llama.model.kv_heads, llama.model.ffn_hidden) == \
        ("llama2", 2, 2, 160)
    gpt2 = describe_workload(build_hf_model("gpt2"))
    assert gpt2.model.family == "gpt3" and gpt2.model.ffn_hidden == 4 * 64 and gpt2.model.tied_embeddings
    with pytest.raises(ValueError, match="cannot read a transformer shape"):
        describe_workload(torch.nn.Linear(2, 2))


def test_cli_prints_the_frontier_and_draws_it(tmp_path, capsys):
    png = tmp_path / "front.png"
    assert main(["configs", "--model", "gpt-tiny", "--world-size", "4", "--lengths", "64,256",
                 "--memory-budget-mib", "400", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "length 64" in out and "length 256" in out and "Pareto front" in out and "chosen:" in out
    assert png.stat().st_size > 10_000
    with pytest.raises(SystemExit, match="no config fits"):
        main(["configs", "--model", "gpt-tiny", "--world-size", "4", "--lengths", "256", "--memory-budget-mib", "1",
              "--plot", ""])


def test_bound_only_pricing_equals_the_plans_bound():
    """The search prices switches at cluster scale by the planner's lower bound, computed without a plan."""
    from hotswitch.switch.planner import lower_bound_seconds

    topo = gpu_cluster(64, 8)
    for src, dst in (("dp8tp8", "dp4tp2pp8"), ("dp2tp8pp4sp", "dp16tp4"), ("tp8pp8", "dp64")):
        moves = switch_moves("gpt3-13b", DistConfig.parse(src), DistConfig.parse(dst), 64, with_grads=True)
        assert lower_bound_seconds(moves, topo) == plan_switch(moves, topo, "fcfs").lower_bound_seconds > 0


def test_parameters_per_rank_equal_the_layouts():
    """The memory model's parameter count per rank is the busiest device's under the cluster model's
    layouts (Megatron's: tied embedding in the first and last stage), and the module's own count."""
    from hotswitch.search.cost import params_per_rank
    from hotswitch.switch.cluster import layouts

    model = build_model("gpt-small")
    assert params_per_rank(describe_workload(model), 1, 1) == sum(p.numel() for p in model.parameters())
    gpt3 = describe_workload("gpt3-1.3b")
    for spec in ("dp2tp4pp2", "tp8pp2", "dp4tp2pp2", "dp16"):
        config = DistConfig.parse(spec)
        per_device = [0] * 16
        for layout in layouts("gpt3-1.3b", config, 16).values():
            for d in layout.mesh.devices:
                per_device[d] += layout.numel(d)
        assert params_per_rank(gpt3, config.tp, config.pp) == max(per_device), spec


def test_switch_rates_fitted_to_measured_switches_change_the_choice():
    """Switch prices come from measured switches (on gloo a fixed cost dominates; the planner's
    estimate on the Topology's links is microseconds): the fit recovers a known fixed cost and scale,
    and the same frontiers give one config when switches are measured slow, two when they are fast."""
    rates = Rates.from_hardware(Hardware.cpu())
    pairs = [(planned, 0.03 + 40 * planned) for planned in (1e-5, 4e-5, 2e-4)]
    fitted = calibrate_switches(rates, pairs)
    assert fitted.per_switch == pytest.approx(0.03) and fitted.switch_scale == pytest.approx(40)
    assert fitted.switches_calibrated_on == 3
    assert calibrate_switches(rates, [(1e-5, 0.05)]).per_switch == pytest.approx(0.05 - 1e-5)
    assert calibrate_switches(rates, []) is rates

    # attention scores kept (the math kernel): the long rows outgrow pure DP's memory, the short do not
    model = dataclasses.replace(describe_workload(_meta_model("gpt-small")), fused_attention=False)
    kwargs = dict(world_size=4, lengths={64: 2**14, 1024: 2**14}, hardware=Hardware.cpu(), zero1=False,
                  memory_budget_bytes=700 * 2**20)  # dp4 fits the short rows only
    free = search_configs(model, **kwargs)
    fastest = {free.fastest(length).name for length in free.lengths}
    assert len(fastest) == 2  # the lengths' fastest configs differ

    def measured(seconds):
        return [SwitchProbe(a, b, seconds) for a in fastest for b in fastest if a != b]

    fast = search_configs(model, **kwargs, switch_probes=measured(1e-4))
    slow = search_configs(model, **kwargs, switch_probes=measured(100.0))
    assert fast.rates.switches_calibrated_on == 2 and fast.rates.per_switch == pytest.approx(1e-4, rel=0.01)
    assert {c.name for c in fast.chosen} == fastest and fast.switch_seconds > 0
    assert len(slow.chosen) == 1 and slow.switch_seconds == 0
    assert slow.compute_seconds > fast.compute_seconds
    assert "calibrated on 2 measured switches" in slow.table()


def test_zero1_is_chosen_only_where_it_pays_or_is_needed():
    """ZeRO-1 is a dimension of the space: under a budget that only a split optimizer state meets it is
    on (and every chosen config fits beside the split state), off when asked, and the optimizer's
    step is in the expected time either way."""
    model = _meta_model("gpt-small")
    topo = Topology(4, 4)
    kwargs = dict(world_size=4, lengths=[64, 256], hardware=Hardware.cpu())
    free = search_configs(model, **kwargs)
    base = DistConfig.parse(free.base)
    w = describe_workload(model)
    assert free.optimizer_seconds == pytest.approx(optimizer_seconds(w, base, topo, free.rates, zero1=free.zero1))
    assert free.expected_seconds == pytest.approx(free.compute_seconds + free.switch_seconds + free.optimizer_seconds)
    whole = search_configs(model, **kwargs, zero1=False)
    # a budget between "the chosen configs beside a split state" and "beside the whole state"
    peaks = max(whole.estimate(n, length).peak_bytes for length, n in whole.assignment.items())
    optimizer = whole.estimate(whole.base, 64).optimizer_bytes
    dp = DistConfig.parse(whole.base).dp
    assert dp > 1
    budget = peaks + optimizer // dp + optimizer // (4 * dp)
    tight = search_configs(model, **kwargs, memory_budget_bytes=budget)
    assert tight.zero1 and "ZeRO-1 on" in tight.table() and tight.assignment == whole.assignment
    split = tight.base_optimizer_bytes
    assert split == tight.estimate(tight.base, 64).optimizer_bytes // DistConfig.parse(tight.base).dp
    for length, name in tight.assignment.items():
        assert tight.estimate(name, length).peak_bytes + split <= budget
    # without ZeRO-1 the same budget needs more model-parallel configs: a slower step
    off = search_configs(model, **kwargs, zero1=False, memory_budget_bytes=budget)
    assert not off.zero1 and off.assignment != whole.assignment
    assert off.expected_seconds > tight.expected_seconds


def test_comm_profile_prices_activations_by_tokens_and_gradients_once():
    """A config's ExecGraph collectives (`search.comm`): an activation's scale with the micro-batch's
    tokens, a gradient reduction's do not; ring bytes per kind; a group that leaves the node is priced
    on the inter-node link; `micro_batch_work` prices them instead of the rules."""
    from hotswitch.search.comm import Collective, CommProfile, ring_bytes

    assert ring_bytes("all_reduce", 100, 4) == 150 and ring_bytes("all_gather", 100, 4) == 300
    assert ring_bytes("reduce_scatter", 100, 4) == 75 and ring_bytes("all_reduce", 100, 1) == 0
    topo = Topology(8, 4, intra_node_bandwidth=100.0, inter_node_bandwidth=10.0)
    grads = CommProfile("dp8", 1024, (Collective("all_reduce", 800, 8, 8, per_token=False),))
    acts = CommProfile("tp4", 1024, (Collective("all_reduce", 400, 4, 4, per_token=True),))
    assert grads.seconds(1024, topo) == grads.seconds(4096, topo) == pytest.approx(2 * 7 / 8 * 800 / 10.0)
    assert acts.seconds(2048, topo) == pytest.approx(2 * acts.seconds(1024, topo)) == pytest.approx(2 * 600 / 100.0)
    w = describe_workload(_meta_model("gpt-small"))
    config = DistConfig.parse("dp2tp4")
    work = micro_batch_work(w, config, 256, 4, topo, comm=acts)
    assert work.comm_seconds == pytest.approx(acts.seconds(1024, topo)) and work.collectives == 1
    rules = micro_batch_work(w, config, 256, 4, topo)
    assert (work.flops, work.activation_bytes) == (rules.flops, rules.activation_bytes)
    assert rules.collectives > 1


@pytest.mark.slow  # spawns one process per config
def test_profiled_planning_on_one_device():
    """`hotswitch configs --profile`: each config's rank 0 timed in a fake process group (collectives
    free), its ExecGraph's collectives read off; the compute rates are fitted to those times and the
    collective rates kept as the hardware's."""
    import functools

    from hotswitch.train.profiled import profile_space

    model = build_model("gpt-tiny")
    w = describe_workload(model)
    topo = Topology(2, 2)
    probes, comm = profile_space(functools.partial(build_model, "gpt-tiny"), w, topo, [32], 1024, repeats=1)
    assert sorted(p.config for p in probes) == ["dp2", "tp2", "tp2sp"] and set(comm) == {"dp2", "tp2", "tp2sp"}
    assert all(p.collectives_free and p.seconds > 0 and p.peak_bytes > p.state_bytes > 0 for p in probes)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    dp2 = comm["dp2"].collectives
    assert all(c.kind == "all_reduce" and c.group_size == 2 and not c.per_token for c in dp2)
    assert 0 <= sum(c.nbytes for c in dp2) - params <= 64  # every gradient once (+ the loss's two scalars)
    assert any(c.per_token for c in comm["tp2sp"].collectives)
    hardware = Hardware.cpu()
    result = search_configs(model, topology=topo, lengths=[32], micro_batch_tokens=1024, hardware=hardware,
                            probes=probes, comm_profiles=comm)
    default = Rates.from_hardware(hardware)
    assert result.rates.calibrated_on == 3 and "profiled in a fake process group" in result.table()
    assert (result.rates.per_comm_second, result.rates.per_collective) == (default.per_comm_second,
                                                                           default.per_collective)
    with pytest.raises(SystemExit, match="--profile runs every config's rank on this machine"):
        main(["configs", "--model", "gpt3-175b", "--devices", "64", "--profile", "--plot", ""])


def test_a_long_length_chooses_recomputation_over_more_tensor_parallelism():
    """Llama-2-7B on 8 GPUs, 4K and 32K tokens, 100 GiB per rank: at 32K every plain config that fits
    shards more over tp and is slower than recomputing (with fsdp) at tp 2."""
    from hotswitch.search.space import plain

    budget = 100 * 2**30
    r = search_configs("llama2-7b", topology=Topology(8, 8), lengths={4096: 8 * 4096 * 8, 32768: 8 * 32768},
                       memory_budget_bytes=budget, micro_batch_tokens=8192)
    chosen = r.estimate(r.assignment[32768], 32768)
    assert chosen.config.recompute != "none", r.assignment
    fits = [e for e in r.estimates[32768]
            if plain(e.config) is e.config and e.peak_bytes + r.base_optimizer_bytes <= budget]
    assert fits and all(e.seconds > chosen.seconds and e.config.tp > chosen.config.tp for e in fits), \
        [(e.name, e.seconds) for e in fits]
