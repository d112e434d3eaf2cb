"""Elastic training: a `Trainer` whose device set changes while it runs (Tenplex's job, our planner).

Three events change the devices: a planned scale-out or scale-in, a redeployment (same size, other
workers) and a failure (a worker killed at any point). Each one is a move of the *job state* from
(config, workers) to (config', workers'), planned by the same planner as a hot switch:

- the job state is what `Trainer.job_state()` holds between steps: fp32 masters and AdamW moments
  in the base layout, plus the step counter (= data position in the seeded `SampleOrder`, so global
  batches and the sample order survive any change of DP degree) and the RNG state;
- the new configs are the user's candidates re-instantiated for the new device count (tp, sp kept,
  dp scaled; a count no candidate fits leaves the extra workers idle) or a rule `n -> configs`;
- sources are limited to workers that are still there (`plan_switch(unavailable=...)`); when some
  slice has no surviving owner (e.g. a TP shard without replica), the whole state comes from the
  latest complete checkpoint instead (written asynchronously in torch.distributed.checkpoint format
  every N steps) and the steps since it are replayed: survivors' slices are from a later step and
  cannot be mixed with the checkpoint's.

A step is committed by a two-phase agreement in the agent's store just before the optimizer
changes anything (`Membership.agree_to_commit`), so after a failure every survivor knows whether
the interrupted step counts: either all survivors applied it or none did, and an aborted step is
simply run again on the new devices with the same global batch.
"""
from __future__ import annotations

import base64
import datetime
import itertools
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

from hotswitch.distconfig import DistConfig, Topology, parse_configs
from hotswitch.distributed.device import comm_tensor
from hotswitch.elastic import checkpoint as ckpt
from hotswitch.elastic.membership import LONG_TIMEOUT, ElasticError, Fenced, GenerationRecord, Membership
from hotswitch.runtime.weights import EMPTY, first_meta
from hotswitch.switch.executor import execute_plan
from hotswitch.switch.planner import TensorMove, plan_switch, unowned
from hotswitch.switch.state import JOB_STATE, state_key
from hotswitch.train.trainer import Trainer, default_base

__all__ = ["ElasticJob", "Event", "Reconfiguration", "configs_for", "hosts_topology"]



@dataclass(frozen=True, order=True)
class Event:
    """A planned change applied before global batch `step` (after `step` optimizer steps)."""

    step: int
    kind: str  # "scale" (to `size` workers) | "redeploy" (the same size on new workers)
    size: int | None = None

    def __post_init__(self):
        if self.kind not in ("scale", "redeploy"):
            raise ValueError(f"unknown event kind {self.kind!r}: use 'scale' (with size) or 'redeploy'")
        if self.kind == "scale" and (self.size is None or self.size < 1):
            raise ValueError(f"a scale event needs a positive size, got {self.size!r}")
        if self.step < 0:
            raise ValueError(f"event step must be >= 0, got {self.step}")


@dataclass(frozen=True)
class Reconfiguration:
    """What one change of devices did (the same on every worker)."""

    generation: int
    reason: str  # failure | scale | redeploy
    step: int  # the job state's step after the change (the next global batch)
    source: str  # "config on n workers" before
    destination: str  # after
    restored_from: str  # "survivors" | "checkpoint step N"
    lost_tensors: int  # tensors with a slice no survivor held
    bytes_moved: int  # sent between workers (all of them together)
    move_seconds: float  # the state move (planning + transfer, or checkpoint verification + load)
    seconds: float  # from noticing the change to training again (regroup, move, new Trainer)
    replayed_steps: int  # committed steps run again (from the checkpoint's step)
    noticed_by: str = ""  # failures: what made this worker notice (MembershipChanged: the store, not a timeout)
    interrupted: tuple[int, ...] = ()  # generations whose change a further failure cut short (begun again)


def hosts_topology(members: Sequence[str]) -> Topology:
    """The job's nodes from its worker ids: workers "a<k>w<j>" run on host a<k> (one host when the
    ids carry no host). Hosts of unequal sizes, or not contiguous in rank order, count as one node
    (only the planner's costs use it)."""
    hosts = [w.rpartition("w")[0] for w in members]
    runs = [len(list(g)) for _, g in itertools.groupby(hosts)]
    n = len(members)
    per_node = runs[0] if len(set(runs)) == 1 and len(runs) == len(set(hosts)) else n
    return Topology(n, per_node)


def configs_for(candidates, num_devices: int, min_devices: int = 1) -> tuple[int, list[DistConfig]]:
    """(devices used, configs) for a job that has `num_devices` workers: the candidates re-instantiated
    (tp and sp kept, dp scaled) on the largest count <= num_devices that at least one of them fits.
    `candidates`: DistConfigs, or a rule `n -> list[DistConfig]` (may return [] when n does not suit)."""
    for n in range(num_devices, min_devices - 1, -1):
        if callable(candidates):
            found = list(candidates(n))
        else:
            found, names = [], set()
            for c in candidates:
                if c.pp != 1 or n % c.tp:
                    continue
                config = DistConfig.parse(f"dp={n // c.tp},tp={c.tp}" + (",sp" if c.sp else ""))
                if config.name not in names:
                    names.add(config.name)
                    found.append(config)
        if found:
            return n, found
    raise ElasticError(
        f"no candidate config fits {num_devices} devices (or any count down to {min_devices}): "
        f"candidates {[getattr(c, 'name', c) for c in candidates] if not callable(candidates) else candidates}; "
        "add a config with a smaller tensor-parallel degree"
    )


@dataclass
class _Held:
    """This worker's job state between steps, as the move's source."""

    step: int
    config: DistConfig
    members: tuple[str, ...]  # worker ids of the job it belongs to, index = rank
    tensors: dict[str, torch.Tensor]


class ElasticJob:
    """Runs `Trainer` steps on whatever workers the agent (`membership.run_elastic`) provides.

    `build_model()` returns the same model on every worker (joiners call it too; its weights are
    used only at the start), or one built under `torch.device("meta")` with `weights` saying where
    the start's weights come from (see `hs.compile`: "init", a checkpoint path; later Trainers take
    the moved or checkpointed job state and read nothing). `candidates`: DistConfigs for the initial
    device count, or a rule.
    `batch(step)` -> (sample ids, list of 1-D token tensors) of global batch `step`.
    `trainer_options`: keyword arguments of `Trainer` (optimizer, memory_budget_bytes, buckets, ...).
    `checkpoint_dir`/`checkpoint_every`: asynchronous DCP checkpoints (step 0 and every N steps).
    `step_timeout_s`: how long a collective inside a step may wait for a peer (detects a dead peer
    that gloo cannot report). `on_step(report, replayed)` runs on the job's rank 0 after each step;
    `on_change(when, job)` on every job worker before ("before", old workers; planned changes only)
    and after ("after", new workers) each change, e.g. to gather `trainer.full_job_state()`.
    """

    def __init__(self, membership: Membership, build_model: Callable[[], nn.Module], candidates,
                 batch: Callable[[int], tuple[list[int], list[torch.Tensor]]], *, trainer_options: dict | None = None,
                 checkpoint_dir: str, checkpoint_every: int = 2, step_timeout_s: float = 30.0,
                 on_step: Callable | None = None, on_change: Callable[[str, ElasticJob], None] | None = None,
                 log: Callable[[str], None] | None = None, weights=None):
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        self.membership = membership
        self.build_model, self.batch = build_model, batch
        self.candidates = candidates if callable(candidates) else parse_configs(candidates)  # strings too
        self.trainer_options = dict(trainer_options or {})
        if self.trainer_options.get("zero1"):
            raise ValueError("elastic training moves whole optimizer states: zero1=True is not supported yet")
        self.checkpoint_dir, self.checkpoint_every = str(checkpoint_dir), checkpoint_every
        self.weights = weights  # the start's weights (hs.compile's `weights`)
        self.step_timeout = datetime.timedelta(seconds=step_timeout_s)
        membership.init_timeout = self.step_timeout
        self.on_step, self.on_change = on_step, on_change
        self._log = log or (lambda message: None)
        self.trainer: Trainer | None = None
        self.checkpointer: ckpt.AsyncCheckpointer | None = None
        self.reconfigurations: list[Reconfiguration] = []
        self.applied_events: set[int] = set()  # indices of planned events already applied
        self.max_committed = 0  # the highest step count ever committed (replayed steps are below it)
        self._model: nn.Module | None = None
        self.last_report = None
        self._ids: list[int] = []  # the sample ids of the step running
        self._step_start: _Held | None = None  # the job state when the step running began
        self._checkpoint_group = None
        self._held_state: _Held | None = None  # the job state a change starts from (see _transition)
        self._layout_cm = None  # a CompiledModel of this job: layouts (pure) and its traced logic graph

    # ------------------------------------------------------------------------------------ running
    @property
    def job_rank(self) -> int:
        return self.membership.job_members.index(self.membership.wid)

    def run(self, steps: int, events: Sequence[Event] = ()) -> dict | None:
        """Train until `steps` optimizer steps are committed; returns the result on the job's rank 0
        (None on other workers, on workers that left, and on a worker the others declared lost)."""
        try:
            return self._run(steps, sorted(events))
        except Fenced as fenced:
            self._log(f"[{self.membership.wid}] {fenced}: leaving the job")
            self.membership.leave_group()
            return None

    def _run(self, steps: int, events: list[Event]) -> dict | None:
        record = self.membership.next_record(timeout=datetime.timedelta(days=365))  # a spare host's worker waits
        if record is None:
            return None  # the job ended before it needed this worker
        while not self.membership.store.check(["elastic/started"]):
            try:
                self._start(record)
                break
            except (ElasticError, Fenced):
                raise
            except Exception as error:  # noqa: BLE001 - a worker lost before the job started: start again
                record = self._next_generation(error)  # (after the start's commit: a change from its state)
        else:
            if not self._transition(record, time.perf_counter()):
                return None
        while True:
            step = self.trainer.step_count
            due = [i for i, e in enumerate(events) if e.step == step and i not in self.applied_events]
            t0 = time.perf_counter()
            try:
                if step >= steps:
                    return self._finish()  # a peer lost while the last checkpoint is written is recovered too
                if due:
                    self.applied_events.add(due[0])
                    if self._planned(events[due[0]], t0):
                        continue
                    return None  # this worker left the job
                self._step(step)
            except (ElasticError, Fenced):
                raise
            except Exception as error:  # noqa: BLE001 - a peer may have died: see _recover
                if not self._recover(error, step, t0):
                    return None

    def _start(self, record: GenerationRecord) -> None:
        self.membership.join(record)
        used, configs = configs_for(self.candidates, len(record.job), self.membership.min_size)
        if used != len(record.job):
            raise ElasticError(f"no candidate config uses all {len(record.job)} workers at the start; candidates "
                               f"fit {used}: start with --world-size {used}")
        trainer = self._new_trainer(configs, self.build_model(), weights=self.weights)
        # every worker has the step-0 state (or, after a loss, nobody counts as having it: all start
        # again from the seeded model with the next generation)
        self.membership.agree_to_commit("started")
        self.membership.store.set("elastic/started", str(record.generation))
        self.trainer = trainer
        self._new_checkpointer()
        self._save_checkpoint()  # step 0: a failure before the first periodic checkpoint is recoverable too

    def _step(self, step: int) -> None:
        self._step_start = self._held()  # what a change starts from if this step aborts (its base may move)
        ids, sequences = self.batch(step)
        self._ids = ids  # recorded once the step commits (see _on_phase)
        with self.membership.watch_peers():  # NCCL: a dead peer aborts the step at once
            report = self.trainer.step(sequences)
        self._step_start = None
        self.membership.set_timeout(LONG_TIMEOUT)
        self.last_report = report
        replayed = report.step <= self.max_committed
        self.max_committed = max(self.max_committed, report.step)
        if self.job_rank == 0 and self.on_step is not None:
            self.on_step(report, replayed)
        if report.step % self.checkpoint_every == 0:
            self._save_checkpoint()

    def _on_phase(self, phase: str, step: int) -> None:
        """Trainer hook: store barriers before the step's first collective (so a worker that died
        between steps is noticed without a timeout; that collective, the batch check, runs with the
        short timeout, as gloo reports a dead peer at once only to its ring neighbours) and before
        the step's compiled collectives and each profiling probe's (a worker that died while the others
        compiled is noticed at once, not after a timeout), then the short timeout; the long one while
        compiling; the commit agreement before the optimizer."""
        if phase == "start":
            self.membership.barrier(f"s{step}/start")
            self.membership.set_timeout(self.step_timeout, keep=(self._checkpoint_group,))
        elif phase == "checked":  # compiling and profiling next: ranks drift apart
            self.membership.set_timeout(LONG_TIMEOUT, keep=(self._checkpoint_group,))
        elif phase == "compiled" or phase.startswith("probe:"):  # a probe's graph compiled, its collectives next
            self.membership.barrier(f"s{step}/{phase}")
            self.membership.set_timeout(self.step_timeout, keep=(self._checkpoint_group,))
        elif phase == "update":
            self.membership.agree_to_commit(f"s{step}/update")
            # the step counts from here: its samples are recorded by every worker (the same value), as
            # any of them may be lost before the step returns
            self.membership.store.set(f"elastic/samples/{step}", json.dumps(self._ids))

    def _finish(self) -> dict | None:
        if self.checkpointer is not None:
            self.checkpointer.wait()
        self.membership.barrier("finished")
        if self.job_rank != 0:
            return None
        self.membership.finish()
        samples = {}
        for step in range(self.trainer.step_count):
            key = f"elastic/samples/{step}"
            if self.membership.store.check([key]):
                samples[step] = json.loads(self.membership.store.get(key))
        return dict(steps=self.trainer.step_count, workers=list(self.membership.job_members),
                    configs=[c.name for c in self.trainer.configs], base=self.trainer.base,
                    loss=self.last_report.loss if self.last_report is not None else math.nan,
                    reconfigurations=[asdict(r) for r in self.reconfigurations], samples=samples)

    # ------------------------------------------------------------------------------ changes
    def _planned(self, event: Event, t0: float) -> bool:
        """Ask the agent for the change, then move. Returns False if this worker left."""
        if self.checkpointer is not None:
            self.checkpointer.wait()  # a planned change leaves no checkpoint half-written
        self.membership.barrier(f"event{event.step}")
        if self.on_change is not None:
            self.on_change("before", self)
        if self.job_rank == 0:
            self.membership.request(event.kind, event.size)
        record = self.membership.next_record()
        if record is None:
            raise ElasticError(f"the job ended while {self.membership.wid} waited for the change it asked for")
        return self._transition(record, t0)

    def _recover(self, error: Exception, step: int, t0: float) -> bool:
        """After an exception in a step: wait for the agent's next generation (a peer died); if none
        comes, the exception was ours and is raised. Returns False if this worker left."""
        self.membership.set_timeout(LONG_TIMEOUT)
        record = self._next_generation(error)
        committed = self.membership.decide_abort(f"s{step}/update")
        assert self.trainer.step_count == step + (1 if committed else 0), \
            f"step {step} {'committed' if committed else 'aborted'} but the trainer is at {self.trainer.step_count}"
        if committed:
            self.max_committed = max(self.max_committed, step + 1)
        self.trainer.cm.zero_grad()  # partial gradients of an abandoned step
        self._log(f"[{self.membership.wid}] step {step + 1} interrupted ({type(error).__name__}); "
                  f"{'it was committed' if committed else 'it will run again'}")
        return self._transition(record, t0, type(error).__name__, held=None if committed else self._step_start)

    def _held(self) -> _Held | None:
        if self.trainer is None:
            return None
        t = self.trainer
        return _Held(t.step_count, t.config(t.base), tuple(self.membership.job_members), t.job_state())

    def _transition(self, record: GenerationRecord, t0: float, noticed_by: str = "", held: _Held | None = None) -> bool:
        """Move the job state to `record`'s job; returns False if this worker is not in it. A worker
        lost during the change (while state moves, a checkpoint loads or the new Trainer forms) makes
        the agent publish another generation: the change starts again towards it from the state every
        survivor still holds (the one before the move, or the moved one if the move was committed).
        `held`: the state to start from, when not the Trainer's own (that of an aborted step's start)."""
        if self.trainer is not None:
            self._held_state, self._layout_cm = held or self._held(), self.trainer.cm
        self.trainer = None
        if self.checkpointer is not None:
            self.checkpointer.abandon()
            self.checkpointer = None
        interrupted = []
        while True:
            try:
                return self._change_to(record, t0, noticed_by, tuple(interrupted))
            except (ElasticError, Fenced):
                raise
            except Exception as error:  # noqa: BLE001 - a peer may have died during the change
                self.membership.set_timeout(LONG_TIMEOUT)
                interrupted.append(record.generation)
                record = self._next_generation(error)
                self._log(f"[{self.membership.wid}] the change to generation {record.generation - 1} was interrupted "
                          f"({type(error).__name__}); starting again towards generation {record.generation}")

    def _next_generation(self, error: Exception) -> GenerationRecord:
        """After an exception: the next generation (a peer died); if none comes, the exception was ours."""
        grace = datetime.timedelta(seconds=max(60.0, 3 * self.step_timeout.total_seconds()))
        try:
            record = self.membership.next_record(timeout=grace)
        except Fenced:
            raise
        except Exception:  # noqa: BLE001 - the store wait timed out: nobody died
            raise error from None
        if record is None:  # the job ended meanwhile (e.g. a peer finished the last step and exited first)
            raise Fenced(f"the job ended while {self.membership.wid} recovered from {type(error).__name__}")
        return record

    def _change_to(self, record: GenerationRecord, t0: float, noticed_by: str, interrupted: tuple[int, ...]) -> bool:
        m = self.membership
        held = self._held_state
        m.join(record)
        m.set_timeout(self.step_timeout)  # every collective below follows a store barrier: peers are there
        W = len(record.group)
        # what every worker holds: identical on every survivor (the commit agreements saw to it)
        desc = None if held is None else (held.step, held.config.spec(), held.members)
        descs: list = [None] * W
        dist.all_gather_object(descs, (desc, self._layout_cm is not None))
        held_by = [d for d, _ in descs if d is not None]
        if any(d != held_by[0] for d in held_by):
            raise ElasticError(f"survivors hold different job states {sorted(set(held_by))}: cannot combine them")
        # nobody holds it when every holder was lost (say during a scale-out, before the joiners had their
        # part): then all of it comes from the latest complete checkpoint
        step, src_spec, src_members = held_by[0] if held_by else (self.max_committed, None, ())
        used, configs = configs_for(self.candidates, len(record.job), m.min_size)
        job = record.job[:used]
        base = self._base(configs)
        base_config = next(c for c in configs if c.name == base)
        planner = next((i for i, (d, has_cm) in enumerate(descs) if d is not None and has_cm), None)
        if planner is None:
            moves, meta = [], dict(rng=None, applied=sorted(self.applied_events), max_committed=self.max_committed,
                                   history=self.reconfigurations)
        elif dist.get_rank() == planner:  # it computes the moves
            moves = self._moves(self._layout_cm, DistConfig.parse(src_spec), src_members, base_config, job,
                                record.group)
            meta = dict(rng=torch.get_rng_state(), applied=sorted(self.applied_events),
                        max_committed=self.max_committed, history=self.reconfigurations)
        else:
            moves = meta = None
        if planner is not None:
            m.barrier("planned", record.group)  # the planner's time is not a collective's wait
            box = [moves, meta]
            dist.broadcast_object_list(box, src=planner)
            moves, meta = box
        self.applied_events = set(meta["applied"])
        self.reconfigurations = list(meta["history"])  # joiners learn what happened before them
        self.max_committed = max(self.max_committed, meta["max_committed"])
        gone = frozenset(range(W, W + len(src_members)))  # ids given to source workers not in the group
        lost = unowned(moves, gone)  # no moves when nobody holds the state: all of it from the checkpoint
        t_move = time.perf_counter()
        moved, sent, restored = None, 0, "survivors"
        if held_by and not lost:
            plan = plan_switch(moves, Topology(W + len(src_members), W + len(src_members)), unavailable=gone)
            src = {mv.name: mv.src for mv in moves}
            dst = {mv.name: mv.dst for mv in moves}
            old = held.tensors if held is not None else {}
            moved, sent, _ = execute_plan(plan, old, src, dst, dist.get_rank(),
                                          dtypes={mv.name: torch.float32 for mv in moves})
            total = comm_tensor([sent], torch.float64)
            dist.all_reduce(total)
            sent = int(total.item())
            # all or nobody: a worker lost before every one has its part leaves the old state in place
            m.agree_to_commit("moved", record.group)
            self._held_state = _Held(step, base_config, tuple(job), moved) if m.wid in job else None
        move_seconds = time.perf_counter() - t_move
        if m.wid not in job:
            m.leave_group()
            return False
        if tuple(record.group) != tuple(job):
            m.form_job_group(job)
        else:
            m.job_members = tuple(job)
        m.set_timeout(self.step_timeout)
        logic = self._layout_cm.logic if self._layout_cm is not None else None
        model = self._model or self.build_model()
        # the job state is loaded into it below: a meta model's weights are left unread ("empty")
        trainer = self._new_trainer(configs, model, logic=logic,
                                    weights=EMPTY if first_meta(model) is not None else None)
        self._layout_cm = trainer.cm
        replayed = 0
        if moved is not None:
            trainer.load_job_state(moved, step)
            torch.set_rng_state(meta["rng"])
        else:
            t_move = time.perf_counter()
            manifest = self._load_checkpoint(trainer)
            if not held_by:
                lost = set(trainer.job_state())  # every tensor came from the checkpoint
            move_seconds = time.perf_counter() - t_move
            restored = f"checkpoint step {manifest.step}"
            replayed = max(0, step - manifest.step)
            step = manifest.step
            m.agree_to_commit("restored")
            self._held_state = _Held(step, trainer.config(trainer.base), tuple(job), trainer.job_state())
        self.trainer = trainer
        self._new_checkpointer()
        report = Reconfiguration(
            record.generation, record.reason, step,
            f"{DistConfig.parse(src_spec).name} on {len(src_members)}" if src_spec else "no surviving holder",
            f"{base} on {len(job)}", restored, len(lost), sent, move_seconds, time.perf_counter() - t0, replayed,
            noticed_by, interrupted)
        self.reconfigurations.append(report)
        if self.job_rank == 0:
            self._log(f"[elastic] {record.reason}: {report.source} -> {report.destination} workers after step {step}, "
                      f"state from {restored}" + (f" ({len(lost)} tensors had no surviving copy; replaying "
                                                  f"{replayed} steps)" if lost else f", {sent / 2**20:.2f} MiB moved")
                      + f" in {move_seconds:.2f} s; training again after {report.seconds:.1f} s")
        if self.on_change is not None:
            self.on_change("after", self)
        return True

    def _fixed_base(self, configs: list[DistConfig]) -> str | None:
        """The user's `base`, when it is among these configs (the Trainer then never moves it)."""
        base = self.trainer_options.get("base")
        return base if base in [c.name for c in configs] else None

    def _base(self, configs: list[DistConfig]) -> str:
        """The config the job state arrives in: the fixed base, else the Trainer's starting one."""
        return self._fixed_base(configs) or default_base(configs).name

    @staticmethod
    def _moves(cm, src_config: DistConfig, src_members, dst_config: DistConfig, job,
               group) -> list[TensorMove]:
        """The job state's moves from the old base layout (on the old members, by their rank in the new
        group; members not in it get ids past the group, never used as sources) to the new base on `job`."""
        W = len(group)
        src_devices = [group.index(w) if w in group else W + i for i, w in enumerate(src_members)]
        src = cm.layouts_for(src_config, src_devices)
        dst = cm.layouts_for(dst_config, [group.index(w) for w in job])
        return [TensorMove(state_key(kind, n), src[n].global_shape, 4, src[n], dst[n])
                for kind in JOB_STATE for n in cm.logic.param_names]

    # ------------------------------------------------------------------------------ pieces
    def _new_trainer(self, configs: list[DistConfig], model: nn.Module, logic=None, weights=None) -> Trainer:
        """A Trainer whose base is `_base(configs)`, the layout the job state arrives in. Unless the user
        fixed the base, its first step may move the optimizer to a config the step visits anyway, so that a
        step whose buckets all run under one config switches nothing (elastic moves need ZeRO-1 off)."""
        self._model = model
        options = dict(self.trainer_options, zero1=False, base=self._fixed_base(configs),
                       topology=hosts_topology(self.membership.job_members[:configs[0].world_size]))
        trainer = Trainer(model, configs, logic=logic, weights=weights, **options)
        assert trainer.base == self._base(configs), (trainer.base, self._base(configs))
        trainer.on_phase = self._on_phase
        return trainer

    def _new_checkpointer(self) -> None:
        group = dist.new_group(backend="gloo")  # DCP's planning collectives never meet the step's
        self._checkpoint_group = group
        self.checkpointer = ckpt.AsyncCheckpointer(self.checkpoint_dir, process_group=group)

    def _save_checkpoint(self) -> None:
        t = self.trainer
        state = self._as_dtensors(t, t.job_state())
        meta = dict(step=t.step_count, base=t.base, configs=[c.spec() for c in t.configs],
                    rng=base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode())
        self.checkpointer.save(t.step_count, state, meta)

    @staticmethod
    def _as_dtensors(t: Trainer, local: dict[str, torch.Tensor]) -> dict:
        """{"kind:param": shard in the base layout} as DTensors on the base's mesh (DCP's input)."""
        cm, out = t.cm, {}
        for kind in JOB_STATE:
            out.update({state_key(kind, n): d for n, d in cm.as_dtensors(
                {n: local[state_key(kind, n)] for n in cm.logic.param_names}).items()})
        return out

    def _load_checkpoint(self, t: Trainer) -> ckpt.Manifest:
        """The whole job state from the latest complete checkpoint, resharded into this Trainer's base."""
        path = ckpt.latest(self.checkpoint_dir)
        if path is None:
            raise ElasticError(f"slices of the job state were lost with the failed worker and {self.checkpoint_dir} "
                               "holds no complete checkpoint to restore them from")
        self._log(f"[{self.membership.wid}] restoring the job state from {path}")
        state = self._as_dtensors(t, {state_key(kind, n): torch.empty_like(p) for kind in JOB_STATE
                                   for n, p in t.cm.local_params.items()})
        manifest = ckpt.load(path, state)
        local = {k: v.to_local() for k, v in state.items()}
        t.load_job_state(local, manifest.step)
        rng = base64.b64decode(manifest.meta["rng"])
        torch.set_rng_state(torch.frombuffer(bytearray(rng), dtype=torch.uint8))
        return manifest
