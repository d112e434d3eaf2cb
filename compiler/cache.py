"""The persistent compile cache: what is costly to compute and the same in every later process.

Four kinds of entries, each under a key that hashes everything it depends on:

- "logic": a traced LogicGraph (`logic_io.dumps_logic`), keyed by the model's fingerprint
  (`compiler.fingerprint`: its code, settings, state shapes and example inputs); a later run, an
  elastic generation or the Trainer's profiler loads it instead of tracing again.
- "decisions": what DTensor's strategy search decided for a graph under a config's placements
  (keyed by the graph's code, the mesh's shape and axis names, the placements of the parameters,
  buffers and inputs' dtypes, data and sequence parallelism, strictness), replayed instead of searched.
- "program": a rank's lowered ExecGraph (`logic_io.dumps_program`), keyed also by the local shapes,
  the rank's mesh coordinate and the decisions ("shared program": one every dp rank lowers alike,
  keyed without the dp coordinate).
- "length fit": the fit of a program and its replay at another sequence length
  (`logic_io.dumps_fit`), keyed by that program's key and the two lengths; a later process that
  loads the program writes every further length from it. The programs written from a fit are not
  cached: writing one costs less than reading it from disk.

Every key also holds the torch version, hotswitch's and a digest of the compiler's and kernels' source, so an
entry written by other code is never read. Where: `$HOTSWITCH_CACHE_DIR`, else
`$XDG_CACHE_HOME/hotswitch`, else `~/.cache/hotswitch`; `HOTSWITCH_CACHE=0` turns it off. An entry
holds a checksum of its payload: a truncated or corrupted entry is reported once, removed and
recomputed. Writers write a temporary file and rename it, so ranks that store the same entry at
once never leave a torn file behind.
"""
from __future__ import annotations

import functools
import hashlib
import os
import pickle
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import torch

from .fingerprint import files_digest

__all__ = ["CompileCache", "default_cache"]

_MAGIC = b"hotswitch-compile-cache-v1\n"


@functools.lru_cache(maxsize=None)
def _version() -> str:
    """hotswitch's version and a digest of the compiler's source and of the kernels' (their ops stay
    whole in LogicGraphs, and their fake implementations decide the traced shapes): entries written
    by code that has been edited since (an editable install keeps its version number) are never read."""
    try:
        from importlib.metadata import version

        number = version("hotswitch")
    except Exception:  # noqa: BLE001 - running from a source tree without an install
        number = "source"
    here = Path(__file__).resolve().parent
    kernels = here.parent / "kernels"  # hotswitch.kernels, beside the compiler in a tree and installed
    return f"{number}+{files_digest([*sorted(here.glob('*.py')), *sorted(kernels.glob('*.py'))], here.parent)[:16]}"


class CompileCache:
    """get(key, kind) / put(key, value) on a directory; `key(...)` builds a key from its parts.
    `hits[kind]` and `misses[kind]` count the lookups of each kind ("decisions", "program", "logic")."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.hits: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()
        self.recovered = 0
        self._warned = False

    @staticmethod
    def key(*parts) -> str:
        """A hex digest of `parts` (strings, numbers, tuples of them) with the torch and hotswitch
        versions: decisions made by another DTensor are never replayed."""
        h = hashlib.sha256()
        for part in (torch.__version__, _version(), *parts):
            h.update(repr(part).encode())
            h.update(b"\0")
        return h.hexdigest()

    def _path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.pkl"

    def get(self, key: str, kind: str = "decisions"):
        value = self._read(key)
        (self.hits if value is not None else self.misses)[kind] += 1
        return value

    def _read(self, key: str):
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            self.report(f"cannot read {path} ({e})")
            return None
        header, _, rest = data.partition(b"\n")
        digest, payload = rest[:64], rest[64:]
        try:
            if header + b"\n" != _MAGIC or hashlib.sha256(payload).hexdigest().encode() != digest:
                raise ValueError("bad header or checksum")
            return pickle.loads(payload)
        except Exception as e:  # noqa: BLE001 - any damage: recompute and overwrite
            self.report(f"{path} is corrupt or truncated ({type(e).__name__}: {e}); it is removed and recomputed")
            self.recovered += 1
            try:
                path.unlink()
            except OSError:
                pass
            return None

    def put(self, key: str, value) -> None:
        path = self._path(key)
        if path.exists():  # equal keys, equal values: another rank of this host wrote it already
            return
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        data = _MAGIC + hashlib.sha256(payload).hexdigest().encode() + payload
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # atomic: readers see the old entry, the new one, or none
        except OSError as e:
            self.report(f"cannot write {path} ({e}); compiling goes on without caching")

    def failed(self, key: str) -> None:
        """The search for `key` raised: nothing to store (ranks sharing a search are told so)."""

    def report(self, message: str) -> None:
        """Warn once per cache: damage is reported, never raised (the entry is recomputed)."""
        if not self._warned:
            warnings.warn(f"hotswitch compile cache: {message}", stacklevel=3)
            self._warned = True


def default_cache() -> CompileCache | None:
    """The cache the environment asks for (see the module doc), or None when it is turned off."""
    if os.environ.get("HOTSWITCH_CACHE", "1").lower() in ("0", "false", "no", "off"):
        return None
    directory = os.environ.get("HOTSWITCH_CACHE_DIR")
    if not directory:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        directory = os.path.join(base, "hotswitch")
    return CompileCache(directory)


_version()  # read the compiler's source now, as imported, not when the first key is made
