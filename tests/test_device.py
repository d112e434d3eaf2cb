"""The GPU path's logic where it runs on CPU too: which device and backend a process uses, the NCCL
failure watcher, one rank profiled with a fake process group, `hotswitch bench gpu --dry-run`."""
import functools
import threading

import pytest
import torch
import torch.distributed as dist

from hotswitch.distributed import device as D
from hotswitch.elastic.membership import Membership
from hotswitch.models import build_model


def test_backend_and_device_follow_the_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert D.default_backend(4) == "gloo"
    assert D.device_for_backend("gloo") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="needs CUDA.*backend='gloo'"):
        D.device_for_backend("nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert D.default_backend(2) == "nccl"
    assert D.default_backend(4) == "gloo"  # fewer GPUs than processes on the node: CPU
    assert D.device_for_backend("nccl", local_rank=1) == torch.device("cuda", 1)
    assert D.device_for_backend("cpu:gloo,cuda:nccl", local_rank=0) == torch.device("cuda", 0)


def test_runtime_device_and_override(monkeypatch):
    monkeypatch.delenv("HOTSWITCH_DEVICE", raising=False)
    assert not dist.is_initialized()
    assert D.runtime_device() == torch.device("cpu")
    monkeypatch.setenv("HOTSWITCH_DEVICE", "meta")
    assert D.runtime_device() == torch.device("meta")
    t = D.comm_tensor([1.0, 2.0], torch.float64)  # the group's device, whatever the override says
    assert t.device == torch.device("cpu") and t.tolist() == [1.0, 2.0]


def test_launch_refuses_nccl_without_enough_gpus():
    from hotswitch.distributed.launch import launch

    with pytest.raises(ValueError, match="need 64 GPUs and it has .*backend='gloo'"):
        launch(print, 64, backend="nccl")


# ------------------------------------------------------------------ elastic: NCCL aborts a blocked step


def test_nccl_watch_aborts_when_a_newer_generation_is_published():
    store = dist.HashStore()
    membership = Membership("w0", store, 1, 2, backend="nccl")
    aborted = threading.Event()
    with membership.watch_peers(abort=aborted.set, poll_s=0.01):
        assert not aborted.wait(0.1)  # nothing published: the step goes on
        store.set("elastic/gen/0", "{}")  # the agent saw a worker die
        assert aborted.wait(60)


def test_gloo_does_not_watch():
    """gloo cannot abort a blocked operation: the step timeout detects the dead peer instead."""
    store = dist.HashStore()
    membership = Membership("w0", store, 1, 2, backend="gloo")
    store.set("elastic/gen/0", "{}")
    calls = []
    with membership.watch_peers(abort=lambda: calls.append(1), poll_s=0.01):
        assert not any(t.name.startswith("hotswitch-peer-watch") for t in threading.enumerate())
    assert calls == []


# ------------------------------------------------------------------ one rank, fake process group


def test_profile_rank_with_a_fake_process_group():
    from hotswitch.runtime.profile import profile_rank

    x = torch.randint(0, 1001, (4, 32))
    p = profile_rank(functools.partial(build_model, "gpt-tiny"), (x, x), "dp2tp2sp", rank=3, repeats=2, device="cpu")
    assert (p.config, p.rank, p.world_size, p.device) == ("dp2tp2sp", 3, 4, "cpu")
    assert p.local_shapes == ((2, 32), (2, 32))  # dp=2 splits the batch; tp ranks see their replica's rows
    assert p.seconds > 0 and p.tokens == 64
    n_params = sum(q.numel() for q in build_model("gpt-tiny").parameters())
    assert p.flops == pytest.approx(6 * n_params * 64 / 2)
    assert p.peak_bytes is None  # measured on CUDA only
    resident = 4 * n_params / 2  # at least this rank's half of the weights
    assert p.estimated_peak_bytes > resident
    with pytest.raises(ValueError, match="rank 4 is not a rank of 'dp2tp2'"):
        profile_rank(functools.partial(build_model, "gpt-tiny"), (x, x), "dp2tp2", rank=4)


# ------------------------------------------------------------------ bench gpu


@pytest.fixture
def hotswitch(monkeypatch, capsys):
    """`hotswitch ARGS` in this process, as on a machine without a GPU: (exit code, stdout, stderr)."""
    from hotswitch.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def run(*args):
        code = main(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def test_bench_gpu_dry_run_checks_and_exits_without_a_gpu(hotswitch):
    code, out, err = hotswitch("bench", "gpu", "--dry-run")
    assert code == 0, err
    assert "1.1" in out and "B parameters" in out  # the ~1B Llama, counted on the meta device
    assert "dp8, tp8, dp2tp4" in out and "no CUDA GPU" in out and "nothing measured" in out


def test_bench_gpu_names_the_problem(hotswitch):
    code, _, err = hotswitch("bench", "gpu", "--dry-run", "--configs", "dp8;tp3")
    assert code != 0 and "one world size" in err
    code, _, err = hotswitch("bench", "gpu", "--dry-run", "--configs", "tp64")
    assert code != 0 and "tp=64 does not divide the model's 32 attention heads" in err
    code, out, _ = hotswitch("bench", "gpu")
    assert code == 2 and "needs a CUDA GPU" in out and "--dry-run" in out
