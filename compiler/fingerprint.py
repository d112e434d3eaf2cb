"""What a traced LogicGraph depends on, as one digest: the key under which the compile cache keeps it.

A trace is a function of the model's code, its non-tensor settings, its state's names, shapes and
dtypes, and the example inputs' structure, shapes and dtypes; never of the weights' values (they are
the graph's inputs). So the fingerprint holds:

- **code**: for each class among the model's modules (and the model's own), the source file it is
  defined in, by content; with it, every other `.py` file of the same package when that package is
  the user's own source tree (a helper edited in a sibling module changes the key too). Code of an
  installed distribution (`transformers`, `torch`) is named by its version instead of read.
- **settings**: each module's plain attributes (numbers, strings, flags such as `training`,
  dataclass or Hugging Face configs); callables by qualified name, anything else by type.
- **state and inputs**: names, shapes and dtypes of parameters and buffers; the example's pytree
  structure, tensor shapes and dtypes, and its non-tensor values.

What it cannot see: code reached only through a global that is not a module of the model's packages
(a monkeypatch applied at run time). `HOTSWITCH_CACHE=0` turns the cache off for such a model.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import inspect
import os
import sys
import sysconfig
from pathlib import Path

import torch
from torch import nn

from ._torch import pytree

__all__ = ["Fingerprint", "files_digest", "model_fingerprint"]

_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)
_MAX_PACKAGE_FILES = 400  # a local package larger than this is named by its defining files only


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """`digest` changes whenever a trace could; `persistent` is False when the code of one of the
    model's classes cannot be read (a class typed at a plain `python` prompt): the digest then names
    the model only within this job, and nothing is cached for it on disk."""

    digest: str
    persistent: bool


def model_fingerprint(model: nn.Module, example_inputs) -> Fingerprint:
    """What a trace of `model(example_inputs)` depends on, as one digest (see the module doc)."""
    h = hashlib.sha256()
    persistent = True

    def add(*parts) -> None:
        for part in parts:
            h.update(repr(part).encode())
            h.update(b"\0")

    classes = {type(m) for m in model.modules()}
    for cls in sorted(classes, key=lambda c: (c.__module__, c.__qualname__)):
        code = _code_of(cls.__module__) if getattr(sys.modules.get(cls.__module__), "__file__", None) \
            else _class_source(cls)
        if code is None:
            persistent, code = False, "unreadable"
        add("class", cls.__module__, cls.__qualname__, code)
    for name, module in model.named_modules():
        add("module", name, sorted((k, _setting(v)) for k, v in vars(module).items()
                                   if not k.startswith("_") or k in ("_version",)))
    for name, t in model.state_dict(keep_vars=True).items():
        add("state", name, tuple(t.shape), str(t.dtype))
    leaves, spec = pytree.tree_flatten(example_inputs)
    add("inputs", str(spec), [(tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else _setting(x)
                              for x in leaves])
    return Fingerprint(h.hexdigest(), persistent)


def _setting(value, depth: int = 0):
    """A value as text that is the same in every process (no memory addresses)."""
    if isinstance(value, _PLAIN):
        return repr(value)
    if depth < 6 and isinstance(value, (tuple, list, set, frozenset)):
        items = [_setting(v, depth + 1) for v in value]
        return (type(value).__name__, sorted(items) if isinstance(value, (set, frozenset)) else items)
    if depth < 6 and isinstance(value, dict):
        return ("dict", sorted((repr(k), _setting(v, depth + 1)) for k, v in value.items()))
    if isinstance(value, (nn.Module, torch.Tensor)):
        return type(value).__qualname__  # submodules and tensors are fingerprinted on their own
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__qualname__, _setting(dataclasses.asdict(value), depth + 1))
    to_dict = getattr(value, "to_dict", None)  # a Hugging Face PretrainedConfig
    if callable(to_dict) and depth < 6:
        try:
            return (type(value).__qualname__, _setting(to_dict(), depth + 1))
        except Exception:  # noqa: BLE001 - a to_dict that needs arguments: not a config
            pass
    if callable(value):
        name = getattr(value, "__qualname__", type(value).__qualname__)
        return ("callable", getattr(value, "__module__", None), name)
    return ("object", type(value).__module__, type(value).__qualname__)


def _code_of(module_name: str):
    """The code a class's module stands for: an installed distribution's version, or the digest of
    the module's file and of the rest of its (local) package, read again whenever a file changed
    (a notebook that edits and reloads its model gets a new key)."""
    module = sys.modules.get(module_name)
    top = module_name.split(".")[0]
    path = Path(module.__file__).resolve()
    if _installed(path):
        version = getattr(sys.modules.get(top), "__version__", None)
        if version is not None and top != "hotswitch":
            return ("installed", top, version)
    files, root = [path], path.parent
    if getattr(sys.modules.get(top), "__path__", None) and getattr(sys.modules[top], "__file__", None):
        package = Path(sys.modules[top].__file__).resolve().parent
        if not _installed(package):
            local = sorted(package.rglob("*.py"))
            if len(local) <= _MAX_PACKAGE_FILES:
                files, root = local, package
    stamps = []
    for f in files:
        try:
            st = f.stat()
            stamps.append((str(f), st.st_mtime_ns, st.st_size))
        except OSError:
            stamps.append((str(f), None, None))
    return ("source", module_name, _digest_of(tuple(stamps), root))


@functools.lru_cache(maxsize=256)
def _digest_of(stamps: tuple, root: Path) -> str:
    return files_digest([Path(f) for f, _, _ in stamps], root)


def _class_source(cls: type):
    """A class defined where there is no file (a notebook cell, `python -c`): its own source text
    if the interpreter kept it (IPython does), else None."""
    try:
        return ("class source", hashlib.sha256(inspect.getsource(cls).encode()).hexdigest())
    except (OSError, TypeError):
        return None


def _installed(path: Path) -> bool:
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    return any(str(path).startswith(os.path.realpath(r) + os.sep) for r in roots)


def files_digest(files, root: Path) -> str:
    """The digest of `files` by path under `root` and content (the compile cache's version digests
    hotswitch's own compiler this way: an edited compiler never reads an older one's entries)."""
    digest = hashlib.sha256()
    for f in files:
        digest.update(str(f.relative_to(root) if f.is_relative_to(root) else f.name).encode())
        try:
            digest.update(f.read_bytes())
        except OSError:
            digest.update(b"unreadable")
    return digest.hexdigest()

