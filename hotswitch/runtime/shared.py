"""Work that one rank does for the whole job: tracing the model and searching each graph's shardings.

Both give every rank the same answer: the LogicGraph depends on the model and the example shapes,
and DTensor's strategy search on the mesh's shape and the parameters' placements, never on a rank's
coordinate. So the first rank that needs one computes it and publishes it in the process group's
store; the others wait and load it (4 ranks on 2 cores otherwise trace and search four times over,
most of a compile). Anything unexpected (no store, a rank that failed, a wait that timed out) makes
a rank compute for itself: slower, never different.
"""
from __future__ import annotations

import datetime
import hashlib
import itertools
import pickle

import torch

from hotswitch.compiler._torch import pytree
from hotswitch.compiler.cache import DecisionCache
from hotswitch.compiler.logic_io import dumps_logic, loads_logic
from hotswitch.compiler.trace import LogicGraph, trace
from hotswitch.distributed import _c10d

__all__ = ["JobOnce", "SharedDecisions", "trace_once"]

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


def trace_once(model: torch.nn.Module, example_inputs, once: JobOnce) -> LogicGraph:
    """`trace(model, example_inputs)` on the first rank; every rank loads its LogicGraph. The key names
    the model's class, its state's names, shapes and dtypes and the example's: ranks never load
    another model's graph, even if their compiles were not in the same order."""
    described = (type(model).__qualname__,
                 [(k, tuple(v.shape), str(v.dtype)) for k, v in model.state_dict(keep_vars=True).items()],
                 [(tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else repr(x)
                  for x in pytree.tree_leaves(example_inputs)])
    key = "logic-" + hashlib.sha256(repr(described).encode()).hexdigest()[:32]
    payload = once.fetch(key)
    if payload is not None:
        return loads_logic(payload)
    try:
        logic = trace(model, example_inputs)
    except BaseException:
        once.failed(key)
        raise
    if once.store is None:
        return logic  # alone: nobody to share it with
    try:
        payload = dumps_logic(logic)
    except Exception:  # noqa: BLE001 - a node value logic_io cannot write: every rank traces for itself
        once.failed(key)
        return logic
    once.publish(key, payload)
    return loads_logic(payload)  # this rank too: every rank compiles the same graph, down to node names


class SharedDecisions:
    """The `cache` that `compiler.program.lower_program` consults (get / put / failed, and `key(...)`
    as `DecisionCache.key`): the persistent cache first, then the decisions another rank searched
    (which then go on this rank's disk too: ranks on other hosts have other disks)."""

    key = staticmethod(DecisionCache.key)

    def __init__(self, disk: DecisionCache | None, once: JobOnce):
        self.disk, self.once = disk, once

    def get(self, key: str):
        if self.disk is not None:
            value = self.disk.get(key)
            if value is not None:
                return value
        payload = self.once.fetch(key)
        if payload is None:
            return None
        value = pickle.loads(payload)
        if self.disk is not None:
            self.disk.put(key, value)  # on this host's disk too (another host's rank may have searched)
        return value

    def put(self, key: str, value) -> None:
        if self.disk is not None:
            self.disk.put(key, value)
        try:
            payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - the waiting ranks search for themselves
            payload = _FAILED
        self.once.publish(key, payload)

    def failed(self, key: str) -> None:
        self.once.failed(key)

    def get_local(self, key: str):
        return None if self.disk is None else self.disk.get_local(key)

    def put_local(self, key: str, value) -> None:
        if self.disk is not None:
            self.disk.put_local(key, value)

    def report(self, message: str) -> None:
        if self.disk is not None:
            self.disk.report(message)
