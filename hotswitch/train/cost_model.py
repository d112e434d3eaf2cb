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

    def fits(self, budget: int | None) -> bool:
        return budget is None or self.peak_bytes <= budget


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

    def seconds(self, config: str, demand: BucketDemand) -> float:
        """Estimated seconds for the bucket under `config` (inf if it does not fit)."""
        probe = self.probes[(config, demand.length)]
        if not probe.fits(self.memory_budget_bytes) or probe.seconds is None:
            return math.inf
        return self.micro_batches(config, demand) * probe.seconds

    def assign(self, demands: Sequence[BucketDemand], configs: Sequence[str],
               cycle_seconds: Callable[[frozenset[str]], float] | None = None, max_search: int = 4096) -> list[str]:
        """One config per bucket: the least total time (buckets + switching cycle) within the budget."""
        options = []
        for demand in demands:
            fitting = [c for c in configs if math.isfinite(self.seconds(c, demand))]
            if not fitting:
                needs = ", ".join(f"{c}: {_gib(self.probes[(c, demand.length)].peak_bytes)}" for c in configs)
                raise NoConfigFits(
                    f"no config fits rows of {demand.length} tokens within the memory budget of "
                    f"{_gib(self.memory_budget_bytes)} per rank (estimated peak per rank: {needs}); raise "
                    "memory_budget_bytes, add a config with more tensor/sequence parallelism, or lower "
                    "micro_batch_tokens")
            options.append(sorted(fitting, key=lambda c: self.seconds(c, demand)))
        if cycle_seconds is None or math.prod(len(o) for o in options) > max_search:
            return [o[0] for o in options]
        best, best_cost = None, math.inf
        for choice in itertools.product(*options):
            cost = sum(self.seconds(c, d) for c, d in zip(choice, demands)) + cycle_seconds(frozenset(choice))
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
