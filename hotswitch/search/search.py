"""Choosing the configs to hot-switch between: TensorOpt's frontier, HotSPa's objective.

For each sequence length, every config of the space (`space.enumerate_configs`) is priced
(`cost.estimate`) and the **Pareto set** in (step time, peak memory per rank) is kept: a config is on
it when no other config is at least as fast with at most its memory (TensorOpt's FT returns this
set, so a job can trade memory for time as resources allow). The **candidate set** is then chosen
from the frontiers: one config per length, minimising the expected step time

    sum over lengths of (that length's share of the step under its config)
    + the cheapest switching cycle through the configs used (`switch.order.plan_order`, each switch
      priced by the planner: `switch.planner.plan_switch` over `cluster.switch_moves`, scaled by the
      calibrated switch rates; the first switch of a step moves weights only, the others weights
      and gradients)
    + the optimizer's step in the base config (each config used is tried as the base, as the Trainer
      does; the most model-parallel one wins ties),

within the memory budget: each config's peak at its lengths plus the optimizer state that the base
keeps resident all step, whole or split over the base's dp ranks (ZeRO-1: less memory, an
all-gather more per step; tried both ways unless the caller fixes it). A config
that is a little faster at one length does not buy a switch that costs more than it saves.
Assignments are tried cheapest compute first and a search stops once compute alone exceeds the best
total, so switch plans are computed only for sets that could win.
"""
from __future__ import annotations

import itertools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hotswitch.distconfig import DistConfig, Topology
from hotswitch.switch.cluster import STATE_BYTES, switch_moves
from hotswitch.switch.order import plan_order
from hotswitch.switch.planner import lower_bound_seconds, plan_switch
from hotswitch.switch.state import StateKind

from .comm import CommProfile
from .cost import Estimate, Hardware, Rates, calibrate, calibrate_switches, estimate, optimizer_seconds
from .space import NoConfigFits, default_base, enumerate_configs, plain
from .workload import Workload, describe_workload

__all__ = ["SearchResult", "pareto_front", "search_configs"]


def pareto_front(estimates: Sequence[Estimate]) -> tuple[Estimate, ...]:
    """The estimates no other one dominates in (seconds, peak_bytes), fastest first. Among equal
    (seconds, bytes) the first listed is kept."""
    front: list[Estimate] = []
    for e in sorted(estimates, key=lambda e: (e.seconds, e.peak_bytes)):
        if not front or e.peak_bytes < front[-1].peak_bytes:
            front.append(e)
    return tuple(front)


@dataclass(frozen=True)
class SearchResult:
    """Every priced config per length (`estimates`), the Pareto set per length (`pareto`, fastest
    first), and the chosen candidate set (`chosen`, with `assignment`: length -> config name, and
    `base`, and `zero1`). `expected_seconds` = `compute_seconds` (the lengths' shares) +
    `switch_seconds` (the cycle through the chosen configs) + `optimizer_seconds`."""

    workload: Workload
    topology: Topology
    tokens: Mapping[int, int]  # tokens of each length per step
    estimates: Mapping[int, tuple[Estimate, ...]]
    pareto: Mapping[int, tuple[Estimate, ...]]
    chosen: tuple[DistConfig, ...]
    assignment: Mapping[int, str]
    base: str
    compute_seconds: float
    switch_seconds: float
    memory_budget_bytes: int | None
    rates: Rates
    pruned: tuple[tuple[str, str], ...] = ()
    search_seconds: float = 0.0
    switch_plans: int = 0
    zero1: bool = False  # whether the base's optimizer state is split over its dp ranks (ZeRO-1)
    notes: tuple[str, ...] = field(default=())
    probes: tuple = ()  # the measured micro-batches the rates were calibrated on (`train.cost_model.Probe`)
    optimizer_seconds: float = 0.0  # the optimizer's step in the base config (`cost.optimizer_seconds`)
    switch_probes: tuple = ()  # the measured switches the switch rates were fitted to
    comm_profiles: Mapping[str, CommProfile] = field(default_factory=dict)  # configs priced by their ExecGraph

    def predicted_probe_seconds(self, probe) -> float:
        """What the calibrated rates predict for a measured micro-batch (`train.cost_model.Probe`)."""
        from .cost import micro_batch_work

        config = DistConfig.parse(probe.config)
        work = micro_batch_work(self.workload, config, probe.length, probe.rows // config.dp, self.topology,
                                comm=self.comm_profiles.get(probe.config))
        return self.rates.seconds(work)

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(self.tokens)

    @property
    def expected_seconds(self) -> float:
        return self.compute_seconds + self.switch_seconds + self.optimizer_seconds

    @property
    def base_optimizer_bytes(self) -> int:
        """What the base's optimizer state adds per rank (split over its dp ranks under ZeRO-1)."""
        base = self.estimate(self.base, self.lengths[0])
        return base.optimizer_bytes // (base.config.dp if self.zero1 else 1)

    def estimate(self, config: str | DistConfig, length: int) -> Estimate:
        name = config if isinstance(config, str) else config.name
        for e in self.estimates[length]:
            if e.name == name:
                return e
        raise KeyError(f"no estimate of {name!r} at length {length}")

    def fastest(self, length: int) -> Estimate:
        """The fastest config at `length` within the budget (as a member of a hot-switched set)."""
        fits = [e for e in self.pareto[length] if _fits(e.peak_bytes, self.memory_budget_bytes)]
        return fits[0]

    def rows(self, frontier_only: bool = True) -> list[dict]:
        """One dict per (length, config): the table's content, for JSON."""
        out = []
        for length in self.lengths:
            front = {e.name for e in self.pareto[length]}
            for e in self.pareto[length] if frontier_only else sorted(self.estimates[length], key=lambda e: e.seconds):
                out.append(dict(length=length, config=e.name, spec=e.config.spec(), seconds=e.seconds,
                                peak_bytes=e.peak_bytes, optimizer_bytes=e.optimizer_bytes, rows=e.rows,
                                micro_batches=e.micro_batches, comm_seconds=e.comm_seconds,
                                bubble_seconds=e.bubble_seconds, pareto=e.name in front,
                                fits=_fits(e.peak_bytes, self.memory_budget_bytes),
                                chosen=self.assignment.get(length) == e.name))
        return out

    def table(self, frontier_only: bool = True) -> str:
        """The frontier per length as text: seconds, peak per rank, the optimizer's extra as base."""
        lines = []
        budget = "no memory budget" if self.memory_budget_bytes is None else \
            f"budget {_bytes(self.memory_budget_bytes)} per rank"
        n = self.rates.calibrated_on
        profiled = self.probes and all(getattr(p, "collectives_free", False) for p in self.probes)
        rates = ("uncalibrated rates" if not n else f"compute rates fitted to {n} micro-batches profiled in a fake "
                 "process group (collectives priced by the hardware's rates)" if profiled
                 else f"rates calibrated on {n} measured micro-batches")
        lines.append(f"{self.workload.name} on {self.topology.num_devices} devices "
                     f"({self.topology.devices_per_node} per node), {budget}; {rates}")
        header = f"{'':2}{'config':<14}{'step share s':>13}{'comm s':>10}{'bubble s':>10}{'peak/rank':>12}" \
                 f"{'+optim':>11}{'mb':>6}"
        for length in self.lengths:
            shown = self.pareto[length] if frontier_only else sorted(self.estimates[length], key=lambda e: e.seconds)
            lines.append(f"\nlength {length}: {self.tokens[length]:,} tokens per step; "
                         f"{len(self.pareto[length])} of {len(self.estimates[length])} configs on the Pareto front")
            lines.append(header)
            for e in shown:
                mark = "->" if self.assignment.get(length) == e.name else \
                    ("  " if _fits(e.peak_bytes, self.memory_budget_bytes) else " x")
                lines.append(f"{mark}{e.name:<14}{e.seconds:>13.4g}{e.comm_seconds:>10.3g}{e.bubble_seconds:>10.3g}"
                             f"{_bytes(e.peak_bytes):>12}{_bytes(e.optimizer_bytes):>11}{e.micro_batches:>6}")
        names = ", ".join(c.name for c in self.chosen)
        lines.append(f"\nchosen: {names} (base {self.base}); expected step {self.expected_seconds:.4g} s = "
                     f"{self.compute_seconds:.4g} s compute + {self.switch_seconds:.4g} s switching + "
                     f"{self.optimizer_seconds:.4g} s optimizer")
        lines.extend(self.notes)
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """Time vs memory per length: every config, the Pareto front as a line, the chosen config
        and the budget marked. Written with matplotlib (Agg) to `path`."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker

        k = len(self.lengths)
        fig, axes = plt.subplots(1, k, figsize=(4.6 * k, 4.2), squeeze=False, layout="constrained")
        top = max(e.peak_bytes for es in self.estimates.values() for e in es)
        unit, scale = ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)
        optimizer = self.base_optimizer_bytes
        for ax, length in zip(axes[0], self.lengths):
            every = self.estimates[length]
            ax.scatter([e.peak_bytes / scale for e in every], [e.seconds for e in every], s=14, c="0.7",
                       label="config")
            front = sorted(self.pareto[length], key=lambda e: e.peak_bytes)
            ax.plot([e.peak_bytes / scale for e in front], [e.seconds for e in front], "o-", c="tab:blue",
                    ms=5, label="Pareto front")
            for e in front:
                ax.annotate(e.name, (e.peak_bytes / scale, e.seconds), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
            chosen = self.estimate(self.assignment[length], length)
            ax.scatter([chosen.peak_bytes / scale], [chosen.seconds], s=90, facecolors="none", edgecolors="tab:red",
                       linewidths=2, label=f"chosen: {chosen.name}", zorder=3)
            if self.memory_budget_bytes is not None:  # what a config may use beside the base's optimizer state
                ax.axvline((self.memory_budget_bytes - optimizer) / scale, ls="--", c="tab:red", lw=1,
                           label=f"budget - {self.base}'s optimizer")
            xs, ys = [e.peak_bytes for e in every], [e.seconds for e in every]
            for axis, values, set_scale in ((ax.xaxis, xs, ax.set_xscale), (ax.yaxis, ys, ax.set_yscale)):
                if max(values) > 8 * min(values):  # log only where the values span a decade
                    set_scale("log")
                    axis.set_major_formatter(ticker.FormatStrFormatter("%g"))
                    axis.set_minor_formatter(ticker.NullFormatter())
            ax.set_xlabel(f"peak memory per rank ({unit})")
            ax.set_ylabel("predicted seconds per step at this length")
            ax.set_title(f"length {length}", fontsize=10)
            ax.legend(fontsize=7)
        fig.suptitle(f"{self.workload.name} on {self.topology.num_devices} devices: chosen "
                     f"{', '.join(c.name for c in self.chosen)}", fontsize=10)
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _fits(peak: int, budget: int | None) -> bool:
    return budget is None or peak <= budget


def _bytes(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def _token_shares(lengths, tokens_per_length: int) -> dict[int, int]:
    if isinstance(lengths, Mapping):
        shares = {int(k): int(v) for k, v in lengths.items()}
    else:
        shares = {int(k): int(tokens_per_length) for k in lengths}
    if not shares:
        raise ValueError("lengths is empty: give the sequence lengths to plan for, e.g. lengths=[64, 256, 1024]")
    bad = {k: v for k, v in shares.items() if k < 1 or v < 1}
    if bad:
        raise ValueError(f"lengths and their token counts must be positive, got {bad}")
    return dict(sorted(shares.items()))


def search_configs(model, example_inputs=None, *, world_size: int | None = None, lengths=None,
                   memory_budget_bytes: int | None = None, topology: Topology | None = None,
                   micro_batch_tokens: int = 2048, tokens_per_length: int | None = None,
                   probes: Sequence = (), hardware: Hardware | None = None, rates: Rates | None = None,
                   switch_probes: Sequence = (), comm_profiles: Mapping[str, CommProfile] | None = None,
                   zero1: bool | None = None, max_assignments: int = 4096,
                   switch_pricing: str | None = None) -> SearchResult:
    """Price every config of the space at each length, keep the Pareto sets, choose the candidates.

    `model`: an nn.Module (a built-in GPT or a Hugging Face causal LM), a cluster model name such as
    "gpt3-175b", or a `Workload`. `example_inputs`: only read for the default length (the inputs'
    second dim). `lengths`: a list of lengths (each `tokens_per_length` tokens per step, default
    `micro_batch_tokens` x devices) or a dict {length: tokens per step}. `memory_budget_bytes`: per
    rank. `topology`: devices and bandwidths (default `world_size` devices on one node).
    `probes`: measured micro-batches (`train.cost_model.Probe`, e.g. `Trainer.cost.probes.values()`)
    that calibrate the rates; without them `hardware` (default an H100; `Hardware.cpu()` for gloo)
    sets them, or pass `rates` directly. `switch_probes`: measured switches (`train.cost_model.SwitchProbe`)
    that calibrate what a switch costs beyond the planner's transfer estimate. `comm_profiles`:
    config name -> the collectives its compiled ExecGraph issues (`search.comm.comm_profile`), priced
    instead of Megatron's rules for those configs. `zero1`: shard the
    base's optimizer state over its dp ranks (True), never (False), or whichever is cheaper within the
    budget (None, the default; `result.zero1` says which). `switch_pricing`: "greedy" prices a switch by the estimate
    of the plan the runtime executes (the planner's greedy), "lower_bound" by the planner's
    algorithm-independent bound (vectorized: the greedy loop is seconds per plan at 1024 devices,
    where greedy stays within 1-2.3x of the bound); default greedy up to 256 devices. Pure: no
    process group, nothing runs.
    """
    t0 = time.perf_counter()
    workload = describe_workload(model)
    if topology is None:
        if world_size is None:
            raise ValueError("give world_size (number of devices) or a topology")
        topology = Topology(world_size, world_size)
    elif world_size is not None and world_size != topology.num_devices:
        raise ValueError(f"world_size={world_size} but the topology has {topology.num_devices} devices")
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be positive, got {micro_batch_tokens}")
    if lengths is None:
        if not example_inputs:
            raise ValueError("give lengths=[...] (or example inputs whose second dim is the length)")
        lengths = [int(example_inputs[0].shape[1])]
    shares = _token_shares(lengths, tokens_per_length or micro_batch_tokens * topology.num_devices)
    space = enumerate_configs(workload, topology)
    if not space.configs:
        raise ValueError(f"no config of {topology.num_devices} devices can run {workload.name}: "
                         + "; ".join(f"{n}: {r}" for n, r in space.pruned[:6]))
    base_rates = rates or Rates.from_hardware(hardware or Hardware())
    comm = dict(comm_profiles or {})
    if probes:
        base_rates = calibrate(workload, topology, probes, {c.name: c for c in space.configs}, base_rates, comm)
    pruned = list(space.pruned)
    estimates: dict[int, tuple[Estimate, ...]] = {}
    for length, tokens in shares.items():
        priced = []
        for c in space.configs:
            if length % c.sequence_shards:
                pruned.append((c.name, f"length {length} is not a multiple of {c.sequence_shards} (the sequence's "
                                       "shards under SP or CP)"))
                continue
            priced.append(estimate(workload, c, length, tokens, topology, base_rates,
                                   micro_batch_tokens=micro_batch_tokens,
                                   comm=comm.get(c.name) or comm.get(plain(c).name)))
        if not priced:
            raise ValueError(f"no config can run length {length}; use lengths that are multiples of the tp degrees")
        estimates[length] = tuple(priced)
    pareto = {length: pareto_front(es) for length, es in estimates.items()}
    if switch_pricing is None:
        switch_pricing = "greedy" if topology.num_devices <= 256 else "lower_bound"
    if switch_pricing not in ("greedy", "lower_bound"):
        raise ValueError(f"switch_pricing must be 'greedy' or 'lower_bound', got {switch_pricing!r}")
    chooser = _Chooser(workload, topology, memory_budget_bytes, switch_pricing, base_rates, space.configs, zero1)
    known = {c.name for c in space.configs}
    switch_probes = [p for p in switch_probes if p.source in known and p.destination in known]
    if switch_probes:
        chooser.rates = base_rates = calibrate_switches(
            base_rates, [(chooser.planned_seconds(p.source, p.destination, not p.with_grads), p.seconds)
                         for p in switch_probes])
    best = chooser.choose(pareto, max_assignments)
    configs = {c.name: c for c in space.configs}
    chosen = tuple(configs[n] for n in dict.fromkeys([best.base, *best.assignment.values()]))
    how = "the planner's greedy plans" if switch_pricing == "greedy" else "the planner's lower bound"
    fitted = f", calibrated on {len(switch_probes)} measured switches" if switch_probes else ""
    notes = [f"switches priced by {how} ({chooser.plans} config pairs planned{fitted}): "
             f"{base_rates.per_switch * 1e3:.3g} ms + {base_rates.switch_scale:.3g} x the plan's transfer time"]
    if comm:
        read = ", ".join(n for n in configs if n in comm)
        rest = ", ".join(n for n in configs if n not in comm)
        notes.append(f"communication of {read} from the collectives of their ExecGraphs"
                     + (f"; of {rest} from Megatron's rules" if rest else ""))
    if configs[best.base].dp > 1:
        notes.append(f"ZeRO-1 {'on' if best.zero1 else 'off'}: the optimizer state "
                     f"{f'is split over {best.base} dp={configs[best.base].dp} ranks' if best.zero1 else 'is whole'}"
                     f"{'' if zero1 is None else ' (as asked)'}")
    return SearchResult(workload, topology, shares, estimates, pareto, chosen, best.assignment, best.base,
                        best.compute, best.switching, memory_budget_bytes, base_rates, tuple(pruned),
                        time.perf_counter() - t0, chooser.plans, best.zero1, tuple(notes), tuple(probes),
                        optimizer_seconds=best.optimizer, switch_probes=tuple(switch_probes), comm_profiles=comm)


@dataclass(frozen=True, slots=True)
class _Choice:
    compute: float
    switching: float
    optimizer: float
    assignment: dict
    base: str
    zero1: bool

    @property
    def total(self) -> float:
        return self.compute + self.switching + self.optimizer


class _Chooser:
    """One config per length from the Pareto sets: least compute + switching cycle + the optimizer's
    step within the budget, with ZeRO-1 on or off (`zero1=None`: whichever is cheaper and fits)."""

    def __init__(self, workload: Workload, topology: Topology, budget: int | None, pricing: str, rates: Rates,
                 configs: Sequence[DistConfig], zero1: bool | None):
        self.workload, self.topology, self.budget, self.pricing = workload, topology, budget, pricing
        self.rates, self.zero1 = rates, zero1
        self._planned: dict[tuple[str, str, bool], float] = {}
        self._configs = {c.name: c for c in configs}
        self.plans = 0

    def planned_seconds(self, a: str, b: str, first: bool) -> float:
        """The planner's estimate of switching a -> b on the Topology's links: weights only for the
        first switch of a step, else weights and fp32 gradients. The bound is linear in bytes and
        gradients have their parameter's layout, so the bound with gradients is the weights' bound
        times (e + 4) / e: one plan per pair, not two."""
        linear = self.pricing == "lower_bound"
        key = (a, b, first or linear)
        if key not in self._planned:
            moves = switch_moves(self.workload.model, self._configs[a], self._configs[b], self.topology.num_devices,
                                 dtype_bytes=self.workload.compute_bytes, with_grads=not key[2])
            if linear:
                self._planned[key] = lower_bound_seconds(moves, self.topology)
            else:
                self._planned[key] = plan_switch(moves, self.topology, "greedy").estimated_seconds
            self.plans += 1
        e = self.workload.compute_bytes
        return self._planned[key] * (1 if first or not linear else (e + STATE_BYTES[StateKind.GRAD]) / e)

    def switch_seconds(self, a: str, b: str, first: bool) -> float:
        return self.rates.switch_seconds(self.planned_seconds(a, b, first))

    def zero1_options(self, base: DistConfig) -> tuple[bool, ...]:
        if base.dp == 1 or base.fsdp:
            return (False,)  # nothing to split the optimizer state over (fsdp: split already)
        return (False, True) if self.zero1 is None else (self.zero1,)

    def choose(self, pareto: Mapping[int, tuple[Estimate, ...]], max_assignments: int) -> _Choice:
        options = {}
        for length, front in pareto.items():
            fits = [e for e in front if _fits(e.peak_bytes, self.budget)]
            if not fits:
                least = min(front, key=lambda e: e.peak_bytes)
                raise NoConfigFits(
                    f"no config fits length {length} within {_bytes(self.budget)} per rank: the least memory is "
                    f"{least.name} with {_bytes(least.peak_bytes)}; raise the budget, use more devices or shorter "
                    "micro-batches")
            options[length] = fits
        lengths = list(options)
        if math.prod(len(o) for o in options.values()) > max_assignments:  # HotSPa's rule: fastest each
            options = {length: o[:1] for length, o in options.items()}
        candidates = sorted(itertools.product(*options.values()), key=lambda es: sum(e.seconds for e in es))
        best: _Choice | None = None
        for es in candidates:
            compute = sum(e.seconds for e in es)
            if best is not None and compute >= best.total:
                break  # switching and the optimizer cost >= 0: nothing later can win
            used = list(dict.fromkeys(e.config for e in es))
            first = default_base(used)  # wins ties: the least optimizer memory
            for base in [first, *(c for c in used if c != first)]:
                cycle = None
                for zero1 in self.zero1_options(base):
                    optimizer = self._optimizer_bytes(base, pareto) // (base.dp if zero1 else 1)
                    if not all(_fits(e.peak_bytes + optimizer, self.budget) for e in es):
                        continue  # the base's optimizer state does not leave room for some length's config
                    if cycle is None:
                        cycle = plan_order([c.name for c in used], self.switch_seconds, base=base.name).cost
                    step = optimizer_seconds(self.workload, base, self.topology, self.rates, zero1=zero1)
                    choice = _Choice(compute, cycle, step, {length: e.name for length, e in zip(lengths, es)},
                                     base.name, zero1)
                    if best is None or choice.total < best.total - 1e-15:
                        best = choice
        if best is None:
            hint = "raise the budget or use ZeRO-1 (zero1=True)" if self.zero1 is False else "raise the budget"
            raise NoConfigFits(
                f"no set of configs fits within {_bytes(self.budget)} per rank once the base config's optimizer "
                f"state (fp32 masters and Adam moments) is counted; {hint}")
        return best

    @staticmethod
    def _optimizer_bytes(base: DistConfig, pareto) -> int:
        for front in pareto.values():
            for e in front:
                if e.config == base:
                    return e.optimizer_bytes
        raise AssertionError(f"base {base.name} has no estimate")
