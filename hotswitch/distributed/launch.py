"""Run a function on `world_size` local processes with a process group: `launch(fn, 4, *args)`.

Each process gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
OMP_NUM_THREADS=1 (and HOTSWITCH_DEVICES_PER_NODE when `devices_per_node` is given) in its
environment, joins the default process group, calls `fn(rank, *args)` and leaves the group. Processes
are forked from a server that has imported torch once (`process_context`).
`launch` returns rank 0's return value; a rank that raises has its traceback re-raised here, naming
the rank, and the other ranks are stopped. `fn` and `args` must be picklable (`fn` at module level).

Under torchrun (RANK and WORLD_SIZE already set) or inside an initialized process group, `launch`
runs `fn` in this process only and returns its value.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import io
import math
import multiprocessing.util
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing import connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hotswitch.distributed.device import default_backend
from hotswitch.distributed.netns import in_namespace

__all__ = ["LaunchError", "call_in_process", "launch", "process_context"]

_GRACE_S = 2.0  # after a rank fails, how long to wait for the others' reports


class LaunchError(RuntimeError):
    """A rank failed: `rank` is the first one that did, the message holds its traceback."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


def launch(fn: Callable[..., Any], world_size: int, *args: Any, devices_per_node: int | None = None,
           backend: str | None = None, timeout: float | None = None, nodes=None) -> Any:
    """Call `fn(rank, *args)` on `world_size` processes in one process group; return rank 0's value.

    `backend`: "nccl" (each process on GPU LOCAL_RANK) or "gloo" (CPU); default nccl when this
    machine has a GPU per process. `timeout` (seconds) bounds the whole run and every collective; None waits forever.
    `nodes`, an entered `hotswitch.netns.EmulatedNodes`, puts each node's ranks in that node's
    network namespace.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if devices_per_node is not None and (devices_per_node < 1 or world_size % devices_per_node):
        raise ValueError(f"devices_per_node={devices_per_node} must be positive and divide world_size={world_size}")
    if dist.is_initialized() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        running = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
        if running != world_size:
            raise ValueError(f"launch(world_size={world_size}) inside a job of {running} processes "
                             f"(torchrun or an initialized process group): pass world_size={running}")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", running))  # this node's processes (torchrun says)
        return _run_in_process(fn, args, _checked_backend(backend, local, local), timeout)

    # started here: every rank runs on this machine (emulated nodes too), each on a GPU of its own
    backend = _checked_backend(backend, world_size, world_size)

    per_node = devices_per_node or world_size
    master = nodes.address(0) if nodes is not None else "127.0.0.1"
    with in_namespace(nodes.node_namespace(0) if nodes is not None else None):  # the store listens in node 0
        store = dist.TCPStore(master, 0, is_master=True, wait_for_workers=False)  # port 0: no port race
    ctx = process_context()
    procs, readers = [], {}
    try:
        for rank in range(world_size):
            env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank % per_node),
                   "LOCAL_WORLD_SIZE": str(per_node), "MASTER_ADDR": master, "MASTER_PORT": str(store.port),
                   "OMP_NUM_THREADS": "1"}
            if devices_per_node is not None:
                env["HOTSWITCH_DEVICES_PER_NODE"] = str(devices_per_node)
            if "nccl" in backend:
                env["HOTSWITCH_GPU"] = str(rank)  # LOCAL_RANK repeats across emulated nodes; GPUs must not
            if nodes is not None:
                env.update(nodes.rank_env(rank, per_node))
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, args=(fn, args, rank, world_size, store.port, backend, timeout, writer,
                                                  {**os.environ, **env}), name=f"hotswitch-rank{rank}")
            with patched_environ(env):  # a spawned child copies os.environ (a forked one takes it from its args)
                p.start()
            writer.close()
            procs.append(p)
            readers[reader] = rank
        return _collect(procs, readers, timeout)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        for r in readers:
            r.close()
        del store


def _checked_backend(backend: str | None, processes: int, gpus_needed: int) -> str:
    """`backend`, or nccl when this machine has a GPU for each of its `processes`; an NCCL launch
    without a GPU per process is refused with the fix."""
    backend = backend or default_backend(processes)
    if "nccl" in backend and torch.cuda.device_count() < gpus_needed:
        raise ValueError(f"backend={backend!r} puts one process on each GPU, but {gpus_needed} processes on this "
                         f"machine need {gpus_needed} GPUs and it has {torch.cuda.device_count()}; "
                         "use fewer processes or backend='gloo'")
    return backend


def _collect(procs, readers, timeout):
    """Wait for every rank's (ok, payload, when) message; raise for the rank that failed first.

    A failure takes its peers down with it (their collectives error out or hang), so after the
    first failure we wait a moment for the others' reports and blame the earliest exception.
    """
    results: dict[int, Any] = {}
    failures: list[tuple[tuple[bool, float], int, str]] = []  # ((is an echo, time), rank, message)
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = dict(readers)
    first_failure_at = None
    while pending:
        if failures:
            # Wait briefly for the other reports; longer while only echoes have arrived.
            only_echoes = all(echo for (echo, _), _, _ in failures)
            deadline = min(deadline or math.inf, first_failure_at + _GRACE_S * (5 if only_echoes else 1))
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = connection.wait(list(pending), timeout=left)
        if not ready:
            if failures:
                break
            raise LaunchError(
                -1, f"launch timed out after {timeout} s; ranks without a result: {sorted(pending.values())}"
            )
        for reader in ready:
            rank = pending.pop(reader)
            try:
                ok, payload, when = reader.recv()
            except (EOFError, OSError):
                procs[rank].join(timeout=5)
                failures.append(
                    (
                        (False, time.monotonic()),
                        rank,
                        f"rank {rank} exited with code {procs[rank].exitcode} without a result (see its output above)",
                    )
                )
                continue
            if ok:
                results[rank] = pickle.loads(payload) if rank == 0 else None
            else:
                failures.append((when, rank, f"rank {rank} failed:\n{payload}"))
        if failures and first_failure_at is None:
            first_failure_at = time.monotonic()
        failures.sort()
    if failures:
        for p in procs:  # the others may be stuck in a collective with the failed rank
            if p.is_alive():
                p.kill()
        _, rank, message = failures[0]
        others = sorted(r for _, r, _ in failures[1:])
        if others:
            message += f"\n(rank(s) {others} failed after it)"
        raise LaunchError(rank, message)
    return results[0]


def write_whole_lines() -> None:
    """Workers share their launcher's stdout and stderr. Under PYTHONUNBUFFERED (which many CI runners
    set) `print` writes a line and its newline in two syscalls, and another worker's line lands between
    them. A line-buffered writer over a buffer hands each line over in one write instead (atomic on a
    pipe below PIPE_BUF)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):
            continue  # replaced by something without a file: leave it alone
        stream.flush()
        raw = io.FileIO(fd, "w", closefd=False)
        setattr(sys, name, io.TextIOWrapper(io.BufferedWriter(raw), encoding=stream.encoding,
                                            errors=stream.errors, line_buffering=True))


# keys of a launch's own store: how many ranks are in the process group, and whether all are
_JOINED, _ALL_JOINED = "hotswitch/joined", "hotswitch/all joined"


def _worker(fn, args, rank, world_size, port, backend, timeout, results, environ) -> None:
    adopt_environ(environ)
    ok, payload, when = False, None, (False, 0.0)
    write_whole_lines()
    try:
        torch.set_num_threads(1)
        pg_timeout = datetime.timedelta(seconds=timeout) if timeout else None
        if os.environ.get("HOTSWITCH_NETNS"):
            from hotswitch.distributed.netns import enter_namespace

            enter_namespace(os.environ["HOTSWITCH_NETNS"])  # before any socket of this process
        store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), port, is_master=False,
                              timeout=pg_timeout or datetime.timedelta(minutes=30))
        if "nccl" in backend:  # before the group: NCCL binds to it
            torch.cuda.set_device(int(os.environ.get("HOTSWITCH_GPU", os.environ.get("LOCAL_RANK", "0"))))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=pg_timeout)
        if store.add(_JOINED, 1) == world_size:
            store.set(_ALL_JOINED, b"1")
        value = fn(rank, *args)
        payload = pickle.dumps(value) if rank == 0 else None
        ok = True
    except BaseException as e:
        # A peer's communication error is usually the echo of another rank's failure: rank it after
        # every original exception (CLOCK_MONOTONIC is comparable across processes on one machine).
        echo = isinstance(e, dist.DistError) or "gloo" in str(e).lower()
        when = (echo, time.monotonic())
        payload = traceback.format_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    results.send((ok, payload, when))  # before leaving the group, whose teardown fails the peers
    results.close()
    if dist.is_initialized():
        # a peer may still be inside init_process_group (gloo's handshakes) when this rank is done:
        # tearing the group down then fails that peer ("Connection closed by peer"), so not before
        # every rank is in (a peer that never gets in fails, and the launcher kills this process)
        store.wait([_ALL_JOINED])
        dist.destroy_process_group()
    multiprocessing.util._run_finalizers(0)  # what exit would run: unregister semaphores made here
    os._exit(0 if ok else 1)  # skip interpreter teardown: about a second of CPU per process with torch


def _run_in_process(fn, args, backend, timeout):
    rank = int(os.environ.get("RANK", "0"))
    if dist.is_initialized():
        return fn(dist.get_rank(), *args)
    kwargs = {"timeout": datetime.timedelta(seconds=timeout)} if timeout else {}
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, **kwargs)
    try:
        return fn(rank, *args)
    finally:
        # groups that `fn`'s objects still hold (in reference cycles) go now, while the default group
        # lives: left to the interpreter's teardown, a gloo group's threads aborted the process
        # ("terminate called without an active exception") in about 1 run in 6 on a loaded machine
        gc.collect()
        dist.destroy_process_group()


# What every rank imports before it runs anything: the server of `process_context` imports it once.
_PRELOAD = {"torch", "torch.distributed.tensor", "hotswitch.runtime.compiled_model"}


def process_context(preload: tuple[str, ...] = ()):
    """Where ranks (and profiling processes) come from: multiprocessing's forkserver, whose server has
    imported torch and hotswitch's runtime (and the modules in `preload`) once. A rank then starts in a
    fraction of a second instead of importing torch again (about 4 s of CPU each, 4 s of wall time for
    4 ranks on 2 cores). Spawn where there is no forkserver (Windows).

    The server starts on first use, with this process's environment then: a variable read when torch
    or hotswitch is imported is read there. A rank takes its launcher's environment at its start from
    its arguments (`adopt_environ`), as a spawned one copies it."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    _PRELOAD.update(preload)  # the list is the process's own: never shrink what another caller asked for
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(sorted(_PRELOAD))
    return ctx


def call_in_process(fn: Callable[..., Any], *args: Any, name: str) -> Any:
    """`fn(*args)` in a fresh process of its own (`process_context`; `fn` and its arguments
    picklable), with this process's environment: its value, or a RuntimeError holding its traceback.
    One rank of a large job profiled or compiled alone, whose memory and process group are its own."""
    ctx = process_context()
    reader, writer = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_call_and_send, args=(fn, args, writer, dict(os.environ)), name=name)
    p.start()
    writer.close()
    try:
        ok, payload = reader.recv()
    except EOFError:
        p.join()
        raise RuntimeError(f"{name} died (exit code {p.exitcode})") from None
    p.join()
    if not ok:
        raise RuntimeError(f"{name} failed:\n{payload}")
    return payload


def _call_and_send(fn, args, results, environ) -> None:
    import warnings

    adopt_environ(environ)
    try:
        warnings.filterwarnings("ignore")
        results.send((True, fn(*args)))
    except BaseException:  # noqa: BLE001 - reported to the caller with its traceback
        results.send((False, traceback.format_exc()))
    results.close()


def adopt_environ(environ: dict[str, str]) -> None:
    """A forked rank has its server's environment: replace it by its launcher's (`environ`)."""
    if environ != os.environ:
        os.environ.clear()
        os.environ.update(environ)


@contextlib.contextmanager
def patched_environ(values: dict[str, str]):
    """Set environment variables for the block (a spawned child copies os.environ at start)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
