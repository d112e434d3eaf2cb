"""Work that one rank does for the whole job: tracing the model and searching each graph's shardings.

Both give every rank the same answer: the LogicGraph depends on the model and the example shapes,
and DTensor's strategy search on the mesh's shape and the parameters' placements, never on a rank's
coordinate. So the first rank that needs one computes it and publishes it in the process group's
store; the others wait and load it (4 ranks on 2 cores otherwise trace and search four times over,
most of a compile). Anything unexpected (no store, a rank that failed, a wait that timed out) makes
a rank compute for itself: slower, never different. Before any of that, each rank looks in the
persistent compile cache (`hotswitch.compiler.cache`): a later run finds both on disk.
"""
from __future__ import annotations

import datetime
import itertools
import pickle

import torch

from hotswitch.compiler.cache import CompileCache
from hotswitch.compiler.fingerprint import model_fingerprint
from hotswitch.compiler.garbage import collector_paused
from hotswitch.compiler.logic_io import dumps_logic, loads_logic
from hotswitch.compiler.trace import LogicGraph, trace
from hotswitch.distributed import _c10d

__all__ = ["JobOnce", "SharedCache", "trace_once"]

_FAILED = b"failed"
_scopes = itertools.count()  # one per compiled model: a model never reads another model's results


class JobOnce:
    """`fetch(key)`: None when this rank is to compute `key` (then `publish` or `failed`), else the
    bytes another rank published."""

    def __init__(self, store=None, wait: datetime.timedelta = datetime.timedelta(minutes=30)):
        self.store = store if store is not None else _c10d.default_store()
        self.wait = wait
        self.scope = f"hotswitch/once/{next(_scopes)}"
        self.computed = self.received = 0  # keys this rank computed / received from another rank

    def fetch(self, key: str) -> bytes | None:
        if self.store is None:
            return None
        name = f"{self.scope}/{key}"
        try:
            if self.store.add(f"{name}/claim", 1) == 1:
                self.computed += 1
                return None  # ours
            self.store.wait([name], self.wait)
            payload = self.store.get(name)
        except Exception:  # noqa: BLE001 - no usable store (a fake process group), or the wait timed out
            return None
        if payload == _FAILED:
            return None  # the rank computing it raised: compute here, and raise the same error here
        self.received += 1
        return payload

    def publish(self, key: str, payload: bytes) -> None:
        if self.store is not None:
            try:
                self.store.set(f"{self.scope}/{key}", payload)
            except Exception:  # noqa: BLE001 - the waiting ranks then time out and compute themselves
                pass

    def failed(self, key: str) -> None:
        self.publish(key, _FAILED)


@collector_paused()  # tracing, or decoding a traced graph (see compiler.garbage)
def trace_once(model: torch.nn.Module, example_inputs, cache: SharedCache) -> tuple[LogicGraph, str]:
    """`model`'s LogicGraph and where it came from: "loaded" (the compile cache, or another rank of
    this job, traced it) or "traced" (this rank did, and published it). The key is the model's
    fingerprint (`compiler.fingerprint`: code, settings, state shapes, example inputs) with the torch
    and hotswitch versions, so no rank and no later process loads another model's graph, or one
    traced by other code. Every rank, the tracer included, compiles
    from the loaded bytes, so node names and cache keys are the same everywhere."""
    fingerprint = model_fingerprint(model, example_inputs)
    # the versions too (CompileCache.key): a graph traced by another torch or another hotswitch (an
    # edited tracer, a kernel op's new fake) is never loaded
    key, persistent = "logic-" + CompileCache.key("logic", fingerprint.digest), fingerprint.persistent
    if key in _LOADED:  # this process compiled the same model before: a LogicGraph is never edited
        return _LOADED[key], "loaded"
    payload = cache.get(key, "logic", persistent=persistent)
    if payload is not None:
        try:
            return _remember(key, loads_logic(payload)), "loaded"
        except Exception as e:  # noqa: BLE001 - an entry another torch build wrote, say: trace again
            cache.report(f"a cached LogicGraph did not load ({type(e).__name__}: {e}); the model is traced again")
    try:
        logic = trace(model, example_inputs)
    except BaseException:
        cache.failed(key)
        raise
    try:
        payload = dumps_logic(logic)
    except Exception:  # noqa: BLE001 - a node value logic_io cannot write: every rank traces for itself
        cache.failed(key)
        return logic, "traced"
    cache.put(key, payload, "logic", persistent=persistent)
    return _remember(key, loads_logic(payload)), "traced"


# fingerprint -> LogicGraph already loaded in this process (a few: each holds a model's graphs).
# Compiling the same model again (another CompiledModel, an elastic generation) skips decoding it.
_LOADED: dict[str, LogicGraph] = {}


def _remember(key: str, logic: LogicGraph) -> LogicGraph:
    if len(_LOADED) >= 8:
        _LOADED.pop(next(iter(_LOADED)))
    _LOADED[key] = logic
    return logic


class SharedCache:
    """The compile cache as compiling consults it (`compiler.program.lower_program`, `trace_once`):
    this host's disk first, then, for what every rank computes alike (a LogicGraph, a graph's
    decisions, a program every dp rank lowers alike: "shared program", and its length fit: "shared
    length fit"), what another rank of the job computed, which then goes on this rank's disk too
    (ranks on other hosts have other disks). A rank's own lowered programs ("program") stay on its
    disk.
    A `get` that returns None for a shared kind makes this rank the one to compute it: `put` or `failed`."""

    key = staticmethod(CompileCache.key)
    _SHARED = ("decisions", "logic", "shared program", "shared length fit")

    def __init__(self, disk: CompileCache | None, once: JobOnce):
        self.disk, self.once = disk, once

    def get(self, key: str, kind: str = "decisions", persistent: bool = True):
        if self.disk is not None and persistent:
            value = self.disk.get(key, kind)
            if value is not None:
                return value
        if kind not in self._SHARED:
            return None
        payload = self.once.fetch(key)
        if payload is None:
            return None
        value = pickle.loads(payload)
        if self.disk is not None and persistent:
            self.disk.put(key, value)
        return value

    def keeps(self, kind: str) -> bool:
        """Would `put` keep a value of `kind` anywhere (on disk, or for another rank)? Not worth
        writing one out otherwise."""
        return self.disk is not None or (kind in self._SHARED and self.once.store is not None)

    def put(self, key: str, value, kind: str = "decisions", persistent: bool = True) -> None:
        if self.disk is not None and persistent:
            self.disk.put(key, value)
        if kind not in self._SHARED:
            return
        try:
            payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - the waiting ranks compute for themselves
            payload = _FAILED
        self.once.publish(key, payload)

    def failed(self, key: str) -> None:
        self.once.failed(key)

    def report(self, message: str) -> None:
        if self.disk is not None:
            self.disk.report(message)
