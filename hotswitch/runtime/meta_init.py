"""A meta-device model's initialization, one unit of modules at a time, equal to one device's.

Every rank runs the whole initialization (so the random numbers are drawn as on one device) but
holds at most one unit's tensors whole at a time and keeps only its pieces of them (the caller
slices each tensor as it is yielded). What it equals, bit for bit on the CPU, with the same seed:

- weights="init" on a Hugging Face model: `with transformers.initialization.no_init_weights():
  model = Cls(config)` on the CPU, then `model.init_weights()` (`initialize_weights()`, then the
  ties: a tied tensor keeps the first owner's draw, the input embedding's);
- an `init_fn`, or weights="init" on another model (each module's `reset_parameters()`): the model
  on the CPU, tied as its constructor ties it, then `with torch.no_grad(): model.apply(init_fn)`
  (a tied tensor keeps the last draw). `model.to_empty(device="cpu")` gives such a model where
  nothing is tied (it unties).

Units: modules are initialized in `model.apply`'s order (children first). A unit is a subtree whose
tensors total at most the largest module's own, or one whose init writes its submodules' tensors
(GPT-2's scaled projections; learned by a first pass of the initialization on meta placeholders,
which draws nothing), else one module's own tensors.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

INIT = "init"  # weights= of the model's own initialization (`hotswitch.runtime.weights`)


def hf_model_of(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(prefix of its names, module) of the outermost Hugging Face PreTrainedModel in `model`, or None."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    for path, module in model.named_modules():
        if isinstance(module, PreTrainedModel):
            return (path + "." if path else ""), module
    return None


@dataclass(frozen=True)
class _Unit:
    modules: tuple[tuple[str, nn.Module], ...]  # initialized in this order (`nn.Module.apply`'s)
    tensors: tuple[int, ...]  # ids of the tensors they own, whole together


Slot = tuple[str, str]  # (module path, attribute): where a tensor sits


def init_function(model: nn.Module, init) -> Callable[[nn.Module], None]:
    """What initializes one module: `init` when it is a function; for "init", the `_init_weights`
    of the nearest enclosing Hugging Face PreTrainedModel (as `initialize_weights` dispatches it),
    else the module's `reset_parameters()` where it has one."""
    if callable(init):
        return init
    owner = _hf_owners(model)

    def initialize(module: nn.Module) -> None:
        if id(module) in owner:
            owner[id(module)]._init_weights(module)
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()

    return initialize


def initialized(model: nn.Module, init, only: set[int] | None = None, stats: dict | None = None,
                strict: bool = True) -> Iterator[tuple[tuple[str, ...], torch.Tensor]]:
    """Yield (its names, its full value on the CPU) for every parameter and buffer of `model` (or
    those whose ids are in `only`: their modules alone are initialized) as the initialization
    `init` ("init" or a function of a module) finishes it; the model is left as it was.
    `stats["peak_bytes"]`: the most bytes held whole at once. ValueError for a tensor no init
    wrote (`strict=False`: left out), or one written outside the unit being initialized."""
    fn = init_function(model, init)
    slots: dict[int, list[Slot]] = {}  # tensor id -> where it sits (several places: tied)
    tensors: dict[int, torch.Tensor] = {}
    own: dict[int, list[int]] = {}  # module id -> its own tensors' ids
    for path, module in model.named_modules(remove_duplicate=False):
        own[id(module)] = []
        for attr, t in (*module._parameters.items(), *module._buffers.items()):
            if t is not None:
                slots.setdefault(id(t), []).append((path, attr))
                tensors[id(t)] = t
                own[id(module)] = list(dict.fromkeys([*own[id(module)], id(t)]))
    modules = dict(model.named_modules(remove_duplicate=False))
    order = {}
    for i, (_, m) in enumerate(_visits(model, "")):
        order.setdefault(id(m), i)
    for t in slots:  # the first owner `apply` visits first
        slots[t].sort(key=lambda s: order[id(modules[s[0]])])
    hf = _hf_owners(model)
    # Hugging Face ties after initializing (the tie's source keeps its draw); torch's `apply` writes
    # one tied tensor twice (the last draw stays)
    first_wins = {t for t, ss in slots.items() if len(ss) > 1 and init == INIT and id(modules[ss[0][0]]) in hf}
    # meta placeholders sit in every slot but the unit's: a write into one shows in its version
    placeholders = {t: _slot_value(tensors[t], torch.empty(tensors[t].shape, dtype=tensors[t].dtype, device="meta"))
                    for t in tensors}
    hf_guard = _hf_guard(model)
    every = only is None
    try:
        _install(modules, {s: placeholders[t] for t, ss in slots.items() for s in ss})
        writes = _dry_run(model, fn, placeholders, hf_guard) if every else {}
        units = _units(model, own, {t: _nbytes(v) for t, v in tensors.items()}, set(tensors) if every else set(only),
                       every, writes)
        final = {}  # tensor id -> the unit that finishes it
        for i, unit in enumerate(units):
            for t in unit.tensors:
                if t not in final or t not in first_wins:
                    final[t] = i
        versions = {t: p._version for t, p in placeholders.items()}
        alive: dict[int, torch.Tensor] = {}
        peak = held = 0
        for i, unit in enumerate(units):
            values, scratch = {}, 0
            inside = {id(m) for _, m in unit.modules}
            for t in unit.tensors:
                for s in slots[t]:
                    if id(modules[s[0]]) not in inside:
                        continue
                    if final[t] < i or (t in first_wins and s != slots[t][0]):  # a draw the tie discards
                        values[s] = _slot_value(tensors[t], _fresh(tensors[t]))
                        scratch += _nbytes(tensors[t])
                        continue
                    if t not in alive:
                        alive[t] = _slot_value(tensors[t], _fresh(tensors[t]))
                        held += _nbytes(tensors[t])
                    values[s] = alive[t]
            peak = max(peak, held + scratch)
            _install(modules, values)
            with torch.no_grad(), hf_guard():
                for _, module in unit.modules:
                    fn(module)
            _install(modules, {s: placeholders[t] for t in unit.tensors for s in slots[t]})
            del values
            changed = [t for t, p in placeholders.items() if p._version != versions[t]]
            if changed:
                raise ValueError(
                    f"initializing {_name(unit.modules)} wrote {_names(slots[changed[0]])[0]}, which belongs to a "
                    "module outside its unit (initialized before it, or elsewhere): meta initialization materializes "
                    "one unit of modules at a time. Pass weights=init_fn that initializes each module's own tensors")
            for t in unit.tensors:
                if final[t] != i or t not in alive:
                    continue
                value = alive.pop(t).detach()
                held -= _nbytes(value)
                if value.is_floating_point() and value.isnan().any():
                    if not strict:
                        continue
                    path = slots[t][0][0]
                    raise ValueError(
                        f"{_names(slots[t])[0]} ({type(modules[path]).__name__}) was not written by the "
                        f"initialization ({'init_fn' if callable(init) else 'reset_parameters / _init_weights'}), so "
                        "it has no value: pass weights=init_fn that initializes it too, or create it outside "
                        "torch.device('meta')")
                if every or t in only:
                    yield _names(slots[t]), value
    finally:
        _install(modules, {s: tensors[t] for t, ss in slots.items() for s in ss})
    if stats is not None:
        stats["peak_bytes"] = peak


def _dry_run(model: nn.Module, fn, placeholders: dict[int, torch.Tensor], hf_guard) -> dict[int, set[int]]:
    """{module id: ids of tensors its init writes} from the initialization run on the meta
    placeholders (no values, no random numbers drawn: the generator is restored all the same).
    Empty where the initialization cannot run on meta tensors (it reads values, say)."""
    rng = torch.get_rng_state()
    writes: dict[int, set[int]] = {}
    try:
        with torch.no_grad(), hf_guard():
            for _, module in _visits(model, ""):
                before = {t: p._version for t, p in placeholders.items()}
                fn(module)
                writes.setdefault(id(module), set()).update(
                    t for t, p in placeholders.items() if p._version != before[t])
    except Exception:  # noqa: BLE001 - units then follow sizes alone; a write outside one is reported
        writes = {}
    finally:
        torch.set_rng_state(rng)
    return writes


def _units(model: nn.Module, own: dict[int, list[int]], sizes: dict[int, int], wanted: set[int], every: bool,
           writes: dict[int, set[int]]) -> list[_Unit]:
    """The units in `model.apply`'s order: all (`every`), or those owning a wanted tensor. `own`:
    {module id: ids of its own tensors}; `sizes`: {tensor id: bytes}."""
    budget = max((sum(sizes[t] for t in ids) for ids in own.values()), default=0)
    units = []

    def cut(module, path):
        subtree = _visits(module, path)
        ids = list(dict.fromkeys(t for _, m in subtree for t in own[id(m)]))
        reaches = writes.get(id(module), set()) - set(own[id(module)])  # its init writes submodules' tensors
        if sum(sizes[t] for t in ids) <= budget or (reaches and reaches <= set(ids)):
            if every or any(t in wanted for t in ids):
                units.append(_Unit(tuple(subtree), tuple(ids)))
            return
        for name, child in module.named_children():
            cut(child, f"{path}.{name}" if path else name)
        if every or any(t in wanted for t in own[id(module)]):
            units.append(_Unit(((path, module),), tuple(own[id(module)])))

    cut(model, "")
    return units


def _visits(module: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    """`module.apply`'s calls: each child (once per parent) before its parent."""
    out = []
    for name, child in module.named_children():
        out += _visits(child, f"{path}.{name}" if path else name)
    return out + [(path, module)]


def _hf_owners(model: nn.Module) -> dict[int, nn.Module]:
    """{module id: the nearest Hugging Face PreTrainedModel enclosing it (itself included)}."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return {}
    owner: dict[int, nn.Module] = {}

    def mark(module: nn.Module, hf) -> None:
        hf = module if isinstance(module, PreTrainedModel) else hf
        if hf is not None:
            owner[id(module)] = hf
        for child in module.children():
            mark(child, hf)

    mark(model, None)
    return owner


def _hf_guard(model: nn.Module):
    """Hugging Face's own guard around `_init_weights` (torch.nn.init as its flag-aware functions)."""
    if hf_model_of(model) is None:
        return contextlib.nullcontext
    from transformers.initialization import guard_torch_init_functions

    return guard_torch_init_functions


def _fresh(like: torch.Tensor) -> torch.Tensor:
    out = torch.empty(like.shape, dtype=like.dtype, device="cpu")
    if out.is_floating_point():
        out.fill_(math.nan)  # a value left NaN was not written by the initialization
    return out


def _slot_value(original: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` as what goes into `original`'s slot: a Parameter where that is one."""
    if isinstance(original, nn.Parameter):
        return nn.Parameter(value, requires_grad=original.requires_grad)
    return value


def _install(modules: dict[str, nn.Module], values: dict[Slot, torch.Tensor]) -> None:
    for (path, attr), value in values.items():
        module = modules[path]
        if attr in module._parameters:
            module._parameters[attr] = value
        else:
            module._buffers[attr] = value


def _names(slots: list[Slot]) -> tuple[str, ...]:
    return tuple(f"{path}.{attr}" if path else attr for path, attr in slots)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _name(visits) -> str:
    path, module = visits[-1]
    return f"{path or 'the model'} ({type(module).__name__})"
