"""Which device the runtime computes and communicates on: the one the process group's backend serves.

`nccl` -> `cuda:<LOCAL_RANK>` (the device `torch.cuda.set_device` chose for this process), `gloo`
-> `cpu`. Everything the runtime allocates (parameter shards, gradients, packed switch buffers,
optimizer state, the small tensors of its own agreements and reports) goes on `runtime_device()`, so
the same code runs on CPU with gloo and on GPUs with NCCL. `HOTSWITCH_DEVICE` overrides the choice
(a fake process group profiling one rank's program on a GPU, say).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["comm_tensor", "default_backend", "describe_processes", "device_for_backend", "runtime_device",
           "synchronize"]

_GPU_BACKENDS = ("nccl", "cuda", "xccl")


def default_backend(processes_per_node: int = 1) -> str:
    """`nccl` where there is a GPU for each of this node's processes, else `gloo` (CPU): what
    `hs.launch` and the CLI use unless told."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= processes_per_node else "gloo"


def describe_processes(n: int, backend: str | None, what: str = "processes") -> str:
    """'4 CPU processes (gloo)' or '4 GPU processes (nccl)': what a launch of n processes will use."""
    backend = backend or default_backend(n)
    return f"{n} {'GPU' if backend == 'nccl' else 'CPU'} {what} ({backend})"


def device_for_backend(backend: str, local_rank: int | None = None) -> torch.device:
    """The device a process group of `backend` communicates on; `local_rank` picks the GPU (default:
    the current CUDA device)."""
    backend = str(backend).lower()
    if any(b in backend for b in _GPU_BACKENDS):
        if not torch.cuda.is_available():
            raise RuntimeError(f"process group backend {backend!r} needs CUDA, but torch.cuda.is_available() is False; "
                               "use backend='gloo' on CPU")
        index = torch.cuda.current_device() if local_rank is None else int(local_rank)
        return torch.device("cuda", index)
    return torch.device("cpu")


def runtime_device(group=None) -> torch.device:
    """The device of the default (or given) process group's backend, or `HOTSWITCH_DEVICE` when set."""
    override = os.environ.get("HOTSWITCH_DEVICE")
    if override:
        return torch.device(override)
    if not dist.is_initialized():
        return torch.device("cpu")
    return device_for_backend(dist.get_backend(group))


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (CUDA runs asynchronously): before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def comm_tensor(values, dtype: torch.dtype, group=None) -> torch.Tensor:
    """A small tensor for a collective of the runtime's own (an agreement, a report), on the device the
    group's backend communicates on (NCCL takes CUDA tensors only), whatever `HOTSWITCH_DEVICE` says."""
    backend = dist.get_backend(group) if dist.is_initialized() else "gloo"
    return torch.tensor(values, dtype=dtype, device=device_for_backend(backend))
