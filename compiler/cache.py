"""A persistent cache of sharding decisions: what DTensor's strategy search decided for a graph under
a config's placements, so that every rank, every later process (another run, an elastic generation,
the Trainer's profiler) replays it instead of searching again; and of each rank's lowered ExecGraphs
(`get_local` / `put_local`: keyed also by the local shapes, the rank's mesh coordinate and the
decisions, written by `hotswitch.compiler.logic_io.dumps_program`), so that a later process loads
its programs instead of tracing them again.

Where: `$HOTSWITCH_CACHE_DIR`, else `$XDG_CACHE_HOME/hotswitch`, else `~/.cache/hotswitch`;
`HOTSWITCH_CACHE=0` turns it off. An entry is keyed by a hash of everything the decisions depend on
(the graph's code, the mesh's shape and axis names, the placements of the parameters, buffers and
inputs' dtypes, data and sequence parallelism, strictness, the torch and hotswitch versions) and
holds a checksum of its payload: a truncated or corrupted entry is reported once, removed and
recomputed. Writers write a temporary file and rename it, so ranks that store the same entry at
once never leave a torn file behind.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
import warnings
from pathlib import Path

import torch

__all__ = ["DecisionCache", "default_cache"]

_MAGIC = b"hotswitch-decisions-v1\n"


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("hotswitch")
    except Exception:  # noqa: BLE001 - running from a source tree without an install
        return "source"


class DecisionCache:
    """get(key) / put(key, decisions) on a directory; `key(...)` builds the key from its parts."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.hits = self.misses = self.recovered = 0
        self.program_hits = self.program_misses = 0
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

    def get(self, key: str):
        return self._counted(self._read(key), "hits", "misses")

    def get_local(self, key: str):
        """A rank's own entry (its lowered ExecGraph), counted apart from the shared decisions."""
        return self._counted(self._read(key), "program_hits", "program_misses")

    def _counted(self, value, hit: str, miss: str):
        counter = hit if value is not None else miss
        setattr(self, counter, getattr(self, counter) + 1)
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

    put_local = put  # a rank's own entries stay on this disk (SharedDecisions does not publish them)

    def report(self, message: str) -> None:
        """Warn once per cache: damage is reported, never raised (the entry is recomputed)."""
        if not self._warned:
            warnings.warn(f"hotswitch compile cache: {message}", stacklevel=3)
            self._warned = True


def default_cache() -> DecisionCache | None:
    """The cache the environment asks for (see the module doc), or None when it is turned off."""
    if os.environ.get("HOTSWITCH_CACHE", "1").lower() in ("0", "false", "no", "off"):
        return None
    directory = os.environ.get("HOTSWITCH_CACHE_DIR")
    if not directory:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        directory = os.path.join(base, "hotswitch")
    return DecisionCache(directory)
