"""Which config runs which length bucket: measured step times and memory, a budget, a search.

A `Probe` is one config measured at one bucket length (a `SwitchProbe`, one switch between two):
the seconds of one micro-batch of its compiled shape (rows x length, the slowest rank, median of a
few runs) and the peak bytes per rank (resident state plus the ExecGraph's peak of intermediate
values, `compiler.memory`). A bucket whose packing needs R rows then costs ceil(R / rows)
micro-batches under that config, so the time of any token count at a profiled length follows from
the probe. A config fits a bucket when its
peak stays within the per-rank budget; configs that do not fit are never run.

`assign` picks one config per bucket. With few buckets and configs it searches every assignment
for the least (sum of bucket times + the estimated switching cycle through the configs used), so a
bucket that is barely faster elsewhere does not buy an extra switch; beyond that it takes each
bucket's fastest fitting config (HotSPa's rule).

`choose` also picks the base, the config that holds the fp32 masters and AdamW's moments and where
the step ends for the optimizer: every candidate base (with ZeRO-1 on or off) prices its own
assignment, with the optimizer's bytes added to that config's resident state, and the cheapest
wins. When every bucket prefers one config and it can hold the optimizer, that config is the base
and a step does not switch at all.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hotswitch.search.space import NoConfigFits


@dataclass(frozen=True)
class Probe:
    config: str
    length: int
    rows: int  # rows of one micro-batch (all data-parallel replicas together)
    seconds: float | None  # one micro-batch, forward + backward; None if not run (does not fit)
    peak_bytes: int  # per rank, the largest over ranks
    state_bytes: int  # of which resident state (weights, gradient accumulators, optimizer)
    collectives_free: bool = False  # timed in a fake process group (`runtime.profile`): compute only

    def peak_with(self, state_bytes: int | None) -> int:
        """The peak with `state_bytes` of resident state instead of the state it was measured with
        (another base holds the optimizer); None: as measured."""
        return self.peak_bytes if state_bytes is None else self.peak_bytes - self.state_bytes + state_bytes

    def fits(self, budget: int | None, state_bytes: int | None = None) -> bool:
        return budget is None or self.peak_with(state_bytes) <= budget


@dataclass(frozen=True)
class SwitchProbe:
    """One switch between configs measured between steps (weights only): the slowest rank's seconds."""

    source: str
    destination: str
    seconds: float
    with_grads: bool = False


@dataclass(frozen=True)
class BucketDemand:
    length: int  # the bucket's row length (its upper bound)
    rows: int  # packed rows it needs


@dataclass(frozen=True)
class Base:
    """Where the optimizer lives: a config, with its moments split over its dp ranks or not (ZeRO-1)."""

    config: str
    zero1: bool = False


class CostModel:
    def __init__(self, memory_budget_bytes: int | None = None):
        self.memory_budget_bytes = memory_budget_bytes
        self.probes: dict[tuple[str, int], Probe] = {}

    def add(self, probe: Probe) -> None:
        self.probes[(probe.config, probe.length)] = probe

    def has(self, config: str, length: int) -> bool:
        """Profiled already (a probe skipped for memory counts only while it still does not fit)."""
        probe = self.probes.get((config, length))
        return probe is not None and (probe.seconds is not None or not probe.fits(self.memory_budget_bytes))

    def micro_batches(self, config: str, demand: BucketDemand) -> int:
        return math.ceil(demand.rows / self.probes[(config, demand.length)].rows)

    def seconds(self, config: str, demand: BucketDemand, state_bytes: int | None = None) -> float:
        """Estimated seconds for the bucket under `config` (inf if it does not fit); `state_bytes`:
        the config's resident state if not the one it was profiled with (see `Probe.peak_with`)."""
        probe = self.probes[(config, demand.length)]
        if not probe.fits(self.memory_budget_bytes, state_bytes) or probe.seconds is None:
            return math.inf
        return self.micro_batches(config, demand) * probe.seconds

    def choose(self, demands: Sequence[BucketDemand], configs: Sequence[str], bases: Sequence[Base],
               cycle_seconds: Callable[[frozenset[str], str], float], state_bytes: Callable[[str, Base], int],
               fixed: Sequence[str] | None = None, max_search: int = 4096) -> tuple[list[str], Base]:
        """(one config per bucket, the base): the least bucket time + switching cycle within the
        budget over every base in `bases` (first wins ties). `cycle_seconds(used, base)`: the step's
        cycle from `base` through `used`; `state_bytes(config, base)`: a config's resident bytes per
        rank when `base` holds the optimizer; `fixed`: the assignment, when it is given (only the
        base is chosen)."""
        best, best_cost, error = None, math.inf, None
        for base in bases:
            states = {c: state_bytes(c, base) for c in configs}
            try:
                chosen = list(fixed) if fixed is not None else self.assign(
                    demands, configs, lambda used: cycle_seconds(used, base.config), max_search, states)
            except NoConfigFits as e:
                error = error or e
                continue
            if self.memory_budget_bytes is not None and states[base.config] > self.memory_budget_bytes:
                error = error or NoConfigFits(
                    f"{base.config} cannot hold the optimizer within the memory budget of "
                    f"{_gib(self.memory_budget_bytes)} per rank (its resident state alone: "
                    f"{_gib(states[base.config])}): raise memory_budget_bytes, or shard the optimizer (zero1=True, "
                    "or a base with more tensor parallelism)")
                continue
            buckets = sum(self.seconds(c, d, states[c]) for c, d in zip(chosen, demands)) if fixed is None else 0.0
            cost = buckets + cycle_seconds(frozenset(chosen), base.config)
            if cost < best_cost - 1e-12:
                best, best_cost = (chosen, base), cost
        if best is None:
            raise error if error is not None else NoConfigFits("no base config fits the memory budget")
        return best

    def assign(self, demands: Sequence[BucketDemand], configs: Sequence[str],
               cycle_seconds: Callable[[frozenset[str]], float] | None = None, max_search: int = 4096,
               state_bytes: dict[str, int] | None = None) -> list[str]:
        """One config per bucket: the least total time (buckets + switching cycle) within the budget;
        `state_bytes`: each config's resident state, where it differs from the profiled one."""
        states = state_bytes or {}
        options = []
        for demand in demands:
            fitting = [c for c in configs if math.isfinite(self.seconds(c, demand, states.get(c)))]
            if not fitting:
                needs = ", ".join(f"{c}: {_gib(self.probes[(c, demand.length)].peak_with(states.get(c)))}"
                                  for c in configs)
                raise NoConfigFits(
                    f"no config fits rows of {demand.length} tokens within the memory budget of "
                    f"{_gib(self.memory_budget_bytes)} per rank (estimated peak per rank: {needs}); raise "
                    "memory_budget_bytes, add a config with more tensor/sequence parallelism, or lower "
                    "micro_batch_tokens")
            options.append(sorted(fitting, key=lambda c: self.seconds(c, demand, states.get(c))))
        if cycle_seconds is None or math.prod(len(o) for o in options) > max_search:
            return [o[0] for o in options]
        best, best_cost = None, math.inf
        for choice in itertools.product(*options):
            buckets = sum(self.seconds(c, d, states.get(c)) for c, d in zip(choice, demands))
            cost = buckets + cycle_seconds(frozenset(choice))
            if cost < best_cost - 1e-12:
                best, best_cost = list(choice), cost
        return best

    def table(self) -> list[dict]:
        """The probes as rows for printing or JSON."""
        return [dict(config=p.config, length=p.length, rows=p.rows, seconds=p.seconds, peak_bytes=p.peak_bytes,
                     state_bytes=p.state_bytes, fits=p.fits(self.memory_budget_bytes))
                for p in sorted(self.probes.values(), key=lambda p: (p.length, p.config))]


def _gib(n: int | None) -> str:
    if n is None:
        return "unlimited"
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"
