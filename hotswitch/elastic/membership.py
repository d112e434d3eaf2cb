"""Who is in the job: an agent process that owns membership, and in-process regrouping of the workers.

Why not torchrun's elastic agent: on any membership change it restarts *every* worker, so every
byte of model and optimizer state would have to be re-read from a store or a checkpoint, and ranks
are not stable. Here workers survive a change: the agent (the launching process, which holds no
training state and never takes part in a collective) spawns workers, notices a dead one at once (it
is their parent) or a hung one (its heartbeat stops), and publishes numbered *generations*. On one
host the agent hosts the c10d TCPStore; across hosts (`Rendezvous`) every host runs an agent, they
join through torch's rendezvous and share its store, and any of them may publish a generation (the
first `compare_set` on its key wins), a host counting as lost when its agent's heartbeat stops. Survivors
abort their process groups and join the next generation's group in-process, keeping their shards,
so the planner moves only what the new layout lacks and a checkpoint is read only for slices that
no survivor holds.

A generation record names two ordered lists of worker ids: `group` (every worker that takes part
in the move: survivors, joiners and leavers) and `job` (the workers that train afterwards, a
sub-list of `group`). The process group of generation g spans `group`, ranks in list order.

Store keys (all under "elastic/"): "gen/{g}" the JSON record of generation g; "request/{g}" a
planned change asked for by the job's rank 0 in generation g; "samples/{step}" the sample ids of a
committed step; per-generation step agreement under "g{g}/"; heartbeats "hb/{worker}" and
"agent/{agent}/hb"; hosts "agents" (a counter), "agent/{agent}/workers" and ".../admitted";
"started", "finished" and "failed" for the whole job.
"""
from __future__ import annotations

import ctypes
import datetime
import faulthandler
import json
import multiprocessing.util
import os
import pickle
import signal
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
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousParameters

from hotswitch.distributed import _c10d
from hotswitch.distributed.device import default_backend
from hotswitch.distributed.launch import patched_environ, write_whole_lines

__all__ = ["ElasticError", "Fenced", "GenerationRecord", "Membership", "MembershipChanged", "Rendezvous",
           "StoreAddress", "register_rendezvous_store", "run_elastic", "serve_rendezvous"]

LONG_TIMEOUT = datetime.timedelta(minutes=10)  # collectives while compiling/profiling (ranks drift apart)


class ElasticError(RuntimeError):
    """The elastic job cannot go on (too few devices left, a worker raised); the message says which."""


class Fenced(RuntimeError):
    """This worker is out of the job: a generation declared it lost (it looked dead or hung to the
    others), or the job ended while it recovered. It must stop touching the job and leave quietly
    (its agent kills it if it does not)."""


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
HEARTBEAT_S = 0.5  # how often workers and agents beat (a counter in the store)


@dataclass(frozen=True)
class StoreAddress:
    """Where the job's store is, so that any process (an agent, a worker, a thread of either) opens a
    client of its own: a TCPStore at host:port (one host's agent, or the c10d rendezvous), or the store
    of another rendezvous backend, opened by `opener` (see `register_rendezvous_store`); keys under
    `prefix` ("" on one host)."""

    host: str = ""
    port: int = 0
    prefix: str = ""
    opener: Callable[[RendezvousParameters], Any] | None = None  # module level: workers import it by name
    rendezvous: tuple[str, str, str] = ()  # (backend, endpoint, run_id), the parameters `opener` gets

    def connect(self, timeout: datetime.timedelta = datetime.timedelta(minutes=30)):
        """A new client of the store (one per thread: a client's socket must not serve two threads)."""
        if self.opener is None:
            store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timeout)
        else:
            backend, endpoint, run_id = self.rendezvous
            store = self.opener(RendezvousParameters(backend, endpoint, run_id, 1, 1))
            store.set_timeout(timeout)
        return dist.PrefixStore(self.prefix, store) if self.prefix else store


# rendezvous backend -> how a process opens a client of that backend's store (c10d's: a TCPStore).
# None built in besides c10d: torch's etcd store has no compare_set, on which generations rest.
_RENDEZVOUS_STORES: dict[str, Callable[[RendezvousParameters], Any]] = {}
_STORE_OPERATIONS = ("set", "get", "add", "check", "wait", "compare_set")  # what the job asks of its store


def register_rendezvous_store(backend: str, opener: Callable[[RendezvousParameters], Any]) -> None:
    """Make torch's rendezvous backend `backend` (registered in torch's `rendezvous_handler_registry`,
    as torchrun's out-of-tree ones are) usable for hotswitch's elastic jobs. hotswitch keeps its
    generations, step agreement and heartbeats in a store every host and every worker reaches, so it
    needs to open the backend's store: `opener(params)` returns a new client of it (a
    `torch.distributed.Store` with set, get, add, check, wait and compare_set: a TCPStore or a
    FileStore, say) for the endpoint and run id in `params`. `opener` must be a module-level
    function: workers, spawned processes, import it by name. c10d's store is built in; a package can
    also declare its opener as an entry point (see `STORE_ENTRY_POINTS`)."""
    if backend == "c10d":
        raise ValueError("c10d's store is built in (a TCPStore at --rdzv-endpoint)")
    _RENDEZVOUS_STORES[backend] = opener


STORE_ENTRY_POINTS = "hotswitch.rendezvous_stores"  # as torchrun finds out-of-tree handlers in "torchrun.handlers"


def _store_opener(backend: str) -> Callable[[RendezvousParameters], Any] | None:
    """The opener registered for `backend`'s store, or else one an installed package declares under
    the entry point group `STORE_ENTRY_POINTS` (`name = "module:open_store"`), so that the CLI's
    `--rdzv-backend NAME` works with a backend package that also declares its torchrun handler."""
    if backend not in _RENDEZVOUS_STORES:
        from importlib.metadata import entry_points

        for point in entry_points(group=STORE_ENTRY_POINTS, name=backend):
            _RENDEZVOUS_STORES[backend] = point.load()
            break
    return _RENDEZVOUS_STORES.get(backend)


def _check_store(store, backend: str) -> None:
    """Fail at the start, naming the backend, if its store lacks an operation the job needs (torch's
    EtcdStore has no compare_set, for one) rather than at the first generation."""
    key = "elastic/store-check"
    try:
        store.add(key, 0)
        store.compare_set(key, "0", "0")
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        raise ValueError(f"the store of rendezvous backend {backend!r} cannot serve an elastic job: it needs "
                         f"{', '.join(_STORE_OPERATIONS)} ({type(e).__name__}: {e})") from e


@dataclass(frozen=True)
class Rendezvous:
    """How agents on several hosts find each other: torch's rendezvous (`--rdzv-*` as torchrun spells
    them; c10d by default, or any backend of torch's registry whose store was registered with
    `register_rendezvous_store`). The backend's store also holds hotswitch's generations, under
    "hotswitch/<run_id>/", for agents and workers alike."""

    endpoint: str  # c10d: HOST:PORT of its store (`hotswitch rendezvous --port P` serves one); else the backend's
    run_id: str = "hotswitch"
    nproc_per_node: int = 1
    backend: str = "c10d"
    agent_timeout_s: float = 5.0  # an agent whose heartbeat stops this long is gone, with its workers

    def __post_init__(self):
        if self.backend != "c10d" and _store_opener(self.backend) is None:
            known = "".join(f", {b}" for b in sorted(_RENDEZVOUS_STORES))
            raise ValueError(f"--rdzv-backend {self.backend}: hotswitch keeps its generations and step agreement "
                             "in the rendezvous backend's store, and does not know how to open this backend's "
                             f"(it knows c10d{known}). Use c10d, with `hotswitch rendezvous --port P` as its "
                             "endpoint, or register an opener for this backend's store first: "
                             f"hotswitch.elastic.register_rendezvous_store({self.backend!r}, open_store) in "
                             f"Python, or an entry point {self.backend} in group {STORE_ENTRY_POINTS} of a package")
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        host, _, port = self.endpoint.rpartition(":")
        if self.backend == "c10d" and (not host or not port.isdigit()):
            raise ValueError(f"--rdzv-endpoint takes HOST:PORT, got {self.endpoint!r}")

    @property
    def address(self) -> StoreAddress:
        prefix = f"hotswitch/{self.run_id}"
        if self.backend != "c10d":
            return StoreAddress(prefix=prefix, opener=_store_opener(self.backend),
                                rendezvous=(self.backend, self.endpoint, self.run_id))
        host, _, port = self.endpoint.rpartition(":")  # checked above
        return StoreAddress(host, int(port), prefix)

    def handler(self, min_nodes: int, max_nodes: int):
        """torch's `RendezvousHandler` for this job, from torch's registry: short keep-alives, so a
        lost host leaves the rendezvous within seconds and a replacement can join the next round."""
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        params = RendezvousParameters(self.backend, self.endpoint, self.run_id, min_nodes, max_nodes,
                                      last_call_timeout=1, keep_alive_interval=1, keep_alive_max_attempt=3,
                                      join_timeout=600)
        return get_rendezvous_handler(params)


def serve_rendezvous(port: int, host: str = "0.0.0.0", ready: Callable[[int], None] | None = None) -> None:
    """Serve the rendezvous store (`hotswitch rendezvous`) until killed: a process apart from every
    training host, so losing any host loses no membership state (torchft runs its Lighthouse apart)."""
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, multi_tenant=True)
    if ready is not None:
        ready(store.port)
    while True:
        time.sleep(3600)


@dataclass
class _Worker:
    wid: str
    process: Any
    reader: Any
    slot: int = 0  # its GPU on this host (NCCL): the lowest one no live worker holds
    done: bool = False  # sent its result (finished, left, or raised)
    silent: bool = False  # its pipe closed without a result (it died)
    seen: list = field(default_factory=lambda: [0, time.monotonic()])  # its heartbeat counter (see silent_for)


@dataclass
class _Agent:
    """Spawns this host's workers, sees them die (their parent) or hang (their heartbeat stops: they
    are fenced out with SIGKILL), and publishes generations. Across hosts every agent runs the same
    loop on the rendezvous' store: a generation is proposed with compare_set on its key, so the first
    proposal wins and the others re-read it; another host's loss is seen as its agent's heartbeat
    stopping."""

    fn: Callable
    args: tuple
    min_size: int
    max_size: int
    store: Any
    address: StoreAddress
    env: dict[str, str]
    heartbeat_timeout_s: float = 30.0
    rendezvous: Rendezvous | None = None
    workers: dict[str, _Worker] = field(default_factory=dict)
    record: GenerationRecord | None = None
    result: Any = None
    finished: bool = False
    aid: str = ""  # this agent's id across hosts ("" on one host); its workers are "<aid>w<k>"
    next_id: int = 0
    dead: set[str] = field(default_factory=set)  # workers known to be gone (ours, or a lost host's)
    taken: set[str] = field(default_factory=set)  # workers that were in a job once
    peers: dict[str, list] = field(default_factory=dict)  # other agents' heartbeat counters (see silent_for)
    lost_agents: set[str] = field(default_factory=set)
    log: Callable[[str], None] = print
    _host_workers: dict[str, list[str]] = field(default_factory=dict)

    # -- workers
    def spawn(self, rank: int, world: int) -> str:
        wid = f"{self.aid}w{self.next_id}"
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
        p = ctx.Process(target=_worker_main, args=(self.fn, self.args, wid, self.address, writer,
                                                   self.min_size, self.max_size, os.getpid()), name=f"hotswitch-{wid}")
        with patched_environ(env):  # a spawned child copies os.environ at start: RANK as under torchrun
            p.start()
        writer.close()
        self.workers[wid] = _Worker(wid, p, reader, slot)
        return wid

    def alive(self, wid: str) -> bool:
        """Still running and still part of the job (a worker that left or finished is not)."""
        w = self.workers[wid]
        return w.process.exitcode is None and not w.done and not w.silent

    def silent_for(self, key: str, seen: list) -> float:
        """Seconds the heartbeat counter `key` has certainly not moved; `seen` holds [its value, when it
        was first seen]. That time is taken after the read that saw the value and the present one
        before this read, so an observer that was itself stopped in between (a host resumed after a
        SIGSTOP) never overestimates the silence."""
        before = time.monotonic()
        value = self.store.add(key, 0)
        if value != seen[0]:
            seen[:] = [value, time.monotonic()]
            return 0.0
        return before - seen[1]

    def check_heartbeats(self) -> None:
        """Fence out (SIGKILL) a worker whose heartbeat stopped for `heartbeat_timeout_s` (SIGSTOPped,
        or hung with the interpreter stuck): its death then counts as a failure. Before its first beat
        (while it imports torch, which a loaded host makes slow) it gets ten times as long, at least 2 minutes."""
        for w in self.workers.values():
            if not self.alive(w.wid):
                continue
            silent = self.silent_for(f"elastic/hb/{w.wid}", w.seen)
            if silent > (self.heartbeat_timeout_s if w.seen[0] else max(10 * self.heartbeat_timeout_s, 120)):
                self.log(f"[elastic] worker {w.wid} sent no heartbeat for {silent:.1f} s (hung or stopped): "
                         "fenced out with SIGKILL")
                w.process.kill()

    def check_peers(self) -> None:
        """Another host is gone when its agent's heartbeat stops: its workers count as dead."""
        members = set(self.record.group) | set(self.record.job)
        for aid in self.agents():
            if aid == self.aid or aid in self.lost_agents:
                continue
            silent = self.silent_for(f"elastic/agent/{aid}/hb", self.peers.setdefault(aid, [-1, time.monotonic()]))
            if silent > self.rendezvous.agent_timeout_s and any(w.startswith(f"{aid}w") for w in members):
                self.log(f"[elastic] agent {aid} sent no heartbeat for {silent:.1f} s: its host is lost")
                self.lost_agents.add(aid)
                self.dead.update(self.host_workers(aid))

    def agents(self) -> list[str]:
        return [f"a{i}" for i in range(self.store.add("elastic/agents", 0))]

    # -- generations
    def propose(self, record: GenerationRecord) -> bool:
        """Publish `record` unless another agent published that generation first (then adopt theirs)."""
        key, text = f"elastic/gen/{record.generation}", record.to_json()
        won = self.store.compare_set(key, "", text) == text.encode()
        self.follow()
        if won and record.generation:
            self.log(f"[elastic] generation {record.generation} ({record.reason}): job {len(record.job)} workers "
                     f"{list(record.job)}" + (f", lost {list(record.lost)}" if record.lost else ""))
        return won

    def follow(self) -> None:
        """Adopt every generation published since ours; a worker of ours that one declares lost is
        fenced out (it may only look hung to the others)."""
        g = -1 if self.record is None else self.record.generation
        while self.store.check([f"elastic/gen/{g + 1}"]):
            g += 1
            self.record = GenerationRecord.from_json(self.store.get(f"elastic/gen/{g}"))
            self.taken.update(self.record.job)
            for wid in self.record.lost:
                self.dead.add(wid)
                if wid in self.workers and self.alive(wid):
                    self.workers[wid].process.kill()

    def drop_dead(self) -> None:
        """Publish a generation without the dead workers of the current one (a failure)."""
        while True:
            rec = self.record
            lost = tuple(w for w in dict.fromkeys(rec.group + rec.job) if w in self.dead)
            if not lost:
                return
            job = tuple(x for x in rec.job if x not in self.dead)
            group = tuple(x for x in rec.group if x not in self.dead)
            for wid in lost:
                if wid in self.workers:
                    code = self.workers[wid].process.exitcode
                    self.log(f"[elastic] worker {wid} died (exit code {code}"
                             f"{' = signal ' + str(-code) if code and code < 0 else ''})")
            if len(job) < self.min_size:
                raise ElasticError(f"worker {', '.join(lost)} died and {len(job)} workers are left, fewer than the "
                                   f"minimum {self.min_size} (--elastic {self.min_size}:{self.max_size}); the job "
                                   "stops. Restart it from the latest checkpoint with more devices, or lower the "
                                   "minimum")
            if self.propose(GenerationRecord(rec.generation + 1, group, job, lost, "failure")):
                return

    def on_request(self, request: dict) -> None:
        rec = self.record
        job = tuple(w for w in rec.job if w not in self.dead)
        kind, size = request["kind"], int(request.get("size", len(job)))
        if not self.min_size <= size <= self.max_size:
            raise ElasticError(f"a {kind} to {size} workers was requested, outside --elastic "
                               f"{self.min_size}:{self.max_size}")
        if kind == "redeploy":
            new = self.new_workers(size)
            group, job = job + new, new
        elif size > len(job):
            group = job = job + self.new_workers(size - len(job))
        else:
            group, job = job, job[:size]
        self.propose(GenerationRecord(rec.generation + 1, group, job, (), kind))

    def new_workers(self, n: int) -> tuple[str, ...]:
        """On one host: spawn them. Across hosts: idle workers of the hosts that joined (spares)."""
        if self.rendezvous is None:
            return tuple(self.spawn(len(self.record.job) + i, n) for i in range(n))
        busy = set(self.record.group) | self.taken | self.dead  # a worker that left the job has exited
        spares = [w for aid in self.agents() for w in self.host_workers(aid) if w not in busy]
        if len(spares) < n:
            raise ElasticError(f"{n} new workers were requested and the hosts that joined have {len(spares)} idle "
                               "ones: start another host (the same command line) or ask for fewer")
        return tuple(spares[:n])

    # -- hosts (the rendezvous)
    def join_hosts(self, handler) -> None:
        """Take part in the next rendezvous round. Its rank 0 then proposes generation 0 (the first
        round's hosts) or marks the round's hosts admitted: their workers join the job as a scale-out
        as soon as it has room (`admit`), at once unless it is full."""
        with patched_environ({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}):  # no bootstrap store of its own
            info = handler.next_rendezvous()
        info.store.set(f"hotswitch/agent/{info.rank}", self.aid)
        if info.rank != 0:
            return
        hosts = [info.store.get(f"hotswitch/agent/{r}").decode() for r in range(info.world_size)]
        if not self.store.check(["elastic/gen/0"]):
            job = tuple(w for aid in hosts for w in self.host_workers(aid))[:self.max_size]
            self.propose(GenerationRecord(0, job, job))
        for aid in hosts:
            self.store.set(f"elastic/agent/{aid}/admitted", "1")

    def host_workers(self, aid: str) -> list[str]:
        """Agent `aid`'s workers (written once, before it joins: read once)."""
        if aid not in self._host_workers:
            self._host_workers[aid] = json.loads(self.store.get(f"elastic/agent/{aid}/workers"))
        return self._host_workers[aid]

    def admit(self) -> None:
        """A scale-out to the idle workers of admitted hosts while the job has fewer than MAX workers
        (a worker is taken in once: one that left by a planned scale-in stays out)."""
        while len(self.record.job) < self.max_size:
            rec = self.record
            busy = set(rec.group) | self.taken | self.dead
            new = tuple(w for aid in self.agents() if self.store.check([f"elastic/agent/{aid}/admitted"])
                        for w in self.host_workers(aid) if w not in busy)[:self.max_size - len(rec.job)]
            if not new or self.propose(GenerationRecord(rec.generation + 1, rec.job + new, rec.job + new, (), "scale")):
                return

    def watch_hosts(self, handler, stop: threading.Event, errors: list) -> None:
        """Background: whenever a host waits to join, run a rendezvous round with it (torchrun's agent
        does the same, but restarts every worker; here the job only grows)."""
        try:
            while not stop.wait(1.0):
                if handler.num_nodes_waiting() > 0:
                    self.join_hosts(handler)
        except Exception as e:  # noqa: BLE001 - reported by the main loop
            errors.append(e)

    # -- the loop
    def run(self, world_size: int, poll_s: float = 0.02) -> Any:
        stop, errors = threading.Event(), []
        handler = None
        if self.rendezvous is None:
            job = tuple(self.spawn(r, world_size) for r in range(world_size))
            self.propose(GenerationRecord(0, job, job))
        else:
            nproc = self.rendezvous.nproc_per_node
            self.aid = f"a{self.store.add('elastic/agents', 1) - 1}"
            mine = [self.spawn(k, nproc) for k in range(nproc)]
            self.store.set(f"elastic/agent/{self.aid}/workers", json.dumps(mine))  # before the round: see admit
            self.store.add(f"elastic/agent/{self.aid}/hb", 1)
            beat = threading.Thread(target=_beat, args=(self.address, f"elastic/agent/{self.aid}/hb", stop),
                                    name="hotswitch-agent-heartbeat", daemon=True)
            beat.start()
            # spare hosts are welcome (a round with more hosts than the job needs leaves workers idle)
            handler = self.rendezvous.handler(-(-world_size // nproc), max(-(-world_size // nproc), 1024))
            self.log(f"[elastic] agent {self.aid} (workers {', '.join(mine)}) joining rendezvous "
                     f"{self.rendezvous.run_id} at {self.rendezvous.endpoint}")
        try:
            if handler is not None:
                try:
                    self.join_hosts(handler)
                except RendezvousClosedError:
                    if not self.store.check(["elastic/finished"]):
                        raise
                    self.log(f"[elastic] agent {self.aid}: the job had finished before this host joined")
                    return None
                threading.Thread(target=self.watch_hosts, args=(handler, stop, errors), name="hotswitch-rendezvous",
                                 daemon=True).start()
                while not self.store.check(["elastic/gen/0"]):
                    time.sleep(poll_s)
                self.follow()
            failure = self.loop(poll_s, errors)
        finally:
            stop.set()
            for w in self.workers.values():
                if w.process.exitcode is None:
                    w.process.kill()
                w.process.join()
                w.reader.close()
            if handler is not None:
                handler.shutdown()
        if failure:
            raise ElasticError(failure)
        if not self.finished and self.rendezvous is None:
            raise ElasticError("every worker ended but none reported the finished job (see the output above)")
        return self.result

    def loop(self, poll_s: float, errors: list) -> str | None:
        """Until the job finishes (or fails): the failure message or None."""
        checked = time.monotonic()
        while True:
            if any(w.process.exitcode is None or not (w.done or w.wid in self.dead)  # running, or its end unseen
                   for w in self.workers.values()):
                failure = self.poll_workers(poll_s)
            else:
                if self.rendezvous is None or self.store.check(["elastic/finished"]):
                    return None
                failure = None
                time.sleep(poll_s)
            if failure is None and self.rendezvous is not None and self.store.check(["elastic/failed"]):
                failure = self.store.get("elastic/failed").decode()
            if failure is None and errors:
                failure = f"the rendezvous failed: {errors[0]!r}"
            try:
                if failure is None:
                    self.follow()
                    if time.monotonic() - checked > HEARTBEAT_S:
                        checked = time.monotonic()
                        self.check_heartbeats()
                        if self.rendezvous is not None:
                            self.check_peers()
                            self.admit()
                    self.drop_dead()
                    key = f"elastic/request/{self.record.generation}"
                    if self.store.check([key]) and self.store.compare_set(f"{key}/agent", "", self.aid or "-") \
                            == (self.aid or "-").encode():
                        self.on_request(json.loads(self.store.get(key)))
            except ElasticError as e:
                failure = str(e)
            if failure is not None:
                if self.rendezvous is not None:
                    self.store.compare_set("elastic/failed", "", failure)
                return failure

    def poll_workers(self, poll_s: float) -> str | None:
        """Wait up to `poll_s` for a worker's result or death, then take in every result and every death.

        A death is read from the exit code, whatever woke the wait: a worker's pipe can close before its
        process is reaped, and `exitcode` reaps it, so a death seen only through the sentinel's readiness
        could be missed for good (the job then hung: survivors waited at a commit for a dead peer and no
        generation came). The exit code is read before the pipe, so a worker that sent its result and
        exited is never taken for dead."""
        readers = [w.reader for w in self.workers.values() if not w.done and not w.silent]
        sentinels = [w.process.sentinel for w in self.workers.values() if not w.done and w.wid not in self.dead]
        connection.wait([*readers, *sentinels], timeout=poll_s)
        for w in self.workers.values():
            if w.done or w.wid in self.dead:
                continue
            exited = w.process.exitcode is not None  # before the pipe: all it sent is in there by now
            if not w.silent and w.reader.poll():
                try:
                    status, payload = w.reader.recv()
                except (EOFError, OSError):
                    w.silent = True  # died without a result
                else:
                    w.done = True
                    if status == "error":  # a fenced worker is dead already: its last words do not count
                        return f"worker {w.wid} failed:\n{payload}"
                    if status == "result":
                        self.result, self.finished = pickle.loads(payload), True
                        self.store.set("elastic/finished", self.aid or "-")
                    continue
            if exited:
                w.process.join()
                self.dead.add(w.wid)
        return None


def _beat(address: StoreAddress, key: str, stop: threading.Event) -> None:
    """Count up `key` every HEARTBEAT_S until `stop` (a thread with a store client of its own)."""
    store = address.connect()
    store.add(key, 1)  # at once: from here on the short timeout applies
    while not stop.wait(HEARTBEAT_S):
        store.add(key, 1)


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when the agent that spawned it dies (a lost host loses its workers
    too, instead of leaving them blocked in collectives)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the call
        os._exit(1)


def run_elastic(fn: Callable[..., Any], world_size: int, *args: Any, min_size: int | None = None,
                max_size: int | None = None, log: Callable[[str], None] = print, heartbeat_timeout_s: float = 30.0,
                rendezvous: Rendezvous | None = None) -> Any:
    """Run `fn(membership, *args)` on `world_size` spawned workers that may fail, hang, join and leave.

    `fn` (picklable, module level) runs in every worker, including workers spawned later for a
    scale-out or redeployment; it returns a value to report (the finished job's rank 0 reports it:
    `membership.finish(value)`) or returns None when the worker leaves. Returns the reported value.
    A worker whose heartbeat stops for `heartbeat_timeout_s` is killed (fenced out) and counts as failed.
    Raises ElasticError when fewer than `min_size` workers remain or a worker raises.

    With `rendezvous`, this is one host's agent: it spawns `rendezvous.nproc_per_node` workers and
    joins the other hosts' agents (the same call on every host); the job starts with `world_size`
    workers once enough hosts have joined, a host joining later is a scale-out, a host lost
    (its agent's heartbeat stops) a failure. Returns the result on the host whose worker reported
    it, None on the others.
    """
    min_size = world_size if min_size is None else min_size
    max_size = world_size if max_size is None else max_size
    if not 1 <= min_size <= world_size <= max_size:
        raise ValueError(f"need 1 <= MIN <= world size <= MAX, got MIN={min_size}, world size {world_size}, "
                         f"MAX={max_size}")
    server = None
    if rendezvous is None:
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        address = StoreAddress("127.0.0.1", server.port)
    else:
        address = rendezvous.address
    store = address.connect()
    if rendezvous is not None and rendezvous.backend != "c10d":
        _check_store(store, rendezvous.backend)
    env = {"MASTER_ADDR": address.host, "MASTER_PORT": str(address.port)} if address.opener is None else {}
    agent = _Agent(fn, args, min_size, max_size, store, address, env, heartbeat_timeout_s, rendezvous, log=log)
    try:
        return agent.run(world_size)
    finally:
        del store, server


def _worker_main(fn, args, wid: str, address: StoreAddress, results, min_size: int, max_size: int,
                 parent: int) -> None:
    _die_with_parent(parent)
    faulthandler.enable(all_threads=True)  # a crash (SIGSEGV, SIGABRT) prints every thread's stack to stderr
    status, payload = "error", None
    membership = None
    write_whole_lines()
    try:
        torch.set_num_threads(1)
        threading.Thread(target=_beat, args=(address, f"elastic/hb/{wid}", threading.Event()),
                         name="hotswitch-heartbeat", daemon=True).start()
        membership = Membership(wid, address.connect(), min_size, max_size, address=address)
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

    def __init__(self, wid: str, store, min_size: int, max_size: int, backend: str | None = None,
                 address: StoreAddress | None = None):
        self.wid, self.store, self.address = wid, store, address
        self.min_size, self.max_size = min_size, max_size
        # nccl where every worker the job may grow to has a GPU; HOTSWITCH_BACKEND overrides
        self.backend = backend or os.environ.get("HOTSWITCH_BACKEND") or default_backend(max_size)
        self.record: GenerationRecord | None = None
        self.job_members: tuple[str, ...] = ()  # the workers training now (rank order)
        self.finished = False
        self._pg_name = ""
        self._watch_store = None  # the peer watch's own store client, made once (see watch_peers)
        self.init_timeout = LONG_TIMEOUT  # how long forming a group waits for a member (ElasticJob: its step timeout)
        self.wait_timeout = LONG_TIMEOUT  # how long a store barrier or commit waits, as a collective may

    # -- generations
    @property
    def generation(self) -> int:
        return -1 if self.record is None else self.record.generation

    def next_record(self, timeout: datetime.timedelta = LONG_TIMEOUT) -> GenerationRecord | None:
        """Wait for the first generation after the current one that includes this worker; None when
        the job ended first. Raises Fenced when a generation declares this worker lost."""
        g = self.generation + 1
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            key = f"elastic/gen/{g}"
            if not self.store.check([key]):
                if self.store.check(["elastic/finished"]) or self.store.check(["elastic/failed"]):
                    return None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no generation {g} was published within {timeout}")
                time.sleep(0.01)
                continue
            record = GenerationRecord.from_json(self.store.get(key))
            if self.wid in record.lost:
                raise Fenced(f"generation {g} declared worker {self.wid} lost")
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
        # everyone there first (in the store, aborted by a newer generation): a member that died during
        # the change must not leave the others blocked in init_process_group for its long timeout
        self.barrier(f"{name}/init", members)
        prefix = dist.PrefixStore(f"elastic/pg/{name}", self.store)
        # connecting may wait only `init_timeout` for a member (one stopped just after the barrier
        # raises here, and the next generation is formed without it), later operations LONG_TIMEOUT
        dist.init_process_group(self.backend, store=prefix, rank=members.index(self.wid), world_size=len(members),
                                timeout=self.init_timeout)
        self.set_timeout(LONG_TIMEOUT)
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
            self._watch_store = self.store if self.address is None else self.address.connect(LONG_TIMEOUT)
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
    def barrier(self, tag: str, members: tuple[str, ...] | None = None, poll_s: float = 0.005) -> None:
        """Wait until every job worker (or every one of `members`) reached `tag`; raise MembershipChanged
        if a newer generation is published before or while we wait (nothing starts in a superseded generation:
        it would run on while its members are alive, e.g. after a scale-out was published)."""
        if self.newer_published():
            raise MembershipChanged(f"generation {self.generation + 1} published before {tag!r}")
        keys, since = self._arrive(tag, members), time.monotonic()
        while not self.store.check(keys):
            if self.newer_published():
                raise MembershipChanged(f"generation {self.generation + 1} published while waiting at {tag!r}")
            self._check_overdue(tag, keys, since)
            time.sleep(poll_s)

    def agree_to_commit(self, tag: str, members: tuple[str, ...] | None = None, poll_s: float = 0.005) -> None:
        """Two-phase commit of a step: return only when the step is decided "commit" (every job
        worker arrived), raise MembershipChanged if it was decided "abort" (a newer generation was
        published first). The first decision, set atomically in the store, binds every worker.
        `members`: who must arrive (default the job's workers)."""
        keys, since = self._arrive(tag, members), time.monotonic()
        decision_key = f"elastic/g{self.generation}/{tag}/decision"
        while True:
            if self.store.check(keys):
                decision = self.store.compare_set(decision_key, "", "commit")
            elif self.newer_published():
                decision = self.store.compare_set(decision_key, "", "abort")
            else:
                self._check_overdue(tag, keys, since)
                time.sleep(poll_s)
                continue
            if decision == b"commit":
                return
            raise MembershipChanged(f"step {tag!r} aborted: generation {self.generation + 1} was published")

    def decide_abort(self, tag: str) -> bool:
        """After a failure: True if `tag` was committed (by everyone's arrival), else decide abort."""
        key = f"elastic/g{self.generation}/{tag}/decision"
        return self.store.compare_set(key, "", "abort") == b"commit"

    def _check_overdue(self, tag: str, keys: list[str], since: float) -> None:
        """A store wait is bounded as a collective is (`wait_timeout`): a peer that neither arrives nor is
        declared lost (hung with its heartbeat still beating, or lost by the agent) ends it with an error
        that names the peer; the job then recovers if a generation comes, or stops with that error."""
        waited = time.monotonic() - since
        if waited > self.wait_timeout.total_seconds():
            missing = [k.rpartition("/")[2] for k in keys if not self.store.check([k])]
            raise TimeoutError(f"{self.wid} waited {waited:.0f} s at {tag!r} of generation {self.generation} for "
                               f"{', '.join(missing)}, which neither arrived nor was declared lost")

    def _arrive(self, tag: str, members: tuple[str, ...] | None = None) -> list[str]:
        base = f"elastic/g{self.generation}/{tag}"
        self.store.set(f"{base}/{self.wid}", "1")
        return [f"{base}/{w}" for w in (self.job_members if members is None else members)]
