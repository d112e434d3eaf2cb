"""How an ExecGraph runs: op by op as its fx GraphModule ("eager"), or compiled by Inductor.

A lowered ExecGraph is already what Inductor consumes: a functional ATen graph with its collectives
as `_c10d_functional` ops. So "inductor" hands each program to Inductor's ahead-of-time entry (no
dynamo: the graph is not traced again) on its first run, with that run's inputs as examples, and
keeps the result with the program: nothing is compiled per call, and a new shape is a new program
(lowered and compiled once). Compiling happens before anything runs, so a graph Inductor cannot take
runs eagerly instead, with one warning that names the graph and Inductor's reason; the other graphs
stay compiled.

Inductor's own caches (FX graph cache, AOT autograd cache) live under hotswitch's compile cache
(`<cache>/inductor`) while hotswitch compiles, unless TORCHINDUCTOR_CACHE_DIR names another place:
every rank and every later process (another run, an elastic generation) reuses what one compiled.
Ranks of one host whose graphs are alike (data parallelism's, say) do not compile side by side:
the first claims the graph (`JobOnce`, on the process group's store), the others wait for it and
then find Inductor's result in the cache, seconds instead of a compile each.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import time
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx

from hotswitch.compiler._torch import inductor_compile, inductor_default_cache_dir
from hotswitch.compiler.attention import fused_kernels
from hotswitch.compiler.handoff import strip_hand_offs
from hotswitch.compiler.program import constants_digest

__all__ = ["BACKENDS", "GraphRunner", "check_backend"]

BACKENDS = ("eager", "inductor")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: choose 'eager' (ExecGraphs run op by op) or 'inductor' "
                         "(ExecGraphs compiled by torch's Inductor on first use)")
    return backend


@contextlib.contextmanager
def inductor_cache_dir(directory):
    """TORCHINDUCTOR_CACHE_DIR set to `directory` for the duration, then restored (Inductor reads it
    at every cache access, and writes its default there when it finds none). None: unchanged."""
    if directory is None:
        yield
        return
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.fspath(directory)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


class _Compiled:
    """One ExecGraph under Inductor: compiled on its first call (with that call's inputs as examples)."""

    def __init__(self, gm: fx.GraphModule, runner: GraphRunner, what: str):
        self.gm, self.runner, self.what = gm, runner, what
        self.fn: Callable | None = None

    def __call__(self, *args):
        if self.fn is None:
            self.fn = self.runner._compile(self.gm, args, self.what)
        return self.fn(*args)


class GraphRunner:
    """`runner(gm, what)` -> what to call for ExecGraph `gm` under `backend`, made once per graph: for
    "eager" the GraphModule itself, its attention written as `device`'s fused kernels
    (`compiler.attention.fused_kernels`; Inductor gets the same graph). `seconds` sums the time spent
    compiling; `fallbacks` names the graphs Inductor refused."""

    def __init__(self, backend: str = "eager", cache_directory=None, progress: Callable[[str], None] | None = None,
                 once=None, device: torch.device | str = "cpu"):
        self.backend = check_backend(backend)
        self.device = torch.device(device)
        # HOTSWITCH_FUSED_ATTENTION=0: attention runs as hotswitch's op (its backward recomputes the
        # forward), for comparing with the fused kernels or ruling them out
        self.fused_attention = os.environ.get("HOTSWITCH_FUSED_ATTENTION", "1") != "0"
        self.once = once  # a runtime.shared.JobOnce: one compile per alike graph on this host
        # Inductor's caches beside hotswitch's, unless the user named another place for them
        # (Inductor writes its default into the variable itself: that is no user's choice)
        user_directory = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        if user_directory and os.path.abspath(user_directory) == inductor_default_cache_dir():
            user_directory = None
        self.inductor_directory = user_directory or (
            os.path.join(os.fspath(cache_directory), "inductor") if cache_directory is not None else None)
        self.progress = progress or (lambda message: None)
        self.seconds = 0.0
        self.compiled = 0
        self.fallbacks: list[str] = []
        self._made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def kernels(self) -> str | None:
        """For whom programs are lowered with their attention as fused kernels (`StageMesh.runner`):
        this backend, or None with HOTSWITCH_FUSED_ATTENTION=0 (the op stays)."""
        return self.backend if self.fused_attention else None

    def __call__(self, gm: fx.GraphModule, what: str = "an ExecGraph") -> Callable[..., Any]:
        run = self._made.get(gm)
        if run is None:
            # a program lowered for this backend holds its attention kernels already (and its graph,
            # loaded from the compile cache, may not even be built: the eager path never reads it)
            lowered_for = gm.meta.get("hotswitch", {}).get("kernels")
            native = fused_kernels(gm, self.device, self.backend == "inductor") \
                if self.fused_attention and lowered_for != self.backend else gm
            run = self._made[gm] = native if self.backend == "eager" else _Compiled(native, self, what)
        return run

    def _compile(self, gm: fx.GraphModule, args: tuple, what: str) -> Callable[..., Any]:
        gm = strip_hand_offs(gm)  # Inductor calls no Python: its gradients are handed off after the call
        self.progress(f"compiling {what} with Inductor ({len(gm.graph.nodes)} nodes)")
        t0 = time.perf_counter()
        # alike graphs on this host: the first rank compiles, the others wait, then load its result
        key = _graph_key(gm, args) if self.once is not None and self.inductor_directory is not None else None
        claimed = key is not None and self.once.fetch(key) is None
        try:
            with inductor_cache_dir(self.inductor_directory):
                fn = inductor_compile(gm, list(args))
        except Exception as e:  # noqa: BLE001 - this graph runs eagerly; said once, with Inductor's reason
            self.fallbacks.append(what)
            warnings.warn(f"hotswitch: Inductor could not compile {what} ({_reason(e)}); that graph runs eagerly "
                          "(op by op), the others stay compiled", stacklevel=3)
            fn = gm
        else:
            self.compiled += 1
        if claimed:
            self.once.publish(key, b"compiled")  # or refused: the waiting ranks find out themselves, as fast
        self.seconds += time.perf_counter() - t0
        self.progress(f"compiled {what} in {time.perf_counter() - t0:.1f} s")
        return fn


def _graph_key(gm: fx.GraphModule, args: tuple) -> str:
    """What Inductor's result for `gm` depends on, as far as ranks can share it: the code, the
    tensors it holds, its inputs' shapes, strides and dtypes, and the host (whose disk holds the cache)."""
    layout = [(tuple(a.shape), a.stride(), str(a.dtype), str(a.device)) if isinstance(a, torch.Tensor) else repr(a)
              for a in args]
    text = repr((socket.gethostname(), gm.code, constants_digest(gm.graph), layout))
    return "inductor/" + hashlib.sha256(text.encode()).hexdigest()


def _reason(e: BaseException) -> str:
    """Inductor's error in one line, with the op it names where it names one."""
    text = f"{type(e).__name__}: {e}"
    target = re.search(r"target:\s*(\S+)", text)
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    return (f"at op {target.group(1)}: " if target else "") + f"{type(e).__name__}: {first}"[:300]
