"""Writing a compiled model's weights, whatever config is active, without gathering it on one rank.

- `save_pretrained`: a Hugging Face checkpoint that `from_pretrained` reads on one process. Each
  tensor goes whole to one rank (the planner's move into a one-device layout, `switch.executor`),
  ranks balanced by bytes; each rank writes its own safetensors files, one file's tensors gathered
  at a time (so a rank holds at most one file beside its shards); rank 0 writes the index and
  `config.json`.
- `save_checkpoint`: a torch.distributed.checkpoint of the shards as DTensors of the active layout
  (each rank writes its own), under the module's `state_dict()` names.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from hotswitch.distconfig import Layout, Mesh, Replicate
from hotswitch.runtime.weights import HF_INDEX, HF_SINGLE, buffer_of
from hotswitch.switch.executor import execute_plan
from hotswitch.switch.planner import TensorMove, plan_switch


def save_pretrained(cm, directory, config, *, params: dict[str, torch.Tensor], max_shard_bytes: int) -> None:
    """`CompiledModel.save_pretrained`: see the module doc."""
    from safetensors.torch import save_file

    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be a positive number of bytes, got {max_shard_bytes!r}")
    directory = os.fspath(directory)
    prefix = cm._hf_prefix
    dtypes = _dtypes(cm, params)
    persistent = [b for b in cm.logic.buffer_names if b in cm._state_keys]
    names = [n for n in cm.logic.param_names if n.startswith(prefix)] + [b for b in persistent if b.startswith(prefix)]
    outside = [n for n in cm.logic.param_names if not n.startswith(prefix)]
    if outside:
        raise ValueError(f"save_pretrained writes the Hugging Face model at {prefix[:-1]!r}, but parameters "
                         f"{outside[:3]} lie outside it: use save_checkpoint, which writes every parameter")
    sizes = {n: _numel(cm, n) * (dtypes[n].itemsize if n in dtypes else buffer_of(cm, n).element_size()) for n in names}
    files = _files(names, sizes, cm.world_size, max_shard_bytes)
    count = sum(len(per_rank) for per_rank in files)
    file_names = {}
    for r, per_rank in enumerate(files):
        for f, _ in enumerate(per_rank):
            k = sum(min(len(files[q]), f) for q in range(cm.world_size)) + sum(
                1 for q in range(r) if len(files[q]) > f)  # numbered round by round, rank by rank
            file_names[(r, f)] = HF_SINGLE if count == 1 else f"model-{k + 1:05d}-of-{count:05d}.safetensors"
    if cm.rank == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    src = cm._layouts(cm.active)
    for round_ in range(max(len(per_rank) for per_rank in files)):
        mine = files[cm.rank][round_] if round_ < len(files[cm.rank]) else []
        owner = {n: r for r, per_rank in enumerate(files) if round_ < len(per_rank) for n in per_rank[round_]}
        moving = [n for n in owner if n in cm.logic.param_shapes]
        dst = {n: Layout(tuple(cm.logic.param_shapes[n]), Mesh([owner[n]], ("owner",)), (Replicate(),))
               for n in moving}
        plan = plan_switch([TensorMove(n, tuple(cm.logic.param_shapes[n]), dtypes[n].itemsize, src[n], dst[n])
                            for n in moving], cm.topology)
        whole, _, _ = execute_plan(plan, {n: params[n] for n in moving if n in params},
                                   {n: src[n] for n in moving}, dst, cm.rank, dtypes=dtypes, device=cm.device)
        if mine:
            tensors = {n[len(prefix):]: (whole[n] if n in whole else buffer_of(cm, n)).detach().to("cpu").contiguous()
                       .clone() for n in mine}
            save_file(tensors, os.path.join(directory, file_names[(cm.rank, round_)]), metadata={"format": "pt"})
        del whole
    dist.barrier()
    if cm.rank == 0:
        if count > 1:
            weight_map = {n[len(prefix):]: file_names[(r, f)] for r, per_rank in enumerate(files)
                          for f, ns in enumerate(per_rank) for n in ns}
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
            with open(os.path.join(directory, HF_INDEX), "w") as f:
                json.dump(index, f, indent=2)
        if config is not None:
            config.save_pretrained(directory)
    dist.barrier()


def save_checkpoint(cm, directory, *, params: dict[str, torch.Tensor], strip: str = "") -> None:
    """`CompiledModel.save_checkpoint`; `strip`: a prefix taken off every name (a Trainer's wrapper)."""
    import torch.distributed.checkpoint as dcp

    shards = cm.as_dtensors(params)
    state = {}
    for key in cm._state_keys:  # tied weights under each of their names, as state_dict() has them
        name = cm.logic.aliases.get(key, key)
        if name in shards:
            state[key.removeprefix(strip)] = shards[name]
        elif key in cm.logic.buffer_names:
            state[key.removeprefix(strip)] = buffer_of(cm, key)
    dcp.save(state, checkpoint_id=os.fspath(directory))


def _files(names: list[str], sizes: dict[str, int], world: int, max_bytes: int) -> list[list[list[str]]]:
    """[rank][file] -> names: each tensor to the rank with the fewest bytes so far (largest first),
    then each rank's tensors, in model order, cut into files of at most `max_bytes` (a larger tensor
    alone). Pure: the same on every rank."""
    load, owner = [0] * world, {}
    for n in sorted(names, key=lambda n: (-sizes[n], names.index(n))):
        r = min(range(world), key=lambda q: (load[q], q))
        owner[n], load[r] = r, load[r] + sizes[n]
    files: list[list[list[str]]] = [[] for _ in range(world)]
    for n in names:
        per_rank = files[owner[n]]
        if not per_rank or (sum(sizes[m] for m in per_rank[-1]) + sizes[n] > max_bytes and per_rank[-1]):
            per_rank.append([])
        per_rank[-1].append(n)
    return files


def _dtypes(cm, params: dict[str, torch.Tensor]) -> dict[str, torch.dtype]:
    """Each parameter's dtype in `params`, on every rank (under pp > 1 a rank holds only its stage's)."""
    mine = {n: str(t.dtype).removeprefix("torch.") for n, t in params.items()}
    if cm._state(cm.active).full_mesh is not None:
        gathered = [None] * cm.world_size
        dist.all_gather_object(gathered, mine)
        mine = {n: d for g in gathered for n, d in g.items()}
    return {n: getattr(torch, d) for n, d in mine.items()}


def _numel(cm, name: str) -> int:
    shape = cm.logic.param_shapes[name] if name in cm.logic.param_shapes else buffer_of(cm, name).shape
    return int(torch.Size(shape).numel())

