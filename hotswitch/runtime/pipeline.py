"""Pipeline parallelism at run time: lowered stage programs, micro-batches, GPipe and 1F1B.

A config with pp > 1 runs `pp` stages (hotswitch.compiler.stages cuts the LogicGraph), each on a (dp, tp)
sub-mesh of the config's (pp, dp, cp, tp) mesh. Each rank lowers only its own stage's joint graph, by
the same `hotswitch.compiler.program.lower_program` as every other config, into a *forward* and a
*backward* program; the last stage's joint graph runs whole at its forward,
because its backward needs nothing from another stage. Ranks with the same (dp, tp) coordinate form
one pipeline; between neighbours the activations go forward and their gradients backward by
point-to-point send/recv, each tensor in the layout the receiving stage expects (batch dim sharded
over dp, replicated over tp, or sharded on the sequence dim under sequence parallelism).

**One step.** The local batch is cut into micro-batches (dim 0, torch.tensor_split sizes). The loss
numerator, its denominator and the parameter gradients of each micro-batch are summed *unreduced*;
after the last micro-batch one reduction program per stage (`hotswitch.compiler.reduce.lower_reduction`) does
the data-parallel all-reduce (bucketed), the division by the global denominator and the
redistribution into the parameter layouts: one gradient reduction per step, not per micro-batch, and
the result equals one step on the whole batch exactly, whatever the micro-batches' token counts.
pp = 1 with several micro-batches is the same machinery with one stage and no sends.

**Why our own schedule, not torch.distributed.pipelining's.** Its `PipelineStage` can run our
programs (an nn.Module whose forward is an autograd.Function over the lowered graphs), but it fixes
one tensor shape for all micro-batches: its receive buffers are allocated once per stage from one
metadata record (given statically, or inferred by running a real forward and backward of the first
micro-batch). Our data parallelism splits batches unevenly (torch.chunk semantics: a batch of 5 on
dp = 2 is 3 + 2 rows) and so do micro-batches, so the shapes differ between micro-batches, between
steps and between the data-parallel pipelines of one step. Here every rank derives each micro-batch's
receive shapes from its own lowered program, no metadata is exchanged, and the schedule is the
loop below: GPipe (all forwards, then all backwards) and 1F1B in Megatron's form (pp - stage - 1
warm-up forwards, then one forward and one backward alternately, then the remaining backwards).
Sends are non-blocking (`isend`, waited for at the end of the step) and receives block right before
the computation that needs them, so any order in which a value's producer runs before its consumer
is free of deadlock.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx as fx

from hotswitch.compiler.program import StageProgram
from hotswitch.compiler.reduce import OutputPlan, lower_reduction

SCHEDULES = ("1f1b", "gpipe")
# Point-to-point in batches: a stage's sends wait to go out with its next receive, in one
# batch_isend_irecv. NCCL needs it: a send and a later receive with the same neighbour share one
# stream, and once messages outgrow NCCL's buffers two neighbours that each send before they receive
# (1F1B) wait on each other forever. gloo buffers sends, so there they go out at once (None: batch on
# every backend but gloo; tests set True to run the batched path on gloo).
BATCH_P2P: bool | None = None


@dataclass
class StepStats:
    """What one pipelined step did on this rank (for tests and benchmarks)."""

    schedule: str
    micro_batches: int
    stage: int
    num_stages: int
    order: list[str] = field(default_factory=list)  # "F0", "B0", ... in execution order
    sends: int = 0
    recvs: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0


def schedule_order(
    schedule: str, stage: int, num_stages: int, micro_batches: int, train: bool = True
) -> list[tuple[str, int]]:
    """The order of this stage's forward ("F", i) and backward ("B", i) passes."""
    k = micro_batches
    if not train:
        return [("F", i) for i in range(k)]
    if schedule == "gpipe":
        return [("F", i) for i in range(k)] + [("B", i) for i in range(k)]
    if schedule == "1f1b":
        warmup = min(num_stages - stage - 1, k)
        order = [("F", i) for i in range(warmup)]
        for i in range(k - warmup):
            order += [("F", warmup + i), ("B", i)]
        return order + [("B", i) for i in range(k - warmup, k)]
    raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")


def run_step(programs: list[StageProgram], params: list[torch.Tensor], buffers: list[torch.Tensor],
             micro_inputs: list[tuple[torch.Tensor, ...]], *, stage: int, num_stages: int, prev_rank: int | None,
             next_rank: int | None, schedule: str, accumulate_dtype: torch.dtype | None = None,
             device: torch.device | None = None, run=None):
    """Run this rank's part of one step: every micro-batch's forward and (training) backward in
    the schedule's order, with the point-to-point exchanges. Returns (sums of the deferred outputs
    - loss parts, then parameter gradients - over the micro-batches, StepStats). `run(gm, what)`:
    what to call for a program (`runtime.backend.GraphRunner`; default: the GraphModule itself)."""
    run = run or (lambda gm, what: gm)
    t0 = time.perf_counter()
    device = device if device is not None else (params[0].device if params else torch.device("cpu"))
    k = len(micro_inputs)
    train = programs[0].train
    stats = StepStats(schedule if num_stages > 1 and train else "sequential", k, stage, num_stages)
    works: list = []
    sums: list[torch.Tensor] | None = None
    pending: dict[int, tuple] = {}
    batched = BATCH_P2P if BATCH_P2P is not None else dist.get_backend() != "gloo"
    outbox: list[dist.P2POp] = []

    def send(tensors, peer):
        for t in tensors:
            t = t.contiguous()
            if batched:
                outbox.append(dist.P2POp(dist.isend, t, peer))
            else:
                works.append((dist.isend(t, dst=peer), t))
            stats.sends += 1
            stats.bytes_sent += t.numel() * t.element_size()

    def flush(receives=()) -> None:
        """The sends held back, with `receives`, in one batch; waits for all of them (on CUDA the
        current stream waits, not the host)."""
        ops = [*outbox, *receives]
        outbox.clear()
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()

    def recv(metas, peer):
        out = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in metas]
        stats.recvs += len(out)
        if batched:
            flush([dist.P2POp(dist.irecv, t, peer) for t in out])
        else:
            for t in out:
                dist.recv(t, src=peer)
        return out

    def add(values):
        nonlocal sums
        if sums is None:
            sums = [
                v.detach().to(accumulate_dtype)
                if accumulate_dtype is not None and v.is_floating_point()
                else v.detach().clone()
                for v in values
            ]
        else:
            for s, v in zip(sums, values):
                s.add_(v)

    for kind, i in schedule_order(schedule, stage, num_stages, k, train):
        p = programs[i]
        stats.order.append(f"{kind}{i}")
        if kind == "F":
            acts = recv(p.recv_acts, prev_rank) if prev_rank is not None and p.recv_acts else []
            outs = run(p.forward, f"stage {stage}'s forward")(*params, *buffers, *micro_inputs[i], *acts)
            sent = outs[:p.n_acts_out]
            if sent:
                send(sent, next_rank)
            if not train:
                add(outs[p.n_acts_out:p.n_acts_out + p.n_losses])
            elif p.backward is None:  # last stage: its joint graph ran whole
                losses = outs[:p.n_losses]
                grads = outs[p.n_losses:p.n_losses + p.n_params]
                pending[i] = (list(losses) + list(grads), outs[p.n_losses + p.n_params:])
            else:
                pending[i] = (list(outs[p.n_acts_out:p.n_acts_out + p.n_losses]), outs[p.n_acts_out + p.n_losses:])
        else:
            deferred, rest = pending.pop(i)
            if p.backward is None:
                grads_in = rest
            else:
                grads_out = recv(p.recv_grads, next_rank) if next_rank is not None else []
                back = run(p.backward, f"stage {stage}'s backward")(*rest, *grads_out)
                deferred = deferred + list(back[:p.n_params])
                grads_in = back[p.n_params:]
            add(deferred)
            if prev_rank is not None:
                send([g for g, ok in zip(grads_in, p.send_grads) if ok], prev_rank)
    flush()
    for work, _ in works:
        work.wait()
    stats.seconds = time.perf_counter() - t0
    return sums, stats


def reduction_for(st, program: StageProgram, sums: list[torch.Tensor]) -> fx.GraphModule:
    """The stage's once-per-step reduction program (cached on the config state per layout)."""
    key = (program.train, program.n_losses, tuple(s.placements for s in program.deferred_specs),
           tuple((tuple(t.shape), t.dtype) for t in sums))
    if key not in st.reductions:
        plan = OutputPlan(
            split_loss=True,
            num_losses=program.n_losses,
            param_specs=tuple(program.param_specs) if program.train else (),
        )
        st.reductions[key] = lower_reduction(program.deferred_specs, plan, st.mesh, [torch.empty_like(t) for t in sums])
    return st.reductions[key]
