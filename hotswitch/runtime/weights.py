"""Where a compiled model's weights come from, each rank reading only the pieces it holds.

A model built under `torch.device("meta")` holds no values: `weights=` (of `hs.compile`,
`hs.Trainer`, `ElasticJob`, and `CompiledModel.load_weights`) names where they come from:

- None: the model's own values (every parameter and buffer materialized; a meta one is an error);
- "init": the model's own initialization (`initialized`): Hugging Face's `_init_weights` for the
  modules of a `PreTrainedModel`, `reset_parameters()` for others;
- a callable `init_fn(module)`: called on every module, in `model.apply(init_fn)`'s order;
- a path: a Hugging Face checkpoint (`save_pretrained`'s directory: `*.safetensors` with
  `model.safetensors.index.json`, or one `model.safetensors`; or a `.safetensors` file), read with
  `safe_open(...).get_slice(name)[box]` (a rank reads its boxes, never a whole tensor it does not
  hold), or a `torch.distributed.checkpoint` directory (its `.metadata`), loaded into DTensors of
  the layout (DCP reshards);
- "empty": uninitialized shards, for a caller that fills them at once (an elastic job's state).

Names: a checkpoint's keys are matched to the compiled module's parameter names up to one prefix
on either side (`match_keys`: the user's module may wrap a Hugging Face model; a Trainer wraps the
user's); tied weights are found under any of their names. Buffers a source lacks (non-persistent
ones, as a rotary `inv_freq`) keep the model's value, or where that is on meta are computed by
their module's initialization.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hotswitch.runtime.meta_init import INIT, initialized

EMPTY = "empty"
HF_INDEX, HF_SINGLE = "model.safetensors.index.json", "model.safetensors"
DCP_METADATA = ".metadata"
_PREFIX_DEPTH = 3  # wrappers peeled off when matching names: at most this many dotted components


@dataclass(frozen=True)
class LoadReport:
    """How a rank got its weights (`CompiledModel.last_load`)."""

    source: str  # "model" | "init" | "init_fn" | "safetensors" | "dcp" | "empty"
    seconds: float
    read_bytes: int = 0  # read from files by this rank: its boxes of the parameters, whole buffers
    peak_bytes: int = 0  # init: the most bytes of whole tensors held at once (one unit, `initialized`)
    prefix: tuple[str, str] = ("", "")  # (stripped from the model's names, from the source's keys)


# ------------------------------------------------------------------------------------ arguments
def check_source(weights, model: nn.Module) -> str:
    """The kind of `weights` ("model", "init", "init_fn", "empty", "safetensors", "dcp"), or a
    ValueError naming the problem and the fix (before tracing: a bad argument fails at once)."""
    if weights is None:
        meta = first_meta(model)
        if meta is not None:
            raise ValueError(
                f"the model is on the meta device ({meta!r} has no values), so weights=None (the model's own "
                "values) has nothing to read: pass weights='init' (its own initialization, each rank keeping its "
                "shards), weights=<directory> (a Hugging Face save_pretrained directory or a "
                "torch.distributed.checkpoint directory) or weights=init_fn (called on every module)")
        return "model"
    if callable(weights):
        return "init_fn"
    if weights in (INIT, EMPTY):
        return weights
    if isinstance(weights, (str, os.PathLike)):
        return source_kind(weights)
    raise ValueError(f"weights must be None, 'init', 'empty', a function of a module or a checkpoint path; "
                     f"got {type(weights).__name__}")


def source_kind(path) -> str:
    """"safetensors" or "dcp", by what the path holds; a ValueError saying what was expected otherwise."""
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".safetensors"):
        return "safetensors"
    if os.path.isdir(path):
        names = os.listdir(path)
        if DCP_METADATA in names:
            return "dcp"
        if any(n.endswith(".safetensors") for n in names):
            return "safetensors"
        raise ValueError(f"weights={path!r}: the directory holds neither *.safetensors files (a Hugging Face "
                         f"save_pretrained directory) nor {DCP_METADATA} (a torch.distributed.checkpoint); "
                         f"it holds {sorted(names)[:8]}")
    raise ValueError(f"weights={path!r}: no such directory or .safetensors file; pass a Hugging Face "
                     "save_pretrained directory, a torch.distributed.checkpoint directory, or 'init'")


def first_meta(model: nn.Module) -> str | None:
    """The name of the first parameter or buffer of `model` on the meta device, or None."""
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.device.type == "meta":
            return name
    return None


# ------------------------------------------------------------------------------------ names
@dataclass(frozen=True)
class KeyMatch:
    """A source's keys for a model's tensors: `keys[model name] = source key`."""

    keys: dict[str, str]
    prefix: tuple[str, str]  # (stripped from the model's names, stripped from the source's keys)


def match_keys(params: list[str], aliases: dict[str, str], buffers: list[str], source: dict[str, tuple],
               shapes: dict[str, tuple], what: str) -> KeyMatch:
    """Each canonical parameter's key in `source` ({key: shape}), under any of its names (`aliases`:
    alias -> canonical), up to one prefix on either side (the one that matches most parameters; the
    shorter on ties), and the buffers' keys where the source has them. ValueError, naming them, for
    parameters it lacks, keys that name nothing of the model, and shapes that differ."""
    names = {n: [n] + [a for a, c in aliases.items() if c == n] for n in params}
    best = None
    for pm, pk in _prefix_candidates(params, source):
        stripped = {k[len(pk):] for k in source if k.startswith(pk)}
        found = sum(any(m.startswith(pm) and m[len(pm):] in stripped for m in names[n]) for n in params)
        score = (found, -len(pm) - len(pk))
        if best is None or score > best[0]:
            best = (score, pm, pk)
    _, pm, pk = best
    keys, used = {}, set()
    for n in params:
        for m in names[n]:
            k = pk + m[len(pm):]
            if m.startswith(pm) and k in source:
                used.add(k)
                keys.setdefault(n, k)
    for b in buffers:
        k = pk + b[len(pm):]
        if b.startswith(pm) and k in source:
            keys[b] = k
            used.add(k)
    missing = [n for n in params if n not in keys]
    unexpected = sorted(set(source) - used)
    if missing or unexpected:
        under = (f" (its keys are the model's names less {pm!r})" if pm else
                 f" (its keys are the model's names behind {pk!r})" if pk else "")
        wanted = [f"{n} (key {pk + n[len(pm):]})" if (pm or pk) and n.startswith(pm) else n for n in missing]
        raise ValueError(
            f"{what} does not fit the model{under}: " + "; ".join(filter(None, [
                f"no value for {len(missing)} parameter(s) {_few(wanted)}" if missing else "",
                f"{len(unexpected)} key(s) that name nothing of the model {_few(unexpected)}" if unexpected else ""]))
            + f". The model's parameters are named like {_few(params, 3)}, the checkpoint's keys like "
            f"{_few(sorted(source), 3)}: load a checkpoint of this model (the same architecture and config)")
    wrong = {n: (tuple(source[k]), tuple(shapes[n])) for n, k in keys.items()
             if n in shapes and tuple(source[k]) != tuple(shapes[n])}
    if wrong:
        listed = ", ".join(f"{keys[n]} {a} where the model's {n} is {b}" for n, (a, b) in list(wrong.items())[:4])
        raise ValueError(f"{what} does not fit the model: {len(wrong)} tensor(s) have other shapes: {listed}; "
                         "load a checkpoint of this model's config (hidden size, vocabulary, layers)")
    return KeyMatch(keys, (pm, pk))


def _prefix_candidates(params: list[str], source) -> list[tuple[str, str]]:
    """("", ""), then one side's leading components (up to `_PREFIX_DEPTH`) stripped; on the
    source's side after a "kind:" too (an elastic job's checkpoint names its weights "param:NAME")."""
    def prefixes(names):
        out = set()
        for n in names:
            parts = n.split(".")
            out.update(".".join(parts[:i]) + "." for i in range(1, min(len(parts), _PREFIX_DEPTH + 1)))
        return out

    kinds = {k[:k.index(":") + 1] for k in source if ":" in k}
    keyed = prefixes(source) | kinds | {kind + p for kind in kinds
                                         for p in prefixes(k[len(kind):] for k in source if k.startswith(kind))}
    return [("", "")] + [(p, "") for p in sorted(prefixes(params))] + [("", p) for p in sorted(keyed)]


def _few(items, n: int = 5) -> str:
    items = list(items)
    return str(items[:n])[:-1] + (f", ... {len(items) - n} more]" if len(items) > n else "]")


# ------------------------------------------------------------------------------------ sources
class SafetensorsFiles:
    """A Hugging Face checkpoint's tensors: names and shapes from the files' headers (and the index),
    values read box by box (`read`), each file opened once."""

    def __init__(self, path):
        path = os.fspath(path)
        self.path = path
        if os.path.isfile(path):
            files = [path]
        elif os.path.isfile(os.path.join(path, HF_INDEX)):
            with open(os.path.join(path, HF_INDEX)) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted({os.path.join(path, v) for v in weight_map.values()})
            absent = [f for f in files if not os.path.isfile(f)]
            if absent:
                raise ValueError(f"weights={path!r}: {HF_INDEX} names files that are not there: {_few(absent)}; "
                                 "copy the whole save_pretrained directory")
        elif os.path.isfile(os.path.join(path, HF_SINGLE)):
            files = [os.path.join(path, HF_SINGLE)]
        else:
            files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
        from safetensors import safe_open

        self._stack = contextlib.ExitStack()
        self.file_of: dict[str, object] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name in files:
            handle = self._stack.enter_context(safe_open(name, framework="pt"))
            for key in handle.keys():
                self.file_of[key] = handle
                self.shapes[key] = tuple(handle.get_slice(key).get_shape())
        self.read_bytes = 0

    def read(self, key: str, box: tuple[slice, ...], dtype: torch.dtype) -> torch.Tensor:
        """The box of tensor `key` (one slice per dim), as `dtype`: only that box is read."""
        piece = self.file_of[key].get_slice(key)[box]
        self.read_bytes += piece.numel() * piece.element_size()
        return piece.to(dtype)

    def close(self) -> None:
        self._stack.close()


def dcp_shapes(path) -> dict[str, tuple[int, ...]]:
    """{key: global shape} of a torch.distributed.checkpoint directory's tensors. An elastic job's
    checkpoint (keys "param:NAME", "exp_avg:NAME", ...) gives its weights, the "param:" entries."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = FileSystemReader(os.fspath(path)).read_metadata().state_dict_metadata
    shapes = {k: tuple(v.size) for k, v in saved.items() if isinstance(v, TensorStorageMetadata)}
    if shapes and all(":" in k for k in shapes) and any(k.startswith("param:") for k in shapes):
        shapes = {k: s for k, s in shapes.items() if k.startswith("param:")}
    return shapes


def check_same_rng() -> None:
    """Initialization draws from torch's CPU generator on every rank: they must agree (one all_gather)."""
    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, digest)
    if len(set(states)) > 1:
        differ = [r for r, s in enumerate(states) if s != states[0]]
        raise ValueError(f"weights='init' draws the same random numbers on every rank, but ranks {differ} have another "
                         "random state than rank 0: call torch.manual_seed(seed) with one seed on every rank before "
                         "compiling")


def timer() -> Callable[[], float]:
    t0 = time.perf_counter()
    return lambda: time.perf_counter() - t0


# ------------------------------------------------------------------------------------ loading
def load(cm, weights, model: nn.Module | None, dtype: torch.dtype | None = None
         ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], LoadReport]:
    """This rank's pieces (in `dtype`, default each parameter's) of the parameters it holds under
    `cm`'s active config, and the buffers `weights` gives (by name), read from `weights` (see the
    module doc; "init" and init functions need `model`, whose names may differ from the compiled
    module's by a prefix, as a checkpoint's). A collective for DCP and initialization."""
    elapsed = timer()
    kind = check_source(weights, model) if model is not None else _kind_without_model(weights)
    st = cm._state(cm.active)
    held = cm._held(st)
    boxes = {n: cm._box(st, n) for n in held}
    dtypes = {n: dtype or cm.logic.param_dtypes[n] for n in held}
    buffer_shapes = {b: tuple(t.shape) for b, t in zip(cm.logic.buffer_names, cm._buffers)}
    shapes = {**{n: tuple(s) for n, s in cm.logic.param_shapes.items()}, **buffer_shapes}
    pieces, buffers, read, peak, prefix = {}, {}, 0, 0, ("", "")

    def match(source: dict[str, tuple], what: str) -> KeyMatch:
        return match_keys(list(cm.logic.param_names), cm.logic.aliases, list(cm.logic.buffer_names), source, shapes,
                          what)

    if kind == EMPTY:
        pieces = {n: torch.empty([b.stop - b.start for b in boxes[n]], dtype=dtypes[n], device=cm.device)
                  for n in held}
    elif kind == "model":  # the compiled model's own values (identical on every rank), its names
        params = dict(model.named_parameters(remove_duplicate=False))
        pieces = {n: params[n].detach()[boxes[n]].to(device=cm.device, dtype=dtypes[n], copy=True) for n in held}
    elif kind in (INIT, "init_fn"):

        check_same_rng()
        state = {n: tuple(t.shape) for n, t in (*model.named_parameters(remove_duplicate=False),
                                               *model.named_buffers(remove_duplicate=False))}
        found = match(state, "the model's initialization")
        of_key = {k: n for n, k in found.keys.items()}
        stats: dict = {}
        for names, full in initialized(model, weights, stats=stats):
            for key in names:
                n = of_key.get(key)
                if n in boxes:
                    pieces[n] = full[boxes[n]].to(device=cm.device, dtype=dtypes[n], copy=True)
                elif n in buffer_shapes:
                    buffers[n] = full.to(device=cm.device, copy=True)
        peak, prefix = stats["peak_bytes"], found.prefix
    elif kind == "safetensors":
        files = SafetensorsFiles(weights)
        try:
            found = match(files.shapes, f"the Hugging Face checkpoint {os.fspath(weights)!r}")
            for n in held:
                pieces[n] = files.read(found.keys[n], boxes[n], dtypes[n]).to(cm.device)
            for b in buffer_shapes:
                if b in found.keys:  # whole: buffers are replicated
                    whole = tuple(slice(None) for _ in buffer_shapes[b])
                    buffers[b] = files.read(found.keys[b], whole, buffer_of(cm, b).dtype).to(cm.device)
            read, prefix = files.read_bytes, found.prefix
        finally:
            files.close()
    else:  # a torch.distributed.checkpoint: loaded into DTensors of this layout (DCP reshards)
        import torch.distributed.checkpoint as dcp

        found = match(dcp_shapes(weights), f"the torch.distributed.checkpoint {os.fspath(weights)!r}")
        state = {}
        for n in held:
            local = torch.empty([b.stop - b.start for b in boxes[n]], dtype=dtypes[n], device=cm.device)
            state[found.keys[n]] = cm.as_dtensors({n: local})[n]
        wanted = [b for b in buffer_shapes if b in found.keys]
        for b in wanted:
            state[found.keys[b]] = torch.empty(buffer_shapes[b], dtype=buffer_of(cm, b).dtype, device=cm.device)
        dcp.load(state, checkpoint_id=os.fspath(weights))
        pieces = {n: state[found.keys[n]].to_local() for n in held}
        buffers = {b: state[found.keys[b]] for b in wanted}
        read, prefix = sum(t.numel() * t.element_size() for t in (*pieces.values(), *buffers.values())), found.prefix
    return pieces, buffers, LoadReport(kind, elapsed(), read, peak, prefix)


def buffer_of(cm, name: str) -> torch.Tensor:
    """A compiled model's buffer by name (whole: buffers are replicated)."""
    return cm._buffers[cm.logic.buffer_names.index(name)]


def _kind_without_model(weights) -> str:
    if weights is None or weights == INIT or callable(weights):
        raise ValueError("load_weights(weights) without the model reads a checkpoint path (or 'empty'); "
                         "initializing needs it: load_weights('init', model) or load_weights(init_fn, model)")
    return check_source(weights, nn.Module())


def computed_buffers(model: nn.Module, names: list[str], device: torch.device, init=INIT) -> list[torch.Tensor]:
    """`model`'s buffers `names` on `device`: their values, or where they are on the meta device
    (a model built on meta; non-persistent ones such as a rotary `inv_freq` are in no checkpoint)
    computed by their modules' initialization (`init`: "init" or an init function); those it does not
    write stay on meta, for a checkpoint to fill (`check_buffers`). torch's random generator is left
    as it was."""

    state = dict(model.named_buffers(remove_duplicate=False))
    meta = {id(state[n]) for n in names if state[n].device.type == "meta"}
    values = {}
    if meta:
        rng = torch.get_rng_state()
        try:
            for owners, value in initialized(model, init, only=meta, strict=False):
                values.update(dict.fromkeys(owners, value))
        finally:
            torch.set_rng_state(rng)
    return [values[n].to(device, copy=True) if n in values else
            state[n].detach().to(device, copy=True) if state[n].device.type != "meta" else state[n].detach()
            for n in names]


def check_buffers(names: list[str], buffers: list[torch.Tensor], source) -> None:
    """ValueError naming the buffers that neither `source` nor their modules' initialization gave a value."""
    absent = [n for n, b in zip(names, buffers) if b.device.type == "meta"]
    if absent:
        raise ValueError(f"buffer(s) {_few(absent)} have no value: the model built them on the meta device, "
                         f"weights={source!r} holds none and their modules' initialization (reset_parameters / "
                         "_init_weights) does not write them; register them outside torch.device('meta'), or pass "
                         "weights=init_fn that computes them")
