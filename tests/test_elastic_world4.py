"""Elastic training on real spawned workers (gloo): a SIGKILLed worker, planned scale-out and
scale-in with a change of tensor-parallel degree, and a redeployment.

Three jobs run once for the module (the agent, `run_elastic`, runs in the pytest process):
- "failure": 4 workers under tp4; worker w2 SIGKILLs itself in the middle of step 2. Its TP
  shards have no replica, so the state comes from the step-2 checkpoint (async DCP) and the job
  goes on with 3 workers under fsdp3-full;
- "reference": the same job with a planned scale-in 4 -> 3 before step 2, no failure;
- "scaling": 2 workers under tp2 -> 4 workers under tp4 (step 1) -> 2 workers under tp2
  (step 2) -> redeployed to 2 new workers (step 3); the full job state is gathered before and after
  every change. Its model is built on the meta device: the start initializes each worker's shards
  (`weights=init_fn`), and the workers of later generations read no weights, only the moved state.
"""
from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from hotswitch.distconfig import DistConfig

pytestmark = pytest.mark.slow  # spawns gloo processes and compiles; `-m 'not slow'` leaves it out

STEPS = 4
BATCH = 8


def tp_on_four(n: int) -> list[DistConfig]:
    """tp4 on 4 workers, fsdp with full recomputation on any other count (one config each: no
    profiling; no SP: its lowering costs suite time, and SP changes nothing in the state that moves).
    fsdp3's shards are uneven: the state moves into a layout the planner and the checkpoint split by
    torch.chunk's sizes."""
    return [DistConfig("tp4", tp=4)] if n == 4 else [DistConfig.parse(f"fsdp{n}-full")]


def tp_everywhere(n: int) -> list[DistConfig]:
    return [DistConfig(f"tp{n}", tp=n)] if n in (2, 4) else []


def _test_log(message: str) -> None:
    """With HOTSWITCH_TEST_LOGS=FILE, the agent's and the workers' elastic log lines go to FILE (appended,
    one line each, with the time and pid): what a failure's diagnosis needs. Otherwise nothing."""
    import time

    path = os.environ.get("HOTSWITCH_TEST_LOGS")
    if path:
        with open(path, "a") as f:
            f.write(f"{time.time():.3f} pid {os.getpid()} {message}\n")


def _build():
    from hotswitch.models import build_model

    torch.manual_seed(0)
    return build_model("gpt-tiny")


def _build_meta():
    from hotswitch.models import build_model

    torch.manual_seed(0)  # the same random numbers on every worker for the start's initialization
    with torch.device("meta"):
        return build_model("gpt-tiny")


def _init(module):
    """GPT's own initialization, and its norms' ones (their constructor's, which meta skips)."""
    from hotswitch.models import GPT, Norm

    GPT._init(module)
    if isinstance(module, Norm):
        torch.nn.init.ones_(module.weight)


def _worker(membership, rule, events, kill, checkpoint_dir, snapshot_dir, meta=False):
    """One elastic worker; returns (on the finished job's rank 0) the job's result and final state.
    Around each planned change the job's rank 0 saves the full job state to `snapshot_dir`."""
    import warnings

    from hotswitch.elastic import ElasticJob, Event
    from hotswitch.train import data as D

    warnings.filterwarnings("ignore")
    dataset = D.synthetic_skewed(64, 1001, 64, seed=0)
    order = D.SampleOrder(len(dataset), BATCH, seed=0)

    def batch(step):
        if kill is not None and (membership.wid, step) == kill:  # die in the middle of this step
            _wait_for_checkpoint(checkpoint_dir, step)
            _test_log(f"[{membership.wid}] dies in 0.15 s; latest complete checkpoint: {_latest(checkpoint_dir)}")
            threading.Timer(0.15, os.kill, (os.getpid(), signal.SIGKILL)).start()
        ids = order.batch(step)
        return ids, [dataset[i] for i in ids]

    def on_change(when, job):
        full = job.trainer.full_job_state()
        if job.job_rank == 0:  # "before" in generation g, "after" in g + 1: change number g + 1
            change = membership.generation + (1 if when == "before" else 0)
            torch.save((job.trainer.base, full), os.path.join(snapshot_dir, f"{change}-{when}.pt"))

    job = ElasticJob(membership, _build_meta if meta else _build, rule, batch,
                     trainer_options=dict(optimizer=dict(name="adamw", lr=1e-2), buckets=(64,)),
                     checkpoint_dir=checkpoint_dir, checkpoint_every=2, step_timeout_s=3, on_change=on_change,
                     log=_test_log, weights=_init if meta else None)
    result = job.run(STEPS, [Event(*e) for e in events])
    final = job.trainer.full_job_state() if job.trainer is not None else None
    if result is not None:
        result.update(final=final)
    return result


def _latest(directory: str) -> str | None:
    from hotswitch.elastic import checkpoint as ckpt

    latest = ckpt.latest(directory)  # complete ones only
    return None if latest is None else os.path.basename(latest)


def _wait_for_checkpoint(directory: str, step: int) -> None:
    """Block until the asynchronous checkpoint of `step` is complete (manifest written), so that the
    test's failure finds it whatever the machine's load: the save runs in background threads, which
    this wait does not hold up. Bounded by the elastic tests' deadline (HOTSWITCH_TEST_TIMEOUT_SCALE)."""
    import time

    from tests.elastic_hosts import DEADLINE_S

    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        latest = _latest(directory)  # named step-<step>
        if latest is not None and int(latest.rpartition("-")[2]) >= step:
            return
        time.sleep(0.05)
    raise TimeoutError(f"the checkpoint of step {step} in {directory} was not complete after the deadline")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from hotswitch.elastic.membership import run_elastic
    from tests.elastic_hosts import workers_aborted_after

    out = {}
    for name, world, rule, events, kill, meta in [
        ("failure", 4, tp_on_four, [], ("w2", 2), False),
        ("reference", 4, tp_on_four, [(2, "scale", 3)], None, False),
        ("scaling", 2, tp_everywhere, [(1, "scale", 4), (2, "scale", 2), (3, "redeploy")], None, True),
    ]:
        ckpt, snaps = tmp_path_factory.mktemp(name), tmp_path_factory.mktemp(f"{name}-states")
        log: list[str] = []

        def agent_log(message: str, log=log) -> None:
            log.append(message)
            _test_log(message)

        with workers_aborted_after():
            out[name] = run_elastic(_worker, world, rule, events, kill, str(ckpt), str(snaps), meta, min_size=2,
                                    max_size=4, log=agent_log)
        out[name]["log"] = log
        out[name]["snapshots"] = {f.stem: torch.load(f) for f in snaps.glob("*.pt")}
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_sigkill_mid_step_goes_on_with_three_workers_from_checkpoint(runs):
    failure = runs["failure"]
    assert failure["steps"] == STEPS
    assert failure["workers"] == ["w0", "w1", "w3"] and failure["configs"] == ["fsdp3-full"]
    assert "[elastic] worker w2 died (exit code -9 = signal 9)" in failure["log"], failure["log"]  # the test's kill
    (change,) = failure["reconfigurations"]
    assert change["reason"] == "failure" and change["source"] == "tp4 on 4"
    assert change["destination"] == "fsdp3-full on 3"
    # w2's TP shards had no replica: the whole state came from the step-2 checkpoint. The killed step
    # (index 2) was never committed, so nothing is replayed beyond it.
    assert change["lost_tensors"] > 0 and change["restored_from"] == "checkpoint step 2", failure["log"]
    assert change["step"] == 2 and change["replayed_steps"] == 0


def test_failure_matches_a_planned_scale_in_at_the_same_step(runs):
    failure, reference = runs["failure"], runs["reference"]
    (change,) = reference["reconfigurations"]
    assert change["reason"] == "scale" and change["restored_from"] == "survivors" and change["bytes_moved"] > 0
    assert reference["configs"] == ["fsdp3-full"]
    worst = max(_rel(failure["final"][k], reference["final"][k]) for k in reference["final"] if k.startswith("param:"))
    assert worst < 1e-4, worst
    worst_moments = max(_rel(failure["final"][k], reference["final"][k]) for k in reference["final"]
                        if k.startswith("exp_avg_sq:"))
    assert worst_moments < 1e-3, worst_moments
    # the weights did train: a run that lost a step (or replayed one twice) would be far off
    _, before = reference["snapshots"]["1-before"]
    assert max(_rel(reference["final"][k], before[k]) for k in before if k.startswith("param:")) > 1e-3


def test_samples_are_the_same_and_none_skipped_or_repeated(runs):
    from hotswitch.train import data as D

    failure, reference = runs["failure"], runs["reference"]
    assert failure["samples"] == reference["samples"]
    order = D.SampleOrder(64, BATCH, seed=0)
    assert failure["samples"] == {step: order.batch(step) for step in range(STEPS)}
    seen = [i for step in range(STEPS) for i in failure["samples"][step]]
    assert len(seen) == len(set(seen)) == STEPS * BATCH  # one epoch is 64 samples: no repeats expected


def test_scale_out_and_in_with_tp_change_are_bit_identical(runs):
    scaling = runs["scaling"]
    assert scaling["steps"] == STEPS
    kinds = [(c["reason"], c["source"], c["destination"]) for c in scaling["reconfigurations"]]
    assert kinds == [("scale", "tp2 on 2", "tp4 on 4"), ("scale", "tp4 on 4", "tp2 on 2"),
                     ("redeploy", "tp2 on 2", "tp2 on 2")]
    snaps = scaling["snapshots"]
    assert sorted(snaps) == ["1-after", "1-before", "2-after", "2-before", "3-after", "3-before"]
    assert [snaps[f"{g}-{w}"][0] for g in (1, 2, 3) for w in ("before", "after")] == \
        ["tp2", "tp4", "tp4", "tp2", "tp2", "tp2"]
    for g in (1, 2, 3):
        (_, before), (_, after) = snaps[f"{g}-before"], snaps[f"{g}-after"]
        assert before.keys() == after.keys() and len(before) > 30
        for k in before:  # weights and both AdamW moments, exactly
            assert torch.equal(before[k], after[k]), (g, k)
        assert all(before[k].abs().sum() > 0 for k in before if k.startswith("exp_avg_sq:"))  # trained state
    assert all(c["restored_from"] == "survivors" for c in scaling["reconfigurations"])
    # the redeployment moved the job onto two workers spawned for it
    assert scaling["workers"] == ["w4", "w5"]
