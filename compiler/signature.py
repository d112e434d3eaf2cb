"""How a user's model is called: its inputs by name, and the loss in what it returns.

`hs.compile` takes a model as it comes. Its example inputs may be a tuple (positional) or a dict of
keyword arguments (`dict(input_ids=ids, labels=labels)`, as Hugging Face models are called); they
are bound to `model.forward`'s parameters once, so every later call (`shard_inputs`,
`forward_backward`, `__call__`) can use either form and is checked against the same names. Its
forward may return a scalar loss, or an object or dict with a `loss` entry (Hugging Face outputs).
`use_cache=False` is passed where forward takes `use_cache` and the inputs do not set it: a KV cache
is inference state, and its type (`DynamicCache`) cannot cross torch.export's boundary.

The compiled graphs take the tensors only, in one fixed order (`ModelCall.flatten`); non-tensor
inputs (flags such as `use_cache`, `return_dict`) are fixed when compiling. `LossModule` is what the
tracer sees: forward(*tensors) -> the scalar loss, sharing the model's own submodules, parameters
and buffers so that every name stays the model's.
"""
from __future__ import annotations

import enum
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._torch import pytree

__all__ = ["InputError", "LossModule", "ModelCall"]

_CONSTANTS = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.memory_format, enum.Enum)
_P = inspect.Parameter


class InputError(ValueError):
    """Inputs that do not fit the model (or the compiled graphs); the message names the expected ones."""


@dataclass(frozen=True, eq=False)
class ModelCall:
    """The model's inputs bound to `forward`'s parameters, as fixed by the example inputs."""

    model_name: str
    signature: inspect.Signature | None  # None: forward's signature cannot be read; inputs bind as given
    names: tuple[str, ...]  # the top-level arguments given at compile time, in forward's order
    leaf_names: tuple[str, ...]  # every leaf of the flattened arguments, e.g. "input_ids", "batch.ids"
    spec: Any  # the pytree spec of {name: value}
    tensors: tuple[int, ...]  # leaves that are tensors: the compiled graphs' inputs, in this order
    constants: tuple[tuple[int, Any], ...]  # (leaf index, value): non-tensor leaves, fixed at compile time
    defaults: tuple[tuple[str, Any], ...]  # arguments hotswitch added (use_cache=False); a call may leave them out
    example: tuple[str, ...]  # each top-level argument at compile time, for messages: "input_ids=Tensor[2, 8]"

    # ------------------------------------------------------------------------------ construction
    @classmethod
    def of(cls, model: nn.Module, example_inputs) -> ModelCall:
        """Bind `example_inputs` (a tuple, a dict of keyword arguments, or one tensor) to `model.forward`."""
        args, kwargs = _split(example_inputs, "example_inputs")
        signature = _signature(model)
        name = type(model).__name__
        arguments = _bind(signature, args, kwargs, f"{name}.forward{_format(signature)}", "example_inputs")
        defaults = ()
        if signature is not None and "use_cache" in signature.parameters and "use_cache" not in arguments:
            arguments["use_cache"] = False
            arguments = {p: arguments[p] for p in signature.parameters if p in arguments} | arguments
            defaults = (("use_cache", False),)
        if not arguments:
            raise InputError(f"example_inputs are empty: {name}.forward{_format(signature)} needs its inputs, "
                             "e.g. (input_ids, labels) or dict(input_ids=ids, labels=labels)")
        leaves, spec, leaf_names = _flatten(arguments)
        tensors, constants = [], []
        for i, (leaf, leaf_name) in enumerate(zip(leaves, leaf_names)):
            if isinstance(leaf, torch.Tensor):
                tensors.append(i)
            elif leaf is None or isinstance(leaf, _CONSTANTS):
                constants.append((i, leaf))
            else:
                raise InputError(_unflattenable(leaf_name, leaf))
        if not tensors:
            raise InputError(f"example_inputs hold no tensor: {name}.forward needs at least one tensor input "
                             "(token ids, say) with the batch along dim 0")
        example = tuple(f"{n}={_describe(v)}" for n, v in arguments.items())
        return cls(name, signature, tuple(arguments), tuple(leaf_names), spec, tuple(tensors), tuple(constants),
                   defaults, example)

    # ------------------------------------------------------------------------------ calls
    @property
    def tensor_names(self) -> tuple[str, ...]:
        """The compiled graphs' inputs, in their order."""
        return tuple(self.leaf_names[i] for i in self.tensors)

    def expected(self) -> str:
        """The inputs a call must give, for messages: "input_ids, labels"."""
        added = {n for n, _ in self.defaults}
        return ", ".join(n for n in self.names if n not in added)

    def flatten_example(self, example_inputs) -> tuple[torch.Tensor, ...]:
        """The example inputs' tensors, in the graphs' order."""
        return self.flatten(*_split(example_inputs, "example_inputs"), what="example_inputs")

    def flatten(self, args: tuple, kwargs: dict, what: str = "inputs") -> tuple[torch.Tensor, ...]:
        """The tensors of a call (positional and/or keyword, as at compile time), in the graphs' order.

        A call gives the same arguments as the example inputs did: a missing or an extra one is an
        InputError naming the expected arguments; non-tensor values must equal the compiled ones."""
        arguments = _bind(self.signature, tuple(args), dict(kwargs), f"{self.model_name}.forward("
                          f"{self.expected()})", what, partial=True)
        for name, value in self.defaults:
            arguments.setdefault(name, value)
        missing = [n for n in self.names if n not in arguments]
        extra = [n for n in arguments if n not in self.names]
        if missing or extra:
            problem = "; ".join(
                ([f"missing {_quote(missing)}"] if missing else [])
                + ([f"{_quote(extra)} not given at compile time"] if extra else [])
            )
            raise InputError(f"{what}: {problem}. The model was compiled with inputs ({self.expected()}): pass "
                             "exactly those (positionally or by keyword), or compile again with other example_inputs")
        arguments = {n: arguments[n] for n in self.names}
        try:
            leaves, spec, names = _flatten(arguments)
        except Exception:  # noqa: BLE001 - reported as a structure mismatch below
            leaves, spec, names = None, None, ()
        if spec != self.spec:
            raise InputError(f"{what}: the structure of the inputs differs from the example inputs' "
                             f"({', '.join(names) or 'unreadable'} vs {', '.join(self.leaf_names)}): give the same "
                             "nesting of tensors as at compile time")
        for i, value in self.constants:
            if not _same(leaves[i], value):
                raise InputError(f"{what}: {self.leaf_names[i]}={leaves[i]!r}, but the model was compiled with "
                                 f"{self.leaf_names[i]}={value!r}; non-tensor inputs are fixed at compile time: "
                                 "pass the same value, or compile again")
        out = []
        for i in self.tensors:
            if not isinstance(leaves[i], torch.Tensor):
                raise InputError(f"{what}: {self.leaf_names[i]} must be a tensor (it was one at compile time), "
                                 f"got {type(leaves[i]).__name__}")
            out.append(leaves[i])
        return tuple(out)

    @staticmethod
    def map_tensors(fn, args: tuple, kwargs: dict):
        """`fn` applied to every tensor of a call, in the call's own form: a tuple for positional
        inputs, a dict for keyword inputs (nested containers kept); other values as they are."""
        each = lambda v: pytree.tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, v)  # noqa: E731
        if kwargs:
            return {name: each(value) for name, value in kwargs.items()}
        return tuple(each(value) for value in args)

    def arguments(self, tensors) -> tuple[list, dict]:
        """(args, kwargs) for `model.forward` from the graphs' tensor inputs and the fixed constants."""
        leaves = [None] * len(self.leaf_names)
        for i, t in zip(self.tensors, tensors):
            leaves[i] = t
        for i, value in self.constants:
            leaves[i] = value
        arguments = pytree.tree_unflatten(leaves, self.spec)
        return _call_args(self.signature, arguments)

    def loss(self, output) -> torch.Tensor:
        """The scalar loss in what forward returned: the tensor itself, `.loss`, or `["loss"]`."""
        if isinstance(output, torch.Tensor):
            return output
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, Mapping):
            loss = output.get("loss")
        if isinstance(loss, torch.Tensor):
            return loss
        kind = type(output).__name__
        if hasattr(output, "loss") or (isinstance(output, Mapping) and "loss" in output) or hasattr(output, "logits"):
            bound = ", ".join(self.example)
            hint = (" Hugging Face models compute a loss only when given labels=...;" if "labels" not in self.names
                    else "")
            raise InputError(
                f"the model returned a {kind} without a loss (loss is {loss!r}).{hint} The example inputs were bound "
                f"as {self.model_name}.forward({bound}); pass them by keyword, e.g. "
                "example_inputs=dict(input_ids=ids, labels=labels), or wrap the model so forward returns the loss")
        raise InputError(
            f"the model returned a {kind}; hotswitch trains on a scalar loss: return the loss (a mean over tokens), "
            "an object with .loss, or a dict with 'loss' (as Hugging Face models do when given labels)")


class LossModule(nn.Module):
    """`model` as the tracer wants it: forward(*tensors) -> scalar loss (see ModelCall).

    Holds the model's own dicts of submodules, parameters and buffers (not copies, and not the model
    as a child), so parameter names, buffer names and module paths are exactly the model's."""

    def __init__(self, model: nn.Module, call: ModelCall):
        super().__init__()
        self.__dict__["_target"] = model
        self.__dict__["_call"] = call
        self._modules = model._modules
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._non_persistent_buffers_set = model._non_persistent_buffers_set
        self.training = model.training

    def forward(self, *tensors):
        args, kwargs = self._call.arguments(tensors)
        return self._call.loss(self._target(*args, **kwargs))


# ---------------------------------------------------------------------------------- helpers
def _split(inputs, what: str) -> tuple[tuple, dict]:
    if isinstance(inputs, Mapping):
        if not all(isinstance(k, str) for k in inputs):
            raise InputError(f"{what} as a dict must map argument names (str) to values, got keys {list(inputs)}")
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    raise InputError(f"{what} must be a tuple of positional inputs or a dict of keyword inputs, got "
                     f"{type(inputs).__name__}")


def _signature(model: nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


def _format(signature: inspect.Signature | None) -> str:
    if signature is None:
        return "(...)"
    names = [("*" if p.kind is _P.VAR_POSITIONAL else "**" if p.kind is _P.VAR_KEYWORD else "") + p.name
             for p in signature.parameters.values()]
    return f"({', '.join(names)})"


def _bind(signature, args: tuple, kwargs: dict, where: str, what: str, partial: bool = False) -> dict:
    """{argument name: value} in forward's parameter order; *args items as "args[i]", **kwargs items
    under their own names. `partial`: missing arguments are the caller's to report."""
    if signature is None:
        return {**{f"args[{i}]": a for i, a in enumerate(args)}, **kwargs}
    try:
        bound = signature.bind_partial(*args, **kwargs) if partial else signature.bind(*args, **kwargs)
    except TypeError as e:
        raise InputError(f"{what} do not fit {where}: {e}") from None
    out = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is _P.VAR_POSITIONAL:
            out.update({f"{name}[{i}]": v for i, v in enumerate(value)})
        elif kind is _P.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


def _call_args(signature, arguments: dict) -> tuple[list, dict]:
    """Back from `_bind`'s names to (args, kwargs): positional while forward's parameters come in
    order without a gap, keywords after that (and for **kwargs)."""
    if signature is None:
        return ([v for n, v in arguments.items() if n.startswith("args[")],
                {n: v for n, v in arguments.items() if not n.startswith("args[")})
    args, kwargs, positional, taken = [], {}, True, set()
    for p in signature.parameters.values():
        if p.kind is _P.VAR_POSITIONAL:
            items = [n for n in arguments if n.startswith(f"{p.name}[")]
            args.extend(arguments[n] for n in items)
            taken.update(items)
        elif p.kind is _P.VAR_KEYWORD:
            continue
        elif p.name not in arguments:
            positional = positional and p.kind is _P.KEYWORD_ONLY
        elif positional and p.kind is not _P.KEYWORD_ONLY:
            args.append(arguments[p.name])
            taken.add(p.name)
    kwargs = {n: v for n, v in arguments.items() if n not in taken}
    return args, kwargs


def _flatten(arguments: dict) -> tuple[list, Any, list[str]]:
    with_path, spec = pytree.tree_flatten_with_path(arguments)
    names = []
    for path, _ in with_path:
        head, rest = path[0], path[1:]
        names.append(str(getattr(head, "key", head)) + pytree.keystr(rest))
    return [leaf for _, leaf in with_path], spec, names


def _unflattenable(name: str, value) -> str:
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    return (f"input {name} is a {kind}, which torch.export cannot look into (it is not a registered pytree type): "
            f"register it (torch.export.register_dataclass({type(value).__name__}) for a dataclass, else "
            "torch.utils._pytree.register_pytree_node), or pass its tensors as separate inputs")


def _same(a, b) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values are different
        return False


def _quote(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)}"
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        return f"{type(value).__name__}({', '.join(_describe(v) for v in value)})"
    return type(value).__name__ if not isinstance(value, (*_CONSTANTS, type(None))) else repr(value)
