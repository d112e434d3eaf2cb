"""`Trainer(model, configs="auto")`: measure a few configs on the running job, then search.

The cost model's rates are machine-specific (a gloo collective on CPUs costs a millisecond, an NCCL
one on NVLink microseconds), so before searching, three configs of the space that span it (the most
data-parallel, the most tensor-parallel with SP, and one between) are measured at the shortest and
the longest length (six micro-batches: more than the model's four time terms) by a Trainer of those
configs (`Trainer.profile`: compiled ExecGraphs, the compiler's peak memory, timed forward +
backward, the slowest rank; the Trainer hands that in as `measure`, so this layer does not import
the Trainer), and so is every switch between them (`Trainer.measure_switches`: on gloo a switch's
fixed cost dwarfs its transfers, on NCCL it does not). The rates fitted to them (`cost.calibrate`,
`cost.calibrate_switches`) price every config and every switch; every config of the space is
lowered at the shortest length (not run) so that its communication is priced by the collectives its
ExecGraph issues (`search.comm`), not by Megatron's rules (its fsdp and recomputation variants by
those plus what the variant changes by the rules). The candidate set
the search chooses is what the user's Trainer then runs; it profiles those configs at its own
buckets and assigns them per bucket as usual. Collective: call on every rank.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from hotswitch.distconfig import DistConfig, Topology

from .cost import Hardware
from .search import SearchResult, search_configs
from .space import enumerate_configs
from .workload import describe_workload

__all__ = ["auto_configs", "calibration_configs", "default_lengths"]


def default_lengths(max_seq_len: int, multiple: int = 16, count: int = 3) -> list[int]:
    """`count` lengths from `multiple` to the model's longest, evenly spaced in log scale, each a
    multiple of `multiple`: where buckets will fall before the data has been seen."""
    top = max(multiple, max_seq_len // multiple * multiple)
    low = min(top, 4 * multiple)
    if count == 1 or low == top:
        return [top]
    ratio = (top / low) ** (1 / (count - 1))
    out = sorted({max(multiple, round(low * ratio**k / multiple) * multiple) for k in range(count)} | {top})
    return [x for x in out if x <= top]


def calibration_configs(configs: Sequence[DistConfig]) -> list[DistConfig]:
    """Up to three pp = 1 configs that span the space: the most data-parallel, the most
    tensor-parallel (with SP where there is such a config), and the one with tp nearest the geometric
    middle of the two, with SP where the most tensor-parallel one has none and without where it has
    (so that all-reduces and all-gathers / reduce-scatters are both measured)."""
    flat = [c for c in configs if c.pp == 1]
    if not flat:
        return []
    low = min(flat, key=lambda c: (c.tp, c.sp))
    high = max(flat, key=lambda c: (c.tp, c.sp))
    middle_tp = math.sqrt(low.tp * high.tp)
    rest = [c for c in flat if c not in (low, high)]
    picked = [low, high]
    if rest:
        picked.append(min(rest, key=lambda c: (abs(math.log(c.tp / middle_tp)), c.sp == high.sp)))
    return list(dict.fromkeys(picked))


def auto_configs(model: torch.nn.Module, measure: Callable[[list[DistConfig], list[int]], list], *,
                 memory_budget_bytes: int | None, lengths: Sequence[int] | None, micro_batch_tokens: int,
                 length_multiple: int = 16, topology: Topology | None = None, zero1: bool | None = None,
                 compute_dtype: torch.dtype | None = None,
                 progress: Callable[[str], None] | None = None) -> tuple[list[DistConfig], SearchResult]:
    """The configs `Trainer(configs="auto")` trains with, and the search that chose them (its `zero1`
    too, when `zero1` is None). `measure(space, timed, lengths)` returns measured probes
    (`train.cost_model.Probe`) of the `timed` configs at those lengths, measured switches between
    them (`SwitchProbe`) and every config of `space`'s `CommProfile` (its ExecGraph's collectives):
    the Trainer passes a function that does so with a Trainer of the space. See the module doc."""
    say = progress or (lambda message: None)
    world = dist.get_world_size()
    topology = topology or Topology.from_env(world)
    workload = describe_workload(model, compute_bytes=(compute_dtype or torch.float32).itemsize)
    lengths = sorted({int(x) for x in lengths}) if lengths else default_lengths(workload.model.max_seq_len,
                                                                                length_multiple)
    hardware = Hardware() if torch.cuda.is_available() else Hardware.cpu()
    space = enumerate_configs(workload, topology)
    probe_configs = calibration_configs(space.plain)
    probe_lengths = sorted({lengths[0], lengths[-1]})
    probe_lengths = [L for L in probe_lengths if all(L % c.sequence_shards == 0 for c in probe_configs)] or lengths
    say(f"auto configs: measuring {', '.join(c.name for c in probe_configs)} at lengths {probe_lengths} "
        "to calibrate the cost model")
    # (fsdp and recomputation variants are priced from their plain config's collectives: `cost.micro_batch_work`)
    probes, switch_probes, comm = measure(list(space.plain), probe_configs, probe_lengths)
    result = search_configs(workload, world_size=world, lengths=lengths, memory_budget_bytes=memory_budget_bytes,
                            topology=topology, micro_batch_tokens=micro_batch_tokens, probes=probes,
                            switch_probes=switch_probes, comm_profiles=comm, hardware=hardware, zero1=zero1)
    say(f"auto configs: {', '.join(c.name for c in result.chosen)}{' with ZeRO-1' if result.zero1 else ''} "
        f"(predicted step {result.expected_seconds:.3g} s over lengths {list(result.lengths)})")
    return list(result.chosen), result
