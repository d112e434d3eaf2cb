"""Faults a real cluster has, on 4 spawned gloo workers under the elastic agent (one job, run once):

1. w3 is SIGKILLed while it compiles its second profiling probe of step 0 (dp4 and dp2tp2 are
   profiled): the others must notice through the store at their next probe's barrier
   (MembershipChanged), not after the 10-minute timeout that collectives have while ranks compile;
2. w2 is SIGKILLed while the state moves to the 3 survivors (generation 1): the change begins again
   towards generation 2 (w0, w1) from the state held before it, never from a half-applied move;
3. w1 is SIGSTOPped in a later step, before the step commits: its heartbeat stops, its agent kills it (fencing)
   and w0 finishes the job alone.

At the end the weights equal single-device AdamW on the same global batches, and every batch was
committed exactly once.
"""
from __future__ import annotations

import os
import signal
import sys

import pytest
import torch

from hotswitch.distconfig import DistConfig
from tests.elastic_hosts import ADAMW_TOLERANCE
from tests.test_trainer_world4 import LR, _reference_steps

pytestmark = pytest.mark.slow  # spawns gloo processes and compiles

STEPS, BATCH, TIMEOUT_S = 4, 8, 5.0


def configs(n: int) -> list[DistConfig]:
    """Two configs on 4 workers (so step 0 profiles them), pure DP on fewer."""
    return [DistConfig("dp4", dp=4), DistConfig("dp2tp2", dp=2, tp=2)] if n == 4 else [DistConfig(f"dp{n}", dp=n)]


def _data():
    from hotswitch.train import data as D

    return D.synthetic_skewed(64, 1001, 64, seed=0), D.SampleOrder(64, BATCH, seed=0)


def _build():
    from hotswitch.models import build_model

    torch.manual_seed(0)
    return build_model("gpt-tiny")


def _worker(membership, checkpoint_dir):
    import warnings

    from hotswitch.elastic import ElasticJob
    from hotswitch.elastic import job as job_module
    from hotswitch.train.trainer import Trainer

    warnings.filterwarnings("ignore")
    wid, pid = membership.wid, os.getpid()
    if wid == "w3":  # 1. dies as it starts compiling its second probe
        probe, calls = Trainer._probe, []

        def dying_probe(self, config, length):
            calls.append(config.name)
            if len(calls) == 2:
                os.kill(pid, signal.SIGKILL)
            return probe(self, config, length)

        Trainer._probe = dying_probe
    if wid == "w2":  # 2. dies in the state move towards generation 1
        execute = job_module.execute_plan

        def dying_execute(*args, **kwargs):
            if membership.generation == 1:
                os.kill(pid, signal.SIGKILL)
            return execute(*args, **kwargs)

        job_module.execute_plan = dying_execute
    dataset, order = _data()

    if wid == "w1":  # 3. stops in step 2, its collectives done, before the step is committed
        on_phase = ElasticJob._on_phase

        def stopping_on_phase(self, phase, step):
            if (phase, step, membership.generation) == ("update", 2, 2):
                os.kill(pid, signal.SIGSTOP)
            return on_phase(self, phase, step)

        ElasticJob._on_phase = stopping_on_phase

    def batch(step):
        ids = order.batch(step)
        return ids, [dataset[i] for i in ids]

    job = ElasticJob(membership, _build, configs, batch, trainer_options=dict(optimizer=dict(name="adamw", lr=LR),
                                                                             buckets=(64,)),
                     checkpoint_dir=checkpoint_dir, checkpoint_every=2, step_timeout_s=TIMEOUT_S,
                     log=lambda m: print(m, file=sys.stderr, flush=True))  # shown when a test fails
    result = job.run(STEPS)
    final = job.trainer.full_job_state() if job.trainer is not None else None
    if result is not None:
        result.update(final=final)
    return result


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    from hotswitch.elastic.membership import run_elastic
    from tests.elastic_hosts import workers_aborted_after

    log: list[str] = []
    try:
        with workers_aborted_after():
            result = run_elastic(_worker, 4, str(tmp_path_factory.mktemp("ckpt")), min_size=1, max_size=4,
                                 log=log.append, heartbeat_timeout_s=TIMEOUT_S)
    except BaseException:
        print("the agent's log:", *log, sep="\n", file=sys.stderr)
        raise
    return result, log


def test_each_fault_is_survived_from_what_is_consistent(faults):
    result, log = faults
    assert result["steps"] == STEPS and result["workers"] == ["w0"] and result["configs"] == ["dp1"]
    changes = [(c["generation"], c["reason"], c["source"], c["destination"], c["restored_from"], c["interrupted"])
               for c in result["reconfigurations"]]
    # generation 1 (w3 lost) was cut short by w2's death: generation 2 moved the state w0..w3 held
    # under dp2tp2 (w0, w1 hold one replica whole), then w1 was fenced out (generation 3)
    assert changes == [(2, "failure", "dp2tp2 on 4", "dp2 on 2", "survivors", (1,)),
                       (3, "failure", "dp2 on 2", "dp1 on 1", "survivors", ())]
    assert [line for line in log if "generation" in line] == [
        "[elastic] generation 1 (failure): job 3 workers ['w0', 'w1', 'w2'], lost ['w3']",
        "[elastic] generation 2 (failure): job 2 workers ['w0', 'w1'], lost ['w2']",
        "[elastic] generation 3 (failure): job 1 workers ['w0'], lost ['w1']",
    ]


def test_a_worker_lost_while_the_others_compile_is_noticed_through_the_store(faults):
    result, _ = faults
    first = result["reconfigurations"][0]
    # the survivors were compiling or at a probe's barrier: the store told them, no collective timed out
    assert first["noticed_by"] == "MembershipChanged"


def test_a_stopped_worker_is_fenced_out_by_its_agent(faults):
    result, log = faults
    (fenced,) = [line for line in log if "heartbeat" in line]
    assert fenced.startswith("[elastic] worker w1 sent no heartbeat for ") and "fenced out with SIGKILL" in fenced
    seconds = float(fenced.split(" for ")[1].split(" s ")[0])
    assert seconds >= TIMEOUT_S  # never earlier than its timeout
    assert "[elastic] worker w1 died (exit code -9 = signal 9)" in log  # killed while stopped


def test_weights_equal_single_device_adamw_and_each_batch_ran_once(faults):
    result, _ = faults
    dataset, order = _data()
    batches = [[dataset[i] for i in order.batch(step)] for step in range(STEPS)]
    *_, (_, _, reference) = _reference_steps(_build(), batches)
    final = {k.removeprefix("param:model."): v for k, v in result["final"].items() if k.startswith("param:")}
    assert final.keys() == reference.keys()
    worst = max(float((final[k] - reference[k]).norm() / reference[k].norm()) for k in reference)
    assert worst < ADAMW_TOLERANCE, worst  # the state crossed dp2tp2, dp2 and dp1
    assert result["samples"] == {step: order.batch(step) for step in range(STEPS)}
