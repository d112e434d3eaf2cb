"""One rank of a large job, profiled on one device: compute time and peak memory of its ExecGraph.

`profile_rank(build_model, example_inputs, "tp8", rank=0)` compiles the model for the config in a
fresh process that is rank `rank` of a *fake* process group of the config's world size (torch's
"fake" backend: collectives return at once without moving data), then runs that rank's training
step (forward, backward, gradient reduction) at its real local shapes. Collectives cost nothing
there, so the time is the rank's compute alone; the peak is measured on CUDA
(`torch.cuda.max_memory_allocated`) and compared with the compiler's estimate
(`hotswitch.compiler.memory.estimate_peak_bytes` plus the weights and gradients the rank holds).
A cost model can so price configs for a cluster it is not running on, one device at a time.
"""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from hotswitch.distributed.launch import call_in_process
from hotswitch.search.comm import CommProfile

__all__ = ["RankProfile", "profile_rank"]


@dataclass(frozen=True)
class RankProfile:
    config: str
    rank: int
    world_size: int
    device: str
    dtype: str
    local_shapes: tuple  # this rank's input shapes
    seconds: float  # median step time (forward + backward + reductions, collectives free)
    tokens: int  # tokens of this rank's local batch
    flops: float  # this rank's share of the model's training FLOPs (6 x params x tokens / model-parallel degree)
    peak_bytes: int | None  # measured peak allocation during a step (CUDA only; None on CPU)
    estimated_peak_bytes: int  # the compiler's estimate: the inputs (weights, buffers, batch) + the graph's live peak
    compile_seconds: float
    state_bytes: int = 0  # of `estimated_peak_bytes`: the inputs (weights, buffers and the micro-batch)
    comm: CommProfile | None = None  # the collectives its ExecGraph issues (pp = 1), free in the fake group

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    def mfu(self, peak_flops: float) -> float:
        """Model FLOPs utilisation against a device peak of `peak_flops` per second."""
        return self.flops / self.seconds / peak_flops

    def to_dict(self) -> dict:
        out = {**asdict(self), "tokens_per_second": self.tokens_per_second}
        out["comm"] = None if self.comm is None else len(self.comm.collectives)  # a count: the list is long
        return out


def profile_rank(build_model: Callable[[], torch.nn.Module], example_inputs, config, *, rank: int = 0,
                 repeats: int = 5, device: str | None = None, dtype: torch.dtype = torch.float32,
                 backend: str = "eager") -> RankProfile:
    """Profile rank `rank` of `config` (a DistConfig or its string) in a process of its own; see the module doc.

    `build_model()` (picklable: a module-level function or a functools.partial) returns the model
    (forward -> scalar loss) with its weights; `example_inputs` is the *global* batch. `device`:
    where the rank computes (default: cuda when available, else cpu); `dtype`: the compute dtype of
    the weights; `backend`: how the runtime would run the ExecGraph (`runtime.backend.GraphRunner`:
    op by op with torch's fused attention kernels, or compiled by Inductor first).
    """
    from hotswitch.distconfig import DistConfig

    config = DistConfig.parse(config)
    if not 0 <= rank < config.world_size:
        raise ValueError(f"rank {rank} is not a rank of {config.name!r} ({config.world_size} devices)")
    if backend not in ("eager", "inductor"):
        raise ValueError(f"backend must be 'eager' or 'inductor', got {backend!r}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return RankProfile(**call_in_process(_profile, build_model, tuple(example_inputs), config, rank, repeats,
                                         device, dtype, backend, name=f"profiling {config.name!r} rank {rank}"))


def _profile(build_model, example_inputs, config, rank, repeats, device, dtype, backend) -> dict:
    """In the profiling process: this rank of a fake process group, measured (`_measure`)."""
    if device == "cpu":
        torch.set_num_threads(1)  # as a rank started by hs.launch computes (one thread per process)
    if device.startswith("cuda"):
        where = torch.device(device)
        device = f"cuda:{where.index or 0}"  # set_device needs an index; "cuda" means the first GPU
        torch.cuda.set_device(where.index or 0)
    os.environ["HOTSWITCH_DEVICE"] = device  # compute here; the fake group communicates nowhere
    from hotswitch.distributed import _c10d

    _c10d.init_fake_process_group(rank, config.world_size)
    return _measure(build_model, example_inputs, config, rank, repeats, device, dtype, backend)


def _measure(build_model, example_inputs, config, rank, repeats, device, dtype, backend) -> dict:
    import hotswitch as hs
    from hotswitch.compiler.memory import estimate_peak_bytes
    from hotswitch.search.comm import compiled_comm_profile

    torch.manual_seed(0)
    model = build_model().to(dtype)
    n_params = sum(p.numel() for p in model.parameters())
    t = time.perf_counter()
    cm = hs.compile(model, example_inputs, [config], backend=backend)
    compile_seconds = time.perf_counter() - t
    gm = cm.exec_graph(config.name)
    local = tuple(x.to(cm.device) for x in cm.shard_inputs(*example_inputs))
    args = cm.graph_inputs(*local)
    resident = sum(t.numel() * t.element_size() for t in args)  # weights, buffers and the micro-batch
    step = cm.graph_runner(gm, f"{config.name}'s training step")  # as the runtime runs it (fused attention)
    synchronize = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    step(*args)  # warm-up (and Inductor's compilation)
    synchronize()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()  # from here only the resident inputs are allocated
    times = []
    for _ in range(repeats):
        synchronize()
        t = time.perf_counter()
        outs = step(*args)
        synchronize()
        times.append(time.perf_counter() - t)
        del outs
    peak = int(torch.cuda.max_memory_allocated()) if device.startswith("cuda") else None
    tokens = int(local[0].numel())
    comm = compiled_comm_profile(cm, config.name, gm, tokens) if config.pp == 1 else None
    model_parallel = config.tp * config.pp
    return dict(config=config.name, rank=rank, world_size=config.world_size, device=device,
                dtype=str(dtype).removeprefix("torch."), local_shapes=tuple(tuple(x.shape) for x in local),
                seconds=statistics.median(times), tokens=tokens, flops=6.0 * n_params * tokens / model_parallel,
                peak_bytes=peak, estimated_peak_bytes=int(resident + estimate_peak_bytes(gm)),
                compile_seconds=compile_seconds, state_bytes=int(resident), comm=comm)
