"""Asynchronous DCP checkpoints with a manifest: resharding loads, async staging, retention, and bad files
that fail loudly on every rank. The 2-rank checks share one spawn; the file-level tests run in this process."""
import base64
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor

from hotswitch.elastic.checkpoint import AsyncCheckpointer, CheckpointError, latest, list_checkpoints, load, verify
from tests.distributed import dist_fixture

# One directory for the whole module, shared by the parent and the workers (they read it from the env).
ROOT = os.environ.get("HS_CHECKPOINT_TEST_ROOT") or tempfile.mkdtemp(prefix="hotswitch-checkpoint-test-")
SHAPES = {"w": (5, 3), "m": (8, 4), "b": (7,)}  # 5x3: uneven over 2 ranks; b: 1-D


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {k: torch.randn(shape, generator=g) for k, shape in SHAPES.items()}


def _mesh() -> DeviceMesh:
    return DeviceMesh("cpu", [0, 1])


def _dtensors(full, placement_for) -> dict:
    mesh = _mesh()
    return {k: distribute_tensor(v, mesh, [placement_for(v)]) for k, v in full.items()}


def _zeros_like(state) -> dict:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def _bump_(state, by=1000.0) -> None:
    with torch.no_grad():
        for v in state.values():
            v.to_local().add_(by)


def _error(fn) -> str:
    try:
        fn()
    except CheckpointError as e:
        return str(e)
    raise AssertionError("no CheckpointError raised")


# ----------------------------------------------------------------------------------------------
# 2-rank checks


def check_reshard_and_async():
    """Save Shard(0), mutate right after save() returns, load as Shard(1) and Replicate."""
    full = _full()
    src = _dtensors(full, lambda v: Shard(0))
    ck = AsyncCheckpointer(os.path.join(ROOT, "reshard"))
    rng = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
    meta = {"step": 3, "configs": ["dp2", "tp2"], "rng": rng}
    ck.save(3, src, meta)
    _bump_(src)  # the checkpoint must hold the values from before this
    assert all(torch.equal(src[k].full_tensor(), full[k] + 1000.0) for k in full)
    manifest = ck.wait()
    ck.close()
    assert (manifest is not None) == (dist.get_rank() == 0)

    path = latest(os.path.join(ROOT, "reshard"))
    by_shard1 = _zeros_like(_dtensors(full, lambda v: Shard(1) if v.dim() == 2 else Shard(0)))
    got = load(path, by_shard1)
    assert got.step == 3 and got.meta == meta
    replicated = _zeros_like(_dtensors(full, lambda v: Replicate()))
    load(path, replicated)
    return {
        "shard1": {k: torch.equal(v.full_tensor(), full[k]) for k, v in by_shard1.items()},
        "shard1_placements": {k: str(v.placements) for k, v in by_shard1.items()},
        "replicate": {k: torch.equal(v.to_local(), full[k]) for k, v in replicated.items()},
        "step": got.step,
        "meta": got.meta,
        "manifest_files": None if manifest is None else sorted(manifest.files),
        "path": path,
    }


def check_keep_and_latest():
    root = os.path.join(ROOT, "keep")
    if dist.get_rank() == 0:  # unfinished saves: one older than every kept checkpoint, one newer
        for step in (0, 9):
            os.makedirs(os.path.join(root, f"step-{step:08d}"))
            open(os.path.join(root, f"step-{step:08d}", "__0_0.distcp"), "wb").close()
    dist.barrier()
    state = _dtensors(_full(), lambda v: Shard(0))
    ck = AsyncCheckpointer(root, process_group=dist.new_group(backend="gloo"), keep=2)
    manifests = []
    for step in (1, 2, 3):
        _bump_(state, 1.0)
        ck.save(step, state, {"step": step})  # waits for the previous save first
        manifests.append(ck.wait())
    ck.close()
    assert not ck.pending
    dist.barrier()
    names = [os.path.basename(p) for p in list_checkpoints(root)]
    newest = os.path.basename(latest(root))
    m = verify(latest(root))
    into = _zeros_like(state)
    load(latest(root), into)
    return {"names": names, "latest": newest, "step": m.step, "meta": m.meta,
            "loaded_equal": all(torch.equal(into[k].full_tensor(), state[k].full_tensor()) for k in state),
            "wait_steps": [None if x is None else x.step for x in manifests]}


def _bad_copy(kind: str, step: int) -> str:
    """A copy of the good step-5 checkpoint as a newer step, damaged by rank 0; all ranks return after a barrier."""
    good = os.path.join(ROOT, "bad", "step-00000005")
    path = os.path.join(ROOT, "bad", f"step-{step:08d}")
    if dist.get_rank() == 0:
        shutil.copytree(good, path)
        if kind == "truncated":
            f = os.path.join(path, "__1_0.distcp")
            os.truncate(f, os.path.getsize(f) - 10)
        elif kind == "flipped":
            with open(os.path.join(path, "__0_0.distcp"), "r+b") as f:
                f.seek(os.path.getsize(f.name) // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
        elif kind == "incomplete":
            os.remove(os.path.join(path, "manifest.json"))
    dist.barrier()
    return path


def check_bad_files_raise_everywhere():
    full = _full()
    ck = AsyncCheckpointer(os.path.join(ROOT, "bad"))
    ck.save(5, _dtensors(full, lambda v: Shard(0)), {"step": 5})
    ck.close()
    out = {}
    for step, kind in enumerate(("truncated", "flipped", "incomplete"), start=6):
        path = _bad_copy(kind, step)
        into = _zeros_like(_dtensors(full, lambda v: Replicate()))
        out[kind] = _error(lambda: load(path, into))
        assert all(torch.count_nonzero(v.to_local()) == 0 for v in into.values()), f"{kind}: something was loaded"
    into = _zeros_like(_dtensors(full, lambda v: Shard(0)))
    into["opt.exp_avg.w"] = distribute_tensor(torch.zeros(5, 3), _mesh(), [Shard(0)])
    out["missing_key"] = _error(lambda: load(os.path.join(ROOT, "bad", "step-00000005"), into))
    assert all(torch.count_nonzero(v.to_local()) == 0 for v in into.values())
    return out


results = dist_fixture(2, [check_reshard_and_async, check_keep_and_latest, check_bad_files_raise_everywhere],
                       env={"HS_CHECKPOINT_TEST_ROOT": ROOT}, timeout=180)


@pytest.fixture(scope="module", autouse=True)
def _remove_root():
    yield
    shutil.rmtree(ROOT, ignore_errors=True)


def test_reshard_shard0_to_shard1_and_replicate(results):
    for r in results["check_reshard_and_async"].raise_if_failed():
        assert r["shard1"] == {"w": True, "m": True, "b": True}, r
        assert r["shard1_placements"]["w"] == "(Shard(dim=1),)", r
        assert r["replicate"] == {"w": True, "m": True, "b": True}, r


def test_manifest_round_trips_step_and_meta(results):
    r0, r1 = results["check_reshard_and_async"].raise_if_failed()
    assert r0["step"] == r1["step"] == 3
    assert r0["meta"] == r1["meta"] and r0["meta"]["configs"] == ["dp2", "tp2"]
    assert base64.b64decode(r0["meta"]["rng"]) == torch.manual_seed(0).get_state().numpy().tobytes()
    assert r0["manifest_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"] and r1["manifest_files"] is None


def test_load_into_another_world_size(results):
    """The 2-rank checkpoint into plain tensors in this (non-distributed) process."""
    (r0, _) = results["check_reshard_and_async"].raise_if_failed()
    assert not dist.is_initialized()
    full = _full()
    into = {k: torch.zeros_like(v) for k, v in full.items()}
    assert load(r0["path"], into).step == 3
    assert all(torch.equal(into[k], full[k]) for k in full)


def test_keep_and_latest(results):
    for r in results["check_keep_and_latest"].raise_if_failed():
        # step 1 pruned (keep=2), the unfinished step 0 (older than every kept one) too; unfinished step 9 stays
        assert r["names"] == ["step-00000002", "step-00000003", "step-00000009"], r
        assert r["latest"] == "step-00000003" and r["step"] == 3 and r["meta"] == {"step": 3}, r
        assert r["loaded_equal"], r
    r0, r1 = results["check_keep_and_latest"].values
    assert r0["wait_steps"] == [1, 2, 3] and r1["wait_steps"] == [None, None, None]


def test_bad_checkpoint_raises_on_every_rank(results):
    for r in results["check_bad_files_raise_everywhere"].raise_if_failed():
        assert "truncated" in r["truncated"] and "__1_0.distcp" in r["truncated"], r["truncated"]
        assert "corrupted" in r["flipped"] and "__0_0.distcp" in r["flipped"], r["flipped"]
        assert "incomplete" in r["incomplete"] and "manifest.json" in r["incomplete"], r["incomplete"]
        assert "step-00000008 is incomplete" in r["incomplete"], r["incomplete"]
        assert "use an earlier one: [" in r["incomplete"] and "step-00000005'" in r["incomplete"], r["incomplete"]
        assert "opt.exp_avg.w" in r["missing_key"], r["missing_key"]


# ----------------------------------------------------------------------------------------------
# single process: file-level checks


@pytest.fixture(scope="module")
def one_checkpoint(tmp_path_factory) -> str:
    """A complete single-process checkpoint at step 7, made once."""
    root = tmp_path_factory.mktemp("single")
    ck = AsyncCheckpointer(root)
    ck.save(7, _full(), {"step": 7})
    m = ck.wait()
    ck.close()
    assert m is not None and m.step == 7
    return m.path


def _damaged(one_checkpoint, tmp_path, damage) -> str:
    path = str(tmp_path / "root" / os.path.basename(one_checkpoint))
    shutil.copytree(one_checkpoint, path)
    damage(path)
    return path


def test_verify_good(one_checkpoint):
    m = verify(one_checkpoint)
    assert m.step == 7 and m.meta == {"step": 7} and set(m.files) == {".metadata", "__0_0.distcp"}
    assert m.files["__0_0.distcp"][0] == os.path.getsize(os.path.join(one_checkpoint, "__0_0.distcp"))


@pytest.mark.parametrize("damage, words", [
    (lambda p: os.truncate(os.path.join(p, "__0_0.distcp"), 100), ["truncated", "__0_0.distcp", "100 bytes"]),
    (lambda p: open(os.path.join(p, "__0_0.distcp"), "ab").write(b"x"), ["corrupted", "__0_0.distcp"]),
    (lambda p: os.remove(os.path.join(p, ".metadata")), ["missing", ".metadata"]),
    (lambda p: open(os.path.join(p, "manifest.json"), "w").write("{not json"), ["unreadable", "manifest.json"]),
    (lambda p: open(os.path.join(p, "__3_0.distcp"), "wb").close(), ["unlisted", "__3_0.distcp"]),
    (lambda p: os.remove(os.path.join(p, "manifest.json")), ["incomplete", "no other complete checkpoint"]),
], ids=["truncated", "grown", "missing", "unreadable", "extra", "incomplete"])
def test_verify_names_the_problem(one_checkpoint, tmp_path, damage, words):
    path = _damaged(one_checkpoint, tmp_path, damage)
    msg = _error(lambda: verify(path))
    assert path in msg and all(w in msg for w in words), msg
    into = {k: torch.zeros_like(v) for k, v in _full().items()}
    assert _error(lambda: load(path, into)) == msg
    assert all(torch.count_nonzero(v) == 0 for v in into.values())


def test_shape_mismatch(one_checkpoint):
    into = {k: torch.zeros_like(v) for k, v in _full().items()}
    into["w"] = torch.zeros(3, 5)
    msg = _error(lambda: load(one_checkpoint, into))
    assert "'w': ((3, 5), (5, 3))" in msg, msg


def test_list_and_latest(tmp_path):
    for name in ("step-00000010", "step-00000002", "step-100000000", "notes", "step-3x"):
        (tmp_path / name).mkdir()
    (tmp_path / "step-00000002" / "manifest.json").write_text("{}")
    names = [os.path.basename(p) for p in list_checkpoints(tmp_path)]
    assert names == ["step-00000002", "step-00000010", "step-100000000"]
    assert os.path.basename(latest(tmp_path)) == "step-00000002"  # the others have no manifest
    assert latest(tmp_path / "nowhere") is None and list_checkpoints(tmp_path / "nowhere") == []


def test_caller_mistakes(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        AsyncCheckpointer(tmp_path, keep=0)
    ck = AsyncCheckpointer(tmp_path)
    with pytest.raises(ValueError, match="JSON"):
        ck.save(1, {"w": torch.ones(2)}, {"rng": b"\x00"})
    with pytest.raises(ValueError, match="flat dict"):
        ck.save(1, {"w": torch.ones(2), "step": 1})
    assert ck.wait() is None and not ck.pending
    ck.close()
    assert list_checkpoints(tmp_path) == []
