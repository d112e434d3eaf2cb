"""`hotswitch bench elastic`: what a change of devices costs, moved three ways, on 4 CPU processes.

The job state of an AdamW run (fp32 weights and both moments, 3x the parameters) goes from
(config, devices) to (config', devices') in four scenarios: a scale-in 4 -> 2 with TP 4 -> 2, a
scale-out 2 -> 4 with TP 2 -> 4, a failure of rank 3 under dp2tp2 continuing as dp3 on the three
survivors, and a redeployment of tp2 from ranks {0, 1} to {2, 3}. Each is moved by

- **hotswitch**: the switch planner (greedy, sources limited to the surviving devices) and the
  executor's batched point-to-point transfers: only the slices each receiver lacks;
- **one rank**: gather everything on rank 0, then scatter the new shards from there (a central
  host, Tenplex's baseline);
- **checkpoint**: torch.distributed.checkpoint save of the old shards to disk, then a resharding
  load into the new ones; a real checkpoint-restart also restarts the processes, which is measured
  apart (spawn 4 workers that import torch, join a process group and trace the model) and added
  in a second ratio.

Every move is checked bit-exact against the full state; times are the slowest rank's, median of
--repeats. The elastic jobs themselves (`hotswitch train --elastic`) report their end-to-end
reconfiguration time, which adds regrouping and compiling the new configs.
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace

from hotswitch.progress import write_json

__all__ = ["run"]

SCENARIOS = [
    # name, source (spec, devices), destination (spec, devices), devices gone before the move
    ("scale-in 4->2, tp4 -> tp2", ("tp=4", [0, 1, 2, 3]), ("tp=2", [0, 1]), ()),
    ("scale-out 2->4, tp2 -> tp4", ("tp=2", [0, 1]), ("tp=4", [0, 1, 2, 3]), ()),
    ("failure of rank 3, dp2tp2 -> dp3", ("dp=2,tp=2", [0, 1, 2, 3]), ("dp=3", [0, 1, 2]), (3,)),
    ("redeploy tp2 {0,1} -> {2,3}", ("tp=2", [0, 1]), ("tp=2", [2, 3]), ()),
]


def run(model: str, repeats: int, json_path: str) -> int:
    """Measure the four scenarios on 4 processes, print the table, write `json_path`."""
    from hotswitch.distributed.launch import LaunchError, launch

    print(f"hotswitch bench elastic: {model} job state (weights + AdamW moments, fp32) on 4 CPU processes "
          f"(gloo), median of {repeats}", flush=True)
    directory = tempfile.mkdtemp(prefix="hotswitch-bench-elastic-")
    try:
        t0 = time.perf_counter()
        launch(_restart_probe, 4, model, backend="gloo")  # a CPU benchmark (CPU shards, a CPU mesh)
        restart = time.perf_counter() - t0
        result = launch(_bench_worker, 4, model, repeats, directory, backend="gloo")
    except LaunchError as e:
        print(f"hotswitch bench elastic: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    result["restart_seconds"] = restart
    print(f"\nstate: {result['state_mib']:.1f} MiB; process restart (spawn 4 workers, import torch, join a group, "
          f"trace): {restart:.1f} s")
    print(f"{'scenario':<36} {'hotswitch':>10} {'one rank':>10} {'checkpoint':>11}   ratios: one rank / hotswitch, "
          "checkpoint / hotswitch, checkpoint+restart / hotswitch")
    for s in result["scenarios"]:
        h, g, c = s["hotswitch"], s["one_rank"], s["checkpoint"]
        s["ratios"] = dict(one_rank=g / h, checkpoint=c / h, checkpoint_restart=(c + restart) / h)
        print(f"{s['name']:<36} {h * 1e3:8.1f}ms {g * 1e3:8.1f}ms {c * 1e3:9.1f}ms   {g / h:6.1f}x "
              f"{c / h:6.1f}x {(c + restart) / h:8.0f}x   ({s['mib_moved']:.1f} MiB moved by hotswitch)")
    write_json(json_path, result)
    if json_path != "-":
        print(f"wrote {json_path}")
    return 0


def _model_and_layouts(model_name: str):
    import torch

    import hotswitch as hs
    from hotswitch.models import PackedCausalLMLoss, build_model
    from hotswitch.train.data import full_length_micro_batch

    torch.manual_seed(0)
    model = build_model(model_name)
    return hs.compile(
        PackedCausalLMLoss(model), full_length_micro_batch(2, 16), [hs.DistConfig("dp4", dp=4)], lazy=True
    )


def _restart_probe(rank: int, model_name: str) -> None:
    """What a restarted worker does before it can load a checkpoint (the process is new: torch imported)."""
    _model_and_layouts(model_name)


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _bench_worker(rank: int, model_name: str, repeats: int, directory: str) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from hotswitch.distconfig import DistConfig, Layout, Mesh, Replicate, Topology
    from hotswitch.switch.executor import execute_plan
    from hotswitch.switch.planner import TensorMove, plan_switch
    from hotswitch.switch.state import JOB_STATE, state_key

    cm = _model_and_layouts(model_name)
    names = list(cm.logic.param_names)
    g = torch.Generator().manual_seed(1)
    full = {state_key(k, n): torch.randn(cm.logic.param_shapes[n], generator=g) for k in JOB_STATE
            for n in names}
    topology = Topology(4, 4)
    out = []
    for name, (src_spec, src_dev), (dst_spec, dst_dev), gone in SCENARIOS:
        src_cfg, dst_cfg = DistConfig.parse(src_spec), DistConfig.parse(dst_spec)
        src_p, dst_p = cm.layouts_for(src_cfg, src_dev), cm.layouts_for(dst_cfg, dst_dev)
        src = {k: src_p[k.split(":", 1)[1]] for k in full}
        dst = {k: dst_p[k.split(":", 1)[1]] for k in full}
        held = {}
        if rank in src_dev and rank not in gone:
            held = {k: full[k][tuple(slice(a, b) for a, b in src[k].box(rank))].clone() for k in full}
        moves = [TensorMove(k, tuple(full[k].shape), 4, src[k], dst[k]) for k in full]

        def check(new):
            for k, t in new.items():
                expect = full[k][tuple(slice(a, b) for a, b in dst[k].box(rank))]
                assert torch.equal(t, expect), (name, k)
            assert (rank in dst_dev) == bool(new), (name, rank)

        def planned():
            plan = plan_switch(moves, topology, unavailable=frozenset(gone))
            new, sent, _ = execute_plan(plan, held, src, dst, rank, dtypes={k: torch.float32 for k in full})
            return new, sent

        one = Mesh([0], ("one",))
        middle = {k: Layout(tuple(full[k].shape), one, (Replicate(),)) for k in full}

        def one_rank():
            gather = plan_switch([TensorMove(k, tuple(full[k].shape), 4, src[k], middle[k]) for k in full], topology,
                                 unavailable=frozenset(gone))
            whole, _, _ = execute_plan(gather, held, src, middle, rank, dtypes={k: torch.float32 for k in full})
            scatter = plan_switch([TensorMove(k, tuple(full[k].shape), 4, middle[k], dst[k]) for k in full], topology)
            new, _, _ = execute_plan(scatter, whole, middle, dst, rank, dtypes={k: torch.float32 for k in full})
            return new

        src_mesh = replace(src_cfg, devices=tuple(src_dev)).device_mesh("cpu")
        dst_mesh = replace(dst_cfg, devices=tuple(dst_dev)).device_mesh("cpu")

        def checkpoint(i):
            path = os.path.join(directory, f"{len(out)}-{i}")
            state = {}
            if rank in src_dev and rank not in gone:  # a lost rank wrote its shard before it died: fair to DCP
                state = _dtensors(held, src, src_mesh, full)
            elif rank in gone:
                state = _dtensors({k: full[k][tuple(slice(a, b) for a, b in src[k].box(rank))].clone() for k in full},
                                  src, src_mesh, full)
            dcp.save(state, checkpoint_id=path)
            target = {}
            if rank in dst_dev:
                target = _dtensors({k: torch.empty(dst[k].local_shape(rank)) for k in full}, dst, dst_mesh, full)
            dcp.load(target, checkpoint_id=path)
            return {k: v.to_local() for k, v in target.items()}

        times = {"hotswitch": [], "one_rank": [], "checkpoint": []}
        sent_total = 0
        for i in range(repeats + 1):  # the first run of each warms up
            for method in times:
                dist.barrier()
                t0 = time.perf_counter()
                if method == "hotswitch":
                    new, sent = planned()
                elif method == "one_rank":
                    new = one_rank()
                else:
                    new = checkpoint(i)
                seconds = _slowest(time.perf_counter() - t0)
                check(new)
                if i:
                    times[method].append(seconds)
                if method == "hotswitch":
                    sent_total = sent
        total = torch.tensor([sent_total], dtype=torch.float64)
        dist.all_reduce(total)
        out.append(dict(name=name, mib_moved=float(total.item()) / 2**20,
                        **{m: statistics.median(v) for m, v in times.items()}))
        if rank == 0:
            print(
                f"  {name}: hotswitch {out[-1]['hotswitch'] * 1e3:.1f} ms, one rank {out[-1]['one_rank'] * 1e3:.1f} ms,"
                f" checkpoint {out[-1]['checkpoint'] * 1e3:.1f} ms",
                flush=True,
            )
    state_mib = sum(t.numel() * 4 for t in full.values()) / 2**20
    return dict(model=model_name, state_mib=state_mib, scenarios=out)


def _dtensors(local, layouts, mesh, full):
    from hotswitch.compiler import _dtensor as dt
    from hotswitch.distconfig.placement import to_torch

    return {k: dt.from_local(t, mesh, [to_torch(p) for p in layouts[k].placements], full[k].shape)
            for k, t in local.items()}
