"""Asynchronous checkpoints of a job's state in torch.distributed.checkpoint (DCP) format, with a manifest.

An elastic job saves its state (fp32 masters and optimizer moments as DTensors on the current config's
mesh, plus small JSON metadata) every N steps without stopping training, and after a failure loads the
newest *complete* checkpoint into whatever layout and world size it restarts with (DCP reshards on load).

Layout under ``root``::

    root/step-00000012/__0_0.distcp, __1_0.distcp, .metadata   # written by DCP, one .distcp per rank
    root/step-00000012/manifest.json                           # written last, by rank 0 of the group

``manifest.json`` = ``{"step", "files": {name: [size, sha256]}, "meta"}``. It is written (atomically) only
after every rank's files are on disk, so a directory without it is an unfinished save; its sizes and
hashes turn a truncated or corrupted file into a clear `CheckpointError` instead of a silent bad load.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CheckpointError", "Manifest", "AsyncCheckpointer", "list_checkpoints", "latest", "verify", "load"]

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step-(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint on disk cannot be used; the message names the directory, the file, what is wrong and the fix."""


@dataclass(frozen=True, slots=True)
class Manifest:
    path: str  # the checkpoint directory
    step: int
    files: dict[str, tuple[int, str]]  # every file DCP wrote: name relative to `path` -> (size in bytes, sha256 hex)
    meta: dict  # the JSON metadata given to save()


# ----------------------------------------------------------------------------------------------
# files


def _step_dir(root: str | os.PathLike, step: int) -> str:
    return os.path.join(os.fspath(root), f"step-{step:08d}")


def list_checkpoints(root: str | os.PathLike) -> list[str]:
    """Every ``step-*`` directory under ``root``, oldest (lowest step) first, complete or not."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.fullmatch(name)
        if m and os.path.isdir(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return [path for _, path in sorted(found)]


def _is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def latest(root: str | os.PathLike) -> str | None:
    """The newest checkpoint directory that has a manifest; unfinished saves are skipped."""
    complete = [p for p in list_checkpoints(root) if _is_complete(p)]
    return complete[-1] if complete else None


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _data_files(path: str) -> list[str]:
    """The files a save wrote into ``path`` (DCP's), i.e. all regular files but the manifest and its temp files."""
    return sorted(
        name for name in os.listdir(path)
        if os.path.isfile(os.path.join(path, name)) and not name.startswith(MANIFEST)
    )


def _write_manifest(path: str, step: int, meta: dict) -> Manifest:
    """Hash every file in ``path`` and write manifest.json atomically (temp file, fsync, os.replace)."""
    files = {name: (os.path.getsize(os.path.join(path, name)), _sha256(os.path.join(path, name)))
             for name in _data_files(path)}
    tmp = os.path.join(path, f"{MANIFEST}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump({"step": step, "files": {k: list(v) for k, v in files.items()}, "meta": meta}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, MANIFEST))
    return Manifest(path=path, step=step, files=files, meta=meta)


def _earlier(path: str) -> str:
    """The fix for a bad checkpoint: the other complete ones in the same root."""
    others = [p for p in list_checkpoints(os.path.dirname(path) or ".") if p != path and _is_complete(p)]
    if not others:
        return "there is no other complete checkpoint in that directory: start from scratch"
    return f"use an earlier one: {others} (delete this directory so that latest() skips it)"


def _read_manifest(path: str) -> Manifest:
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath) as f:
            raw = json.load(f)
        files = {str(k): (int(v[0]), str(v[1])) for k, v in raw["files"].items()}
        manifest = Manifest(path=path, step=int(raw["step"]), files=files, meta=dict(raw["meta"]))
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise CheckpointError(
            f"checkpoint {path}: {MANIFEST} is unreadable ({type(e).__name__}: {e}); {_earlier(path)}"
        ) from e
    return manifest


def verify(path: str | os.PathLike) -> Manifest:
    """Check ``path`` against its manifest (sizes, sha256, no unlisted .distcp) and return the manifest.

    Raises CheckpointError when the save did not finish (no manifest), or a file is missing, truncated,
    corrupted or unexpected. Pure file work: every file is read once to hash it.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} is not a directory; use latest(root) to find a complete one")
    if not _is_complete(path):
        raise CheckpointError(
            f"checkpoint {path} is incomplete: the writer stopped before finishing ({MANIFEST} is missing, "
            f"it is written last, once every rank's files are on disk); {_earlier(path)}"
        )
    manifest = _read_manifest(path)
    for name, (size, sha) in manifest.files.items():
        fpath = os.path.join(path, name)
        if not os.path.isfile(fpath):
            raise CheckpointError(f"checkpoint {path}: {name} is missing (listed in {MANIFEST}); {_earlier(path)}")
        actual = os.path.getsize(fpath)
        if actual < size:
            raise CheckpointError(
                f"checkpoint {path}: {name} is truncated: {actual} bytes, {MANIFEST} says {size}; {_earlier(path)}"
            )
        if actual != size:
            raise CheckpointError(
                f"checkpoint {path}: {name} is corrupted: {actual} bytes, {MANIFEST} says {size}; {_earlier(path)}"
            )
        if _sha256(fpath) != sha:
            raise CheckpointError(
                f"checkpoint {path}: {name} is corrupted: its sha256 differs from the one in {MANIFEST} "
                f"(same size, {size} bytes); {_earlier(path)}"
            )
    extra = [n for n in _data_files(path) if n.endswith(".distcp") and n not in manifest.files]
    if extra:
        raise CheckpointError(
            f"checkpoint {path}: unlisted file(s) {extra} not in {MANIFEST} (left by another save into the same "
            f"directory?); {_earlier(path)}"
        )
    return manifest


# ----------------------------------------------------------------------------------------------
# saving


def _check_state(state: Any) -> None:
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ValueError("state must be a flat dict {name: torch.Tensor or DTensor}; put other values in meta")


def _group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


class AsyncCheckpointer:
    """Saves ``{name: tensor}`` states in the background with DCP's ``async_save``, one save at a time.

    ``process_group`` is the group DCP runs its planning collectives on, from a background thread: pass a
    dedicated gloo group (``dist.new_group(backend="gloo")``) so that those never interleave with training
    collectives on the default group. By default one is created here, which is a collective: every rank
    constructs the checkpointer together. Without torch.distributed initialized it saves single-process.
    """

    def __init__(self, root: str | os.PathLike, process_group: dist.ProcessGroup | None = None, keep: int = 2):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1 (complete checkpoints kept on disk), got {keep!r}")
        self.root = os.fspath(root)
        self.keep = keep
        self._owns_group = False
        if dist.is_initialized() and process_group is None:
            process_group = dist.new_group(backend="gloo")
            self._owns_group = True
        self._group = process_group
        self._rank = _group_rank(process_group)
        if self._rank < 0:
            raise ValueError("this rank is not a member of process_group: "
                             "construct the checkpointer on its members only")
        os.makedirs(self.root, exist_ok=True)
        self._executor: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="hotswitch-checkpoint")
        self._job: Future | None = None
        self._stager = None  # pinned host buffers for GPU states, reused by every save

    def _pinned_stager(self, state: dict):
        """GPU states are staged into pinned host memory (fast device-to-host copies), kept across saves
        so that each save reuses the buffers; CPU states need no staging buffers of their own (None:
        DCP's default copy)."""
        if self._stager is None and any(t.device.type == "cuda" for t in state.values()):
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=False))
        return self._stager

    def save(self, step: int, state: dict, meta: dict | None = None) -> None:
        """Stage (copy) ``state`` and write it to ``root/step-{step:08d}/`` in the background; call on every rank.

        Returns once the tensors are copied, so the caller may update them at once. ``meta`` must be
        JSON-able (encode bytes such as RNG states with base64); it goes to the manifest, not to DCP.
        A save still running is waited for first (and its error, if any, raised here).
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        _check_state(state)
        meta = {} if meta is None else meta
        try:
            meta = json.loads(json.dumps(meta))
        except (TypeError, ValueError) as e:
            raise ValueError(f"meta must be JSON-able (base64-encode bytes such as RNG states): {e}") from e
        if self._executor is None:
            raise ValueError("this checkpointer is closed")
        self.wait()

        import torch.distributed.checkpoint as dcp

        path = _step_dir(self.root, step)
        if self._rank == 0 and os.path.isdir(path):  # a re-save of this step: manifest first, so it reads incomplete
            for name in [MANIFEST, *_data_files(path)]:  # no rank writes before rank 0 joins DCP's planning
                if os.path.exists(os.path.join(path, name)):
                    os.remove(os.path.join(path, name))
        response = dcp.async_save(state, checkpoint_id=path, process_group=self._group,
                                  no_dist=not dist.is_initialized(), async_stager=self._pinned_stager(state))
        if isinstance(response, Future):  # torch 2.13 with the default stager: staged synchronously already
            upload = response
        else:  # AsyncSaveResponse, when the stager stages in the background
            response.staging_completion.result()
            upload = response.upload_completion
        self._job = self._executor.submit(self._finish, upload, path, step, meta)

    def _finish(self, upload: Future, path: str, step: int, meta: dict) -> Manifest | None:
        """Background: wait for DCP (rank 0's future completes after every rank's files and .metadata are
        written), write the manifest and prune on rank 0, and tell every rank how that went."""
        own_error: BaseException | None = None
        manifest = None
        try:
            upload.result()
            if self._rank == 0:
                manifest = _write_manifest(path, step, meta)
                self._prune(path)
        except BaseException as e:
            own_error = e
        outcome = [None if own_error is None else f"{type(own_error).__name__}: {own_error}"]
        if self._group is not None:
            dist.broadcast_object_list(outcome, group=self._group, group_src=0)
        if own_error is not None:
            raise CheckpointError(f"checkpoint {path}: the save failed: {own_error}; the directory has no "
                                  f"{MANIFEST}, latest() skips it") from own_error
        if outcome[0] is not None:
            raise CheckpointError(f"checkpoint {path}: the save failed on rank 0: {outcome[0]}; latest() skips it")
        return manifest

    def _prune(self, written: str) -> None:
        """Keep the newest `keep` complete checkpoints (and the one just written); drop the rest, and unfinished
        saves older than every kept one."""
        paths = list_checkpoints(self.root)
        complete = [p for p in paths if _is_complete(p)]
        kept = set(complete[-self.keep:]) | {written}
        oldest_kept = min(paths.index(p) for p in kept)
        for i, p in enumerate(paths):
            if p not in kept and (_is_complete(p) or i < oldest_kept):
                shutil.rmtree(p, ignore_errors=True)

    def wait(self) -> Manifest | None:
        """Block until the save in flight, manifest included, is done on every rank. Returns rank 0's
        manifest (None on other ranks or when nothing was saved); raises CheckpointError if it failed."""
        if self._job is None:
            return None
        try:
            return self._job.result()
        except BaseException:
            self._job = None  # reported once
            raise

    def abandon(self) -> None:
        """After a failure: drop the save in flight without waiting (its collectives may be waiting on a
        dead peer). If it never completes, its directory has no manifest and `latest()` skips it."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        self._job = None

    @property
    def pending(self) -> bool:
        """Whether a save is still being written."""
        return self._job is not None and not self._job.done()

    def close(self) -> None:
        """Wait for the save in flight, then release the thread and the group made here."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._owns_group and dist.is_initialized():
                dist.destroy_process_group(self._group)
                self._owns_group = False


# ----------------------------------------------------------------------------------------------
# loading


def _check_keys(path: str, state: dict) -> None:
    """Every key of ``state`` must be a tensor of the same global shape in the checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    missing = sorted(k for k in state if k not in saved)
    if missing:
        raise CheckpointError(f"checkpoint {path}: .metadata has no entries {missing} that the state to load "
                              f"has; it holds {sorted(saved)}: load a checkpoint of this model, or drop those keys")
    wrong = {k: (tuple(state[k].shape), tuple(saved[k].size) if isinstance(saved[k], TensorStorageMetadata) else None)
             for k in sorted(state)}
    wrong = {k: v for k, v in wrong.items() if v[0] != v[1]}
    if wrong:
        raise CheckpointError(f"checkpoint {path}: global shapes differ (state, checkpoint): {wrong}; "
                              "load a checkpoint of this model")


def load(path: str | os.PathLike, state: dict, process_group: dist.ProcessGroup | None = None) -> Manifest:
    """Verify ``path`` and load it into the tensors / DTensors of ``state`` in place, resharding to their layout.

    Rank 0 of ``process_group`` (default: the default group) verifies the files and the keys, then tells
    every rank, so all raise the same CheckpointError and nothing is loaded when the checkpoint is bad.
    Works single-process when torch.distributed is not initialized. Returns the manifest (step, meta).
    """
    path = os.fspath(path)
    _check_state(state)
    distributed = dist.is_initialized()
    rank = _group_rank(process_group)
    outcome: list[Any] = [None, None]  # error message, manifest fields
    if rank == 0:
        try:
            m = verify(path)
            _check_keys(path, state)
            outcome[1] = (m.step, m.files, m.meta)
        except CheckpointError as e:
            outcome[0] = str(e)
        except Exception as e:  # reported to every rank too, so that none is left waiting in the broadcast
            outcome[0] = f"checkpoint {path}: cannot be read ({type(e).__name__}: {e}); {_earlier(path)}"
    if distributed:
        dist.broadcast_object_list(outcome, group=process_group, group_src=0)
    if outcome[0] is not None:
        raise CheckpointError(outcome[0])

    import torch.distributed.checkpoint as dcp

    dcp.load(state, checkpoint_id=path, process_group=process_group, no_dist=not distributed)
    step, files, meta = outcome[1]
    return Manifest(path=path, step=step, files=files, meta=meta)
