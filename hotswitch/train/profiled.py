"""Planning with one device: every config's rank 0 profiled in a fake process group.

`hotswitch configs --profile` (and `profile_space`) prices configs for a job this machine cannot run
in full. Each config of the space is compiled, and its rank 0's training step timed, here, in a
*fake* process group of the config's world size (`runtime.profile.profile_rank`: collectives return
at once): compute time and the compiler's peak memory at the rank's real local shapes, and the
collectives its ExecGraph issues (`search.comm`). The compute rates are fitted to those times
(`cost.calibrate` with collectives-free probes), the memory terms to those peaks, and the
collectives are priced on the Topology's links by the Hardware's rates: nothing is assumed of the
model's communication, nothing measured of the network. Every config is profiled at the shortest
length, the calibration configs (`search.auto.calibration_configs`) at the longest too. (It lives in
`train`, beside the `Probe`s it makes: `search` stays free of processes.)
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hotswitch.distconfig import Topology
from hotswitch.runtime.profile import profile_rank
from hotswitch.search.auto import calibration_configs
from hotswitch.search.comm import CommProfile
from hotswitch.search.cost import rows_per_replica
from hotswitch.search.space import enumerate_configs
from hotswitch.search.workload import Workload
from hotswitch.train.cost_model import Probe

__all__ = ["profile_space"]


def profile_space(build_model: Callable[[], torch.nn.Module], workload: Workload, topology: Topology,
                  lengths: Sequence[int], micro_batch_tokens: int, *, device: str | None = None, repeats: int = 3,
                  progress: Callable[[str], None] | None = None) -> tuple[list, dict[str, CommProfile]]:
    """Probes (`train.cost_model.Probe`, collectives free) and `CommProfile`s of the pp = 1 configs of
    the space, each from rank 0 profiled in its own process. `build_model()` (picklable) returns a
    model whose forward takes (input ids, targets) and returns the loss (`hotswitch.models.GPT`)."""
    say = progress or (lambda message: None)
    lengths = sorted({int(x) for x in lengths})
    flat = [c for c in enumerate_configs(workload, topology).plain if c.pp == 1]
    jobs = [(c, lengths[0]) for c in flat]
    jobs += [(c, lengths[-1]) for c in calibration_configs(flat) if lengths[-1] != lengths[0]]
    jobs = [(c, length) for c, length in jobs if length % c.sequence_shards == 0]
    probes, comm = [], {}
    for i, (config, length) in enumerate(jobs):
        rows = config.dp * rows_per_replica(length, micro_batch_tokens)
        x = torch.randint(0, workload.model.vocab_size, (rows, length), generator=torch.Generator().manual_seed(length))
        say(f"[{i + 1}/{len(jobs)}] profiling {config.name} rank 0 at {rows} x {length} in a fake process group")
        profile = profile_rank(build_model, (x, x), config, rank=0, repeats=repeats, device=device)
        probes.append(Probe(config.name, length, rows, profile.seconds, profile.estimated_peak_bytes,
                            profile.state_bytes, collectives_free=True))
        if profile.comm is not None:
            comm.setdefault(config.name, profile.comm)
    return probes, comm
