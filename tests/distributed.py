"""Multi-process test harness: one start of ``world_size`` gloo processes per test module.

Starting processes and importing torch costs seconds on a 2-core machine, so a test module
starts its processes once and runs many *checks* in them, all sharing one process group. The
processes are forked from a server (multiprocessing's forkserver) that imported torch, hotswitch
and the Hugging Face models once for the whole test session: about 4 s of CPU saved per process.

Writing a multi-process test module::

    import torch, torch.distributed as dist
    from tests.distributed import dist_tests

    def check_all_reduce():                    # module level, no arguments, NOT named test_*
        x = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(x)
        assert x.item() == 10.0                # assert messages are rewritten as under pytest
        return x                               # any picklable value; collected per rank

    def check_something_else(): ...

    test_world4 = dist_tests(4, [check_all_reduce, check_something_else])
    # -> tests test_world4[check_all_reduce], test_world4[check_something_else]

When a test needs the returned values, use the module-scoped fixture instead::

    from tests.distributed import dist_fixture
    results = dist_fixture(4, CHECKS)          # the fixture is named "results" (name=... to change)

    def test_all_reduce(results):
        values = results["check_all_reduce"].raise_if_failed()   # list, one value per rank
        assert [v.item() for v in values] == [10.0] * 4

Both call ``run_checks(world_size, checks, timeout=None, env=None, *, check_timeout=None,
collective_timeout=None) -> dict[str, CheckResult]`` (keyword arguments pass through), which never
raises for a failing check: ``CheckResult(name, ok, values, errors, seconds, rank_seconds, status,
skipped)``, one entry per rank in the lists; ``raise_if_failed()`` raises AssertionError with the
failing ranks' tracebacks, skips the test when the check called ``pytest.skip``, else returns ``values``.

What a worker (rank r) does:
    * environment: the parent's, as it is when the run starts, with RANK, WORLD_SIZE, LOCAL_RANK,
      LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, OMP_NUM_THREADS=1 and ``env``, set before the
      checks' module is imported. torch, hotswitch and transformers are already imported then (by
      the server, under the environment of the session's first run): a variable read at import
      time needs ``fresh_interpreter=True`` (a spawned interpreter, which imports everything again);
    * ``dist.init_process_group("gloo", ...)`` on a TCPStore that the parent hosts (port 0, no port race);
      MASTER_ADDR/MASTER_PORT name that store;
    * ``torch.set_num_threads(1)``; before every check ``torch.manual_seed(0)``, ``random.seed(0)``,
      ``numpy.random.seed(0)``, so a check sees the same random numbers whatever ran before it;
    * runs the checks in order, every check on every rank. A check that raises (or calls
      ``pytest.skip``/``pytest.fail``) is recorded with its formatted traceback and the rank goes on.
      After each check all ranks meet at a barrier on the store (not on the process group, so a rank
      whose check raised before a collective still arrives). If a failed check left the process group
      out of step (different collective counts on the ranks, or a gloo error such as a timed-out
      collective), every rank destroys and re-creates the default group before the next check;
      groups created by checks are invalid after that.

What the parent does:
    * collects per check and rank: status, return value (pickled in the worker; an unpicklable value
      fails the check), traceback, seconds;
    * ends the run, killing all workers, when a worker exits without reporting (error names the rank,
      its exit code and the check it was in), when ``timeout`` seconds have passed since the start,
      or when one check ran longer than ``check_timeout``. Checks that did not complete are then
      failed with that reason, so a hang becomes a clear test failure, never a hung test session.

Collectives that are never matched (a rank skipped one) fail after ``collective_timeout`` (the
process-group timeout, default ``timeout / 2``) with a gloo timeout error in the check. A rank whose
check raises closes its process group first, so peers waiting on it in a collective or a recv fail
at once with a closed connection, not at that timeout.
Module-level code of a test module runs again in every worker (it is imported there to find the
checks), so keep heavy work inside checks. Checks are found by qualified name, so they must be
module-level functions (or ``functools.partial`` of them, or another picklable callable).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import datetime
import faulthandler
import fcntl
import functools
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import pickle
import random
import re
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing import connection as mp_connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hotswitch.distributed.launch import adopt_environ, patched_environ, process_context

__all__ = ["CheckResult", "run_checks", "dist_fixture", "dist_tests"]

_POLL_S = 0.1  # how often the parent looks at the clock while it waits for its children


# ----------------------------------------------------------------------------------------------
# results


@dataclasses.dataclass
class CheckResult:
    """Outcome of one check on all ranks. ``values``, ``errors``, ``rank_seconds`` and ``status``
    have one entry per rank; ``errors[r]`` (a formatted traceback, or why there is no result) is
    None where rank r passed or skipped; ``seconds`` is the slowest rank's time."""

    name: str
    ok: bool  # no rank failed, every rank reported
    values: list[Any]
    errors: list[str | None]
    seconds: float
    rank_seconds: list[float | None] = dataclasses.field(default_factory=list)
    status: list[str] = dataclasses.field(default_factory=list)  # "ok" | "fail" | "skip" | "missing"
    skipped: str | None = None  # the reason, when a rank called pytest.skip and none failed

    @property
    def failed_ranks(self) -> list[int]:
        return [r for r, e in enumerate(self.errors) if e is not None]

    def raise_if_failed(self) -> list[Any]:
        """Raise AssertionError carrying the failing ranks' tracebacks; skip the calling test if
        the check skipped; otherwise return ``values`` (one per rank)."""
        __tracebackhide__ = True
        if not self.ok:
            raise AssertionError(self.report())
        if self.skipped is not None:
            import pytest

            pytest.skip(self.skipped)
        return self.values

    def report(self) -> str:
        world_size = len(self.errors)
        failed = self.failed_ranks
        lines = [f"check {self.name!r} failed on rank(s) {failed} of world size {world_size}"]
        groups: dict[str, list[int]] = {}  # identical tracebacks are printed once
        for r in failed:
            groups.setdefault(self.errors[r], []).append(r)
        for text, ranks in groups.items():
            label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks} (same error)"
            lines += [f"----- {label} -----", text.rstrip()]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# running checks


DEFAULT_TIMEOUT_S = 1200  # a whole module's run, scaled by HOTSWITCH_TEST_TIMEOUT_SCALE


def scaled(seconds: float) -> float:
    """A test's wall-clock limit times HOTSWITCH_TEST_TIMEOUT_SCALE (default 1): limits exist to turn a
    hang into a failure, and a slow or busy machine raises them instead of failing."""
    return seconds * float(os.environ.get("HOTSWITCH_TEST_TIMEOUT_SCALE", "1"))


def assert_no_repeated_warning(text: str) -> None:
    """No warning or log line printed more than once in a command's output (each rank would print
    its own copy: "[rank2]:W1123 03:35:01.175 29511 torch/...] message")."""
    lines = [re.sub(r"^\[rank\d+\]:", "", ln) for ln in text.splitlines()]
    lines = [re.sub(r"^[WIE]\d{4} [\d:.]+ \d+ ", "", ln).strip() for ln in lines]
    warnings = [ln for ln in lines if re.search(r"warn|deprecat|falling back", ln, re.I)]
    repeated = {ln: warnings.count(ln) for ln in set(warnings) if warnings.count(ln) > 1}
    assert not repeated, repeated


def run_checks(
    world_size: int,
    checks: Sequence[Callable[[], Any]],
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    *,
    check_timeout: float | None = None,
    collective_timeout: float | None = None,
    fresh_interpreter: bool = False,
) -> dict[str, CheckResult]:
    """Run ``checks`` in order on ``world_size`` gloo processes; see the module docstring.

    Returns one CheckResult per check, keyed by the check's ``__name__``, in order. Does not raise
    for failing checks, crashes or timeouts: those become failed results. ``timeout`` defaults to
    1200 s times ``HOTSWITCH_TEST_TIMEOUT_SCALE`` (default 1): raise it on a slow or busy machine;
    an abort names the check each rank was in.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    names = [_check_name(c) for c in checks]  # bad arguments fail at once, not after waiting for the lock
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"check names must be unique within a run, repeated: {dupes}")
    specs = [_check_spec(c) for c in checks]
    with _one_run_at_a_time():
        return _run_checks(world_size, checks, specs, timeout, env, check_timeout, collective_timeout,
                           fresh_interpreter)


@contextlib.contextmanager
def _one_run_at_a_time():
    """Test modules run side by side (pytest-xdist), but one multi-process run at a time: a run's
    ranks keep every core busy, and two runs at once only add contention (12% more CPU measured).
    The lock is a file the test session names in HOTSWITCH_TEST_RUN_LOCK (tests/conftest.py); a
    run's time limits count from when it holds it."""
    path = os.environ.get("HOTSWITCH_TEST_RUN_LOCK")
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run_checks(world_size, checks, specs, timeout, env, check_timeout, collective_timeout, fresh_interpreter):
    """`run_checks`, its arguments checked, with the run lock held."""
    if timeout is None:
        timeout = scaled(DEFAULT_TIMEOUT_S)
    names = [_check_name(c) for c in checks]
    if collective_timeout is None:
        collective_timeout = timeout / 2

    n = len(checks)
    status: list[list[str | None]] = [[None] * world_size for _ in range(n)]  # ok / fail / skip
    values: list[list[Any]] = [[None] * world_size for _ in range(n)]
    errors: list[list[str | None]] = [[None] * world_size for _ in range(n)]
    seconds: list[list[float | None]] = [[None] * world_size for _ in range(n)]
    position: list[tuple[str, int]] = [("starting", -1)] * world_size  # ("in"|"after", check index)
    started_at = [0.0] * world_size
    done = [False] * world_size
    abort: str | None = None

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn") if fresh_interpreter else process_context(_PRELOAD)
    procs: list[Any] = []
    conns: dict[Any, int] = {}  # parent's reading end of each rank's pipe -> rank
    t0 = time.monotonic()

    def handle(msg: tuple) -> None:
        nonlocal abort
        kind, rank = msg[0], msg[1]
        if kind == "start":
            position[rank] = ("in", msg[2])
            started_at[rank] = time.monotonic()
        elif kind == "result":
            _, _, i, st, payload, err, secs = msg
            status[i][rank], errors[i][rank], seconds[i][rank] = st, err, secs
            if payload is not None:
                try:
                    values[i][rank] = pickle.loads(payload)
                except Exception:
                    status[i][rank] = "fail"
                    errors[i][rank] = "the parent could not unpickle the returned value:\n" + traceback.format_exc()
            position[rank] = ("after", i)
        elif kind == "setup_error":
            abort = abort or f"rank {rank} failed to set up:\n{msg[2]}"
        elif kind == "done":
            done[rank] = True

    def receive(conn: Any) -> None:
        """Handle one message, or note that the rank closed its end (it exited)."""
        try:
            handle(conn.recv())
        except (EOFError, OSError):
            del conns[conn]
            conn.close()

    def where(rank: int) -> str:
        state, i = position[rank]
        if procs and rank < len(procs) and procs[rank].exitcode is not None and not done[rank]:
            return f"exited with code {procs[rank].exitcode}" + (f" in check {names[i]!r}" if state == "in" else "")
        if state == "starting":
            return "starting up (fork or spawn, imports, init_process_group)"
        if state == "in":
            return f"in check {names[i]!r} for {time.monotonic() - started_at[rank]:.1f} s"
        if done[rank]:
            return "finished all checks"
        return f"done with check {names[i]!r}, waiting for the other ranks at the barrier"

    try:
        for rank in range(world_size):
            # (a run that a check starts must not wait for the run lock its own run holds)
            rank_env = {
                **{k: v for k, v in os.environ.items() if k != "HOTSWITCH_TEST_RUN_LOCK"},
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port),
                "OMP_NUM_THREADS": "1",
                **(env or {}),
            }
            reader, writer = ctx.Pipe(duplex=False)  # unbuffered: a message sent is never lost
            p = ctx.Process(
                target=_worker,
                args=(rank, world_size, store.port, specs, writer, rank_env, timeout, collective_timeout),
                name=f"dist-check-rank{rank}",
                daemon=False,  # checks may start processes of their own; we always reap these
            )
            with patched_environ(rank_env):  # spawn copies os.environ (a forked worker sets rank_env itself)
                p.start()
            writer.close()  # the child holds its own copy; EOF on the reader = the child exited
            procs.append(p)
            conns[reader] = rank

        sentinels = {p.sentinel: rank for rank, p in enumerate(procs)}
        while not all(done) and abort is None:
            for ready in mp_connection.wait([*conns, *sentinels], timeout=_POLL_S):
                if ready in conns:
                    receive(ready)
                elif ready in sentinels:  # exited: first read all it sent, then judge
                    rank = sentinels.pop(ready)
                    procs[rank].join(timeout=5)  # reap it, for its exit code
                    for conn in [c for c, r in conns.items() if r == rank]:
                        while conn in conns:
                            receive(conn)
                    if not done[rank] and abort is None:
                        abort = f"rank {rank} exited with code {procs[rank].exitcode} before the end"
            now = time.monotonic()
            if abort is None and now - t0 > timeout:
                abort = f"timed out after {timeout:.0f} s"
            if abort is None and check_timeout is not None:
                for rank in range(world_size):
                    if position[rank][0] == "in" and now - started_at[rank] > check_timeout:
                        check = names[position[rank][1]]
                        abort = f"check {check!r} ran over check_timeout={check_timeout} s on rank {rank}"
                        break
            if abort is not None and "failed to set up" not in abort:
                abort += "; the ranks were: " + "; ".join(f"rank {r}: {where(r)}" for r in range(world_size))
    finally:
        for p in procs:
            p.join(timeout=10 if abort is None else 0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        for conn in conns:
            conn.close()
        del store

    if abort is not None:
        print(f"[tests.distributed] run of {names} aborted: {abort}", file=sys.stderr, flush=True)

    out: dict[str, CheckResult] = {}
    for i, name in enumerate(names):
        st = [s or "missing" for s in status[i]]
        errs = [None if s == "skip" else e for s, e in zip(st, errors[i])]
        errs = [f"no result: the run was aborted: {abort}" if s == "missing" else e for s, e in zip(st, errs)]
        ok = all(s in ("ok", "skip") for s in st)
        skips = [e for s, e in zip(st, errors[i]) if s == "skip"]
        out[name] = CheckResult(
            name=name,
            ok=ok,
            values=values[i],
            errors=errs,
            seconds=max((x for x in seconds[i] if x is not None), default=0.0),
            rank_seconds=seconds[i],
            status=st,
            skipped=skips[0] if skips and ok else None,
        )
    _log_check_seconds(world_size, out, time.monotonic() - t0)
    return out


def _log_check_seconds(world_size: int, results: dict[str, CheckResult], run_seconds: float) -> None:
    """With HOTSWITCH_TEST_CHECK_LOG=path, append one JSON line per run: its checks' slowest-rank
    seconds and the run's wall time (start-up included), to find where a slow suite spends its time."""
    path = os.environ.get("HOTSWITCH_TEST_CHECK_LOG")
    if not path:
        return
    record = {
        "module": os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[0],
        "world_size": world_size,
        "run_seconds": round(run_seconds, 2),
        "checks": {name: round(r.seconds, 2) for name, r in results.items()},
    }
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def dist_fixture(
    world_size: int, checks: Sequence[Callable[[], Any]], *, name: str = "results", **kwargs: Any
):
    """A module-scoped pytest fixture (named ``name``) returning ``run_checks(world_size, checks, **kwargs)``."""
    import pytest

    def fixture() -> dict[str, CheckResult]:
        return run_checks(world_size, checks, **kwargs)

    fixture.__name__ = name
    return pytest.fixture(scope="module", name=name)(fixture)


def dist_tests(world_size: int, checks: Sequence[Callable[[], Any]], **kwargs: Any):
    """A module-level pytest test parametrized over the checks: ``test_x = dist_tests(4, CHECKS)``.
    The checks run (once, all of them) when the first of these tests runs."""
    import pytest

    names = [_check_name(c) for c in checks]
    cache: list[Any] = []

    @pytest.mark.parametrize("check", names)
    def test(check: str) -> None:
        __tracebackhide__ = True
        if not cache:
            try:
                cache.append(run_checks(world_size, checks, **kwargs))
            except Exception as e:  # a broken run fails every test of it, without re-running
                cache.append(e)
        if isinstance(cache[0], Exception):
            raise cache[0]
        cache[0][check].raise_if_failed()

    return test


# ----------------------------------------------------------------------------------------------
# helpers (parent)


def _check_name(check: Callable[[], Any]) -> str:
    fn = check.func if isinstance(check, functools.partial) else check
    return getattr(fn, "__name__", type(fn).__name__)


# What the server of `process_context` imports besides torch and hotswitch's runtime: what the checks
# build (tests.compile_checks). Not the test modules: their asserts are rewritten when imported.
_PRELOAD = ("hotswitch.train.trainer", "tests.distributed", "transformers.models.llama.modeling_llama",
            "transformers.models.gpt2.modeling_gpt2")


def _check_spec(check: Callable[[], Any]) -> tuple[str, str] | bytes:
    """(module, qualname) when the check can be found by name, else its pickle. Found by name in
    the worker, so that the worker imports the test module only after setting its environment."""
    module, qualname = getattr(check, "__module__", None), getattr(check, "__qualname__", None)
    if module and qualname and "<" not in qualname:
        obj: Any = sys.modules.get(module)
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
        if obj is check:
            return (module, qualname)
    try:
        return pickle.dumps(check)
    except Exception as e:
        raise ValueError(
            f"check {check!r} is neither a module-level function nor picklable ({e}); "
            "define checks at module level"
        ) from e




# ----------------------------------------------------------------------------------------------
# worker


def _worker(
    rank: int,
    world_size: int,
    port: int,
    specs: list[tuple[str, str] | bytes],
    results: Any,
    rank_env: dict[str, str],
    timeout: float,
    collective_timeout: float,
) -> None:
    adopt_environ(rank_env)  # a forked worker has its server's environment
    faulthandler.enable(all_threads=True)  # a crashing rank (SIGSEGV, SIGABRT) prints its Python stacks
    try:
        torch.set_num_threads(1)
        with contextlib.suppress(RuntimeError):  # refused once inter-op work has started
            torch.set_num_interop_threads(1)
        store = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout)
        )
        pg_timeout = datetime.timedelta(seconds=collective_timeout)
        generation = 0
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(f"pg{generation}", store), rank=rank,
            world_size=world_size, timeout=pg_timeout,
        )
        checks = _load_checks(specs)
    except BaseException:
        results.send(("setup_error", rank, traceback.format_exc()))
        raise

    for i, check in enumerate(checks):
        results.send(("start", rank, i))
        _seed(0)
        t = time.perf_counter()
        payload = err = None
        pg_error = False
        try:
            value = check()
            st = "ok"
            try:
                payload = pickle.dumps(value)
            except Exception:
                st, err = "fail", "the check's return value is not picklable:\n" + traceback.format_exc(limit=-1)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # includes pytest.fail / pytest.skip outcomes and SystemExit
            outcomes = sys.modules.get("_pytest.outcomes")
            if outcomes is not None and isinstance(e, outcomes.Skipped):
                st, err = "skip", str(getattr(e, "msg", e))
            else:
                st, err = "fail", _format_exception(e)
                pg_error = isinstance(e, dist.DistError) or "gloo" in str(e).lower()
                # peers may be blocked in a collective or a recv this rank will never join: closing
                # the group fails them at once (a connection closed) instead of at its timeout
                if dist.is_initialized():
                    with contextlib.suppress(Exception):
                        dist.destroy_process_group()
        secs = time.perf_counter() - t
        results.send(("result", rank, i, st, payload, err, secs))

        # Barrier on the store. Each rank publishes whether its group may be broken, whether its
        # check failed, and its collective count; all ranks rebuild if any rank says broken, or if a
        # check failed and the counts differ. (After a successful check differing counts are
        # legitimate: point-to-point transfers advance them by different amounts on each rank.)
        if dist.is_initialized():
            seq = dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()
        else:  # the check destroyed it
            pg_error, seq = True, -1
        store.set(f"check{i}/rank{rank}", f"{int(pg_error)},{seq},{int(st == 'fail')}")
        keys = [f"check{i}/rank{r}" for r in range(world_size)]
        store.wait(keys, datetime.timedelta(seconds=timeout))
        reports = [store.get(k).decode().split(",") for k in keys]
        failed = any(f == "1" for _, _, f in reports)
        broken = any(flag == "1" for flag, _, _ in reports) or (failed and len({s for _, s, _ in reports}) > 1)
        if broken and i + 1 < len(checks):
            generation += 1
            if dist.is_initialized():
                dist.destroy_process_group()
            dist.init_process_group(
                "gloo", store=dist.PrefixStore(f"pg{generation}", store), rank=rank,
                world_size=world_size, timeout=pg_timeout,
            )

    results.send(("done", rank))
    if dist.is_initialized():
        dist.destroy_process_group()
    # Skip the interpreter's teardown (about a second of CPU per process with torch loaded).
    results.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _format_exception(e: BaseException) -> str:
    tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # drop the harness frame
    return "".join(traceback.format_exception(type(e), e, tb))


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed)


def _load_checks(specs: list[tuple[str, str] | bytes]) -> list[Callable[[], Any]]:
    modules = {s[0] for s in specs if isinstance(s, tuple)}
    finder = _AssertRewritingFinder(modules)
    sys.meta_path.insert(0, finder)
    try:
        checks = []
        for spec in specs:
            if isinstance(spec, bytes):
                checks.append(pickle.loads(spec))
                continue
            obj: Any = importlib.import_module(spec[0])
            for part in spec[1].split("."):
                obj = getattr(obj, part)
            checks.append(obj)
        return checks
    finally:
        sys.meta_path.remove(finder)


class _AssertRewritingFinder(importlib.abc.MetaPathFinder):
    """Imports the test modules holding the checks with pytest's assert rewriting, so that a
    failing ``assert a == b`` in a worker reports the values, as it would under pytest."""

    def __init__(self, modules: set[str]):
        self.modules = modules

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.modules:
            return None
        try:
            from _pytest.assertion.rewrite import rewrite_asserts
        except ImportError:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec
        spec.loader = _AssertRewritingLoader(fullname, spec.origin, rewrite_asserts)
        return spec


class _AssertRewritingLoader(importlib.machinery.SourceFileLoader):
    def __init__(self, fullname: str, path: str, rewrite_asserts: Callable[..., None]):
        super().__init__(fullname, path)
        self._rewrite_asserts = rewrite_asserts

    def get_code(self, fullname):  # never the cached bytecode, which is not rewritten
        source = self.get_data(self.path)
        tree = ast.parse(source, filename=self.path)
        self._rewrite_asserts(tree, source, self.path)
        return compile(tree, self.path, "exec", dont_inherit=True)
