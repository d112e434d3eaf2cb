"""Who is in the job: an agent process that owns membership, and in-process regrouping of the workers.

Why not torchrun's elastic agent: on any membership change it restarts *every* worker, so every
byte of model and optimizer state would have to be re-read from a store or a checkpoint, and ranks
are not stable. Here workers survive a change: the agent (the launching process, which holds no
training state and never takes part in a collective) hosts the c10d TCPStore, spawns workers,
notices a dead one at once (it is their parent), and publishes numbered *generations*; survivors
abort their process groups and join the next generation's group in-process, keeping their shards,
so the planner moves only what the new layout lacks and a checkpoint is read only for slices that
no survivor holds.

A generation record names two ordered lists of worker ids: `group` (every worker that takes part
in the move: survivors, joiners and leavers) and `job` (the workers that train afterwards, a
sub-list of `group`). The process group of generation g spans `group`, ranks in list order.

Store keys (all under "elastic/"): "gen/{g}" the JSON record of generation g; "request/{g}" a
planned change asked for by the job's rank 0 in generation g; "samples/{step}" the sample ids of a
committed step; per-generation step agreement under "g{g}/".
"""
from __future__ import annotations

import datetime
import json
import multiprocessing.util
import os
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from multiprocessing import connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hotswitch.distributed import _c10d
from hotswitch.distributed.device import default_backend
from hotswitch.distributed.launch import patched_environ, write_whole_lines

__all__ = ["ElasticError", "GenerationRecord", "Membership", "MembershipChanged", "run_elastic"]

LONG_TIMEOUT = datetime.timedelta(minutes=10)  # collectives while compiling/profiling (ranks drift apart)


class ElasticError(RuntimeError):
    """The elastic job cannot go on (too few devices left, a worker raised); the message says which."""


class MembershipChanged(RuntimeError):
    """A newer generation was published while this step ran: the step is abandoned (nothing was updated)."""


@dataclass(frozen=True)
class GenerationRecord:
    generation: int
    group: tuple[str, ...]  # worker ids taking part in the move, in rank order
    job: tuple[str, ...]  # worker ids training afterwards (a sub-list of group)
    lost: tuple[str, ...] = ()  # workers of the previous job that died
    reason: str = "start"  # start | failure | scale | redeploy

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> GenerationRecord:
        d = json.loads(text)
        return cls(d["generation"], tuple(d["group"]), tuple(d["job"]), tuple(d["lost"]), d["reason"])


# ------------------------------------------------------------------------------------ the agent
@dataclass
class _Worker:
    wid: str
    process: Any
    reader: Any
    slot: int = 0  # its GPU on this host (NCCL): the lowest one no live worker holds
    done: bool = False  # sent its result (finished, left, or raised)
    silent: bool = False  # its pipe closed without a result (it died)


@dataclass
class _Agent:
    fn: Callable
    args: tuple
    min_size: int
    max_size: int
    store: Any
    env: dict[str, str]
    workers: dict[str, _Worker] = field(default_factory=dict)
    record: GenerationRecord | None = None
    result: Any = None
    finished: bool = False
    next_id: int = 0
    log: Callable[[str], None] = print

    def spawn(self, rank: int, world: int) -> str:
        wid = f"w{self.next_id}"
        self.next_id += 1
        ctx = mp.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        held = {w.slot for w in self.workers.values() if w.process.exitcode is None}
        slot = min(set(range(len(held) + 1)) - held)
        env = {**self.env, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(slot),
               "LOCAL_WORLD_SIZE": str(world), "HOTSWITCH_WORKER": wid, "OMP_NUM_THREADS": "1",
               # NCCL: a timed-out or aborted collective raises in the worker (which then recovers)
               # instead of the watchdog tearing the process down (torch's default)
               "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")}
        p = ctx.Process(target=_worker_main, args=(self.fn, self.args, wid, self.store.port, writer,
                                                   self.min_size, self.max_size), name=f"hotswitch-{wid}")
        with patched_environ(env):  # a spawned child copies os.environ at start: RANK as under torchrun
            p.start()
        writer.close()
        self.workers[wid] = _Worker(wid, p, reader, slot)
        return wid

    def publish(self, record: GenerationRecord) -> None:
        self.record = record
        self.store.set(f"elastic/gen/{record.generation}", record.to_json())
        if record.generation:
            self.log(f"[elastic] generation {record.generation} ({record.reason}): job {len(record.job)} workers "
                     f"{list(record.job)}" + (f", lost {list(record.lost)}" if record.lost else ""))

    def alive(self, wid: str) -> bool:
        """Still running and still part of the job (a worker that left or finished is not)."""
        w = self.workers[wid]
        return w.process.exitcode is None and not w.done and not w.silent

    def on_exit(self, w: _Worker) -> None:
        """A worker process ended without a result: its device is gone."""
        rec = self.record
        if w.wid not in rec.group and w.wid not in rec.job:
            return
        job = tuple(x for x in rec.job if x != w.wid and self.alive(x))
        group = tuple(x for x in rec.group if x != w.wid and self.alive(x))
        code = w.process.exitcode
        self.log(
            f"[elastic] worker {w.wid} died (exit code {code}{' = signal ' + str(-code) if code and code < 0 else ''})"
        )
        if len(job) < self.min_size:
            raise ElasticError(f"worker {w.wid} died and {len(job)} workers are left, fewer than the minimum "
                               f"{self.min_size} (--elastic {self.min_size}:{self.max_size}); the job stops. Restart "
                               "it from the latest checkpoint with more devices, or lower the minimum")
        self.publish(GenerationRecord(rec.generation + 1, group, job, (w.wid,), "failure"))

    def on_request(self, request: dict) -> None:
        rec = self.record
        rec = GenerationRecord(rec.generation, rec.group, tuple(w for w in rec.job if self.alive(w)))  # spares left
        kind, size = request["kind"], int(request.get("size", len(rec.job)))
        if not self.min_size <= size <= self.max_size:
            raise ElasticError(f"a {kind} to {size} workers was requested, outside --elastic "
                               f"{self.min_size}:{self.max_size}")
        job = rec.job
        if kind == "redeploy":
            new = tuple(self.spawn(i, size) for i in range(size))
            group, job = job + new, new
        elif size > len(job):
            new = tuple(self.spawn(len(job) + i, size) for i in range(size - len(job)))
            group = job = job + new
        else:
            group, job = job, job[:size]
        self.publish(GenerationRecord(rec.generation + 1, group, job, (), kind))

    def run(self, world_size: int, poll_s: float = 0.02) -> Any:
        job = tuple(self.spawn(r, world_size) for r in range(world_size))
        self.publish(GenerationRecord(0, job, job))
        failure: str | None = None
        while any(w.process.exitcode is None for w in self.workers.values()):
            readers = {w.reader: w for w in self.workers.values() if not w.done and not w.silent}
            sentinels = {w.process.sentinel: w for w in self.workers.values() if w.process.exitcode is None}
            ready = connection.wait([*readers, *sentinels], timeout=poll_s)
            for r in ready:
                if r in readers:
                    w = readers[r]
                    try:
                        status, payload = r.recv()
                    except (EOFError, OSError):
                        w.silent = True  # died without a result: its sentinel reports it
                        continue
                    w.done = True
                    if status == "error":
                        failure = f"worker {w.wid} failed:\n{payload}"
                    elif status == "result":
                        self.result, self.finished = pickle.loads(payload), True
            if failure:
                break
            for r in ready:
                if r in sentinels:
                    w = sentinels[r]
                    w.process.join()
                    if not w.done:
                        try:
                            self.on_exit(w)
                        except ElasticError as e:
                            failure = str(e)
            if failure:
                break
            key = f"elastic/request/{self.record.generation}"
            if self.store.check([key]):
                try:
                    self.on_request(json.loads(self.store.get(key)))
                except ElasticError as e:
                    failure = str(e)
                    break
        for w in self.workers.values():
            if w.process.exitcode is None:
                w.process.kill()
            w.process.join()
            w.reader.close()
        if failure:
            raise ElasticError(failure)
        if not self.finished:
            raise ElasticError("every worker ended but none reported the finished job (see the output above)")
        return self.result


def run_elastic(fn: Callable[..., Any], world_size: int, *args: Any, min_size: int | None = None,
                max_size: int | None = None, log: Callable[[str], None] = print) -> Any:
    """Run `fn(membership, *args)` on `world_size` spawned workers that may fail, join and leave.

    `fn` (picklable, module level) runs in every worker, including workers spawned later for a
    scale-out or redeployment; it returns a value to report (the finished job's rank 0 reports it:
    `membership.finish(value)`) or returns None when the worker leaves. Returns the reported value.
    Raises ElasticError when fewer than `min_size` workers remain or a worker raises.
    """
    min_size = world_size if min_size is None else min_size
    max_size = world_size if max_size is None else max_size
    if not 1 <= min_size <= world_size <= max_size:
        raise ValueError(f"need 1 <= MIN <= world size <= MAX, got MIN={min_size}, world size {world_size}, "
                         f"MAX={max_size}")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}
    agent = _Agent(fn, args, min_size, max_size, store, env, log=log)
    try:
        return agent.run(world_size)
    finally:
        del store


def _worker_main(fn, args, wid: str, port: int, results, min_size: int, max_size: int) -> None:
    status, payload = "error", None
    membership = None
    write_whole_lines()
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), port, is_master=False,
                              timeout=datetime.timedelta(minutes=30))
        membership = Membership(wid, store, min_size, max_size)
        if membership.backend == "nccl":  # the GPU the agent gave this worker (no live worker shares it)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        value = fn(membership, *args)
        status = "result" if membership.finished else "left"
        payload = pickle.dumps(value) if membership.finished else None
    except BaseException:
        payload = traceback.format_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    results.send((status, payload))
    results.close()
    multiprocessing.util._run_finalizers(0)
    os._exit(0 if status != "error" else 1)  # no interpreter teardown: a stuck gloo thread must not hang exit


# --------------------------------------------------------------------------------- worker side
class Membership:
    """A worker's view of the job: the current generation, its process group, and the step agreement."""

    def __init__(self, wid: str, store, min_size: int, max_size: int, backend: str | None = None):
        self.wid, self.store = wid, store
        self.min_size, self.max_size = min_size, max_size
        # nccl where every worker the job may grow to has a GPU; HOTSWITCH_BACKEND overrides
        self.backend = backend or os.environ.get("HOTSWITCH_BACKEND") or default_backend(max_size)
        self.record: GenerationRecord | None = None
        self.job_members: tuple[str, ...] = ()  # the workers training now (rank order)
        self.finished = False
        self._pg_name = ""
        self._watch_store = None  # the peer watch's own store client, made once (see watch_peers)

    # -- generations
    @property
    def generation(self) -> int:
        return -1 if self.record is None else self.record.generation

    def next_record(self, timeout: datetime.timedelta = LONG_TIMEOUT) -> GenerationRecord:
        """Wait for the first generation after the current one that includes this worker."""
        g = self.generation + 1
        while True:
            key = f"elastic/gen/{g}"
            self.store.wait([key], timeout)
            record = GenerationRecord.from_json(self.store.get(key))
            if self.wid in record.group:
                return record
            g += 1  # a generation between the one we knew and ours that did not involve us

    def newer_published(self) -> bool:
        return self.store.check([f"elastic/gen/{self.generation + 1}"])

    def join(self, record: GenerationRecord) -> None:
        """Leave the current process groups and form `record`'s group (ranks in `record.group` order)."""
        self.leave_group()
        self.record = record
        self.job_members = record.job
        self._init(record.group, f"g{record.generation}")

    def form_job_group(self, members: tuple[str, ...]) -> None:
        """After a move with leavers: a group of the workers that train on (this worker is one)."""
        assert self.wid in members
        self.leave_group()
        self.job_members = tuple(members)
        self._init(self.job_members, f"g{self.record.generation}/job")

    def _init(self, members: tuple[str, ...], name: str) -> None:
        prefix = dist.PrefixStore(f"elastic/pg/{name}", self.store)
        dist.init_process_group(self.backend, store=prefix, rank=members.index(self.wid), world_size=len(members),
                                timeout=LONG_TIMEOUT)
        self._pg_name = name

    @staticmethod
    def leave_group() -> None:
        """Drop every process group of this worker. gloo cannot cancel an operation blocked on a dead
        peer (abort and shutdown leave it waiting), which is why steps run with a short timeout."""
        _c10d.abort_all_groups()  # every group; makes init_process_group possible again

    @contextmanager
    def watch_peers(self, abort: Callable[[], None] = _c10d.abort_all_groups, poll_s: float = 0.05) -> Iterator[None]:
        """While the block runs (a training step), abort this worker's communicators as soon as the agent
        publishes a newer generation (it does so the moment a worker dies), so a collective blocked on
        the dead peer raises at once instead of after the step timeout. NCCL can abort a blocked
        communicator; gloo cannot (its operations wait on regardless), so on gloo this does nothing and
        the step timeout detects the dead peer."""
        if self.backend != "nccl":
            yield
            return
        if self._watch_store is None:  # a client of its own: one socket must not serve two threads
            self._watch_store = self.store if not isinstance(self.store, dist.TCPStore) else dist.TCPStore(
                self.store.host, self.store.port, is_master=False, timeout=LONG_TIMEOUT)
        store = self._watch_store
        key = f"elastic/gen/{self.generation + 1}"
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(poll_s):
                if store.check([key]):
                    abort()
                    return

        watcher = threading.Thread(target=watch, name=f"hotswitch-peer-watch-{self.wid}", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            stop.set()
            watcher.join()

    def request(self, kind: str, size: int | None = None) -> None:
        """Ask the agent for a planned change (called by the job's rank 0 at a step boundary)."""
        body = {"kind": kind} if size is None else {"kind": kind, "size": int(size)}
        self.store.set(f"elastic/request/{self.generation}", json.dumps(body))

    def finish(self) -> None:
        """Mark this worker's return value as the job's result (the finished job's rank 0)."""
        self.finished = True

    # -- collectives' timeouts
    @staticmethod
    def set_timeout(timeout: datetime.timedelta, keep=()) -> None:
        """The timeout of every later operation on every process group of this worker but those in `keep`
        (a checkpoint's background group must not inherit a step's short timeout)."""
        for pg in _c10d.process_groups():
            if all(pg is not k for k in keep):
                _c10d.set_timeout(timeout, pg)

    # -- agreement through the store (never blocks on a dead peer)
    def barrier(self, tag: str, poll_s: float = 0.005) -> None:
        """Wait until every job worker reached `tag`; raise MembershipChanged if a newer generation
        appears first (a peer died while we waited)."""
        keys = self._arrive(tag)
        while not self.store.check(keys):
            if self.newer_published():
                raise MembershipChanged(f"generation {self.generation + 1} published while waiting at {tag!r}")
            time.sleep(poll_s)

    def agree_to_commit(self, tag: str, poll_s: float = 0.005) -> None:
        """Two-phase commit of a step: return only when the step is decided "commit" (every job
        worker arrived), raise MembershipChanged if it was decided "abort" (a newer generation was
        published first). The first decision, set atomically in the store, binds every worker."""
        keys = self._arrive(tag)
        decision_key = f"elastic/g{self.generation}/{tag}/decision"
        while True:
            if self.store.check(keys):
                decision = self.store.compare_set(decision_key, "", "commit")
            elif self.newer_published():
                decision = self.store.compare_set(decision_key, "", "abort")
            else:
                time.sleep(poll_s)
                continue
            if decision == b"commit":
                return
            raise MembershipChanged(f"step {tag!r} aborted: generation {self.generation + 1} was published")

    def decide_abort(self, tag: str) -> bool:
        """After a failure: True if `tag` was committed (by everyone's arrival), else decide abort."""
        key = f"elastic/g{self.generation}/{tag}/decision"
        return self.store.compare_set(key, "", "abort") == b"commit"

    def _arrive(self, tag: str) -> list[str]:
        base = f"elastic/g{self.generation}/{tag}"
        self.store.set(f"{base}/{self.wid}", "1")
        return [f"{base}/{w}" for w in self.job_members]
