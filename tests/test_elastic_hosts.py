"""Elastic training across hosts: each "host" is an agent process of its own (2 gloo workers each)
meeting the others through torch's c10d rendezvous, served by `hotswitch rendezvous` in a process
apart; all on this machine's loopback.

Agents a0 and a1 start the job (dp4). After step 3 the test SIGKILLs one agent: its workers die with
it (parent-death signal), the other agent notices its heartbeat stop and the job goes on with 2
workers from the survivors' state. A third agent started then joins as a scale-out (back to dp4).
At step 5 every worker waits for that scale-out (a gate in the test's batch function), so the
sequence does not depend on how fast this machine is. The final weights equal single-device
AdamW on the same global batches.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from hotswitch.distconfig import DistConfig
from tests.test_trainer_world4 import LR, _reference_steps

pytestmark = pytest.mark.slow  # spawns 3 agents and 6 workers

STEPS, BATCH, NPROC, GATE = 8, 8, 2, 5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEADLINE_S = 300 * float(os.environ.get("HOTSWITCH_TEST_TIMEOUT_SCALE", "1"))  # a hang fails, never a slow run


def configs(n: int) -> list[DistConfig]:
    return [DistConfig(f"dp{n}", dp=n)]


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

    warnings.filterwarnings("ignore")
    dataset, order = _data()

    def batch(step):
        if step == GATE:  # wait here for the third host's scale-out (or for any change to recover from)
            while not membership.store.check(["elastic/gen/2"]) and not membership.newer_published():
                time.sleep(0.05)
        ids = order.batch(step)
        return ids, [dataset[i] for i in ids]

    job = ElasticJob(membership, _build, configs, batch,
                     trainer_options=dict(optimizer=dict(name="adamw", lr=LR), buckets=(64,)),
                     checkpoint_dir=checkpoint_dir, checkpoint_every=2, step_timeout_s=10)
    result = job.run(STEPS)
    final = job.trainer.full_job_state() if job.trainer is not None else None
    if result is not None:
        result.update(final=final)
    return result


def agent_main(endpoint: str, checkpoint_dir: str, out: str) -> None:
    """One host's agent (run as `python -c`): the same call on every host."""
    from hotswitch.elastic.membership import Rendezvous, run_elastic

    result = run_elastic(_worker, 4, checkpoint_dir, min_size=2, max_size=4, log=lambda m: print(m, flush=True),
                         rendezvous=Rendezvous(endpoint, "test", NPROC, agent_timeout_s=3.0))
    if result is not None:
        torch.save(result, out)


def _spawn(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **kwargs)


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {DEADLINE_S:.0f} s for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    import torch.distributed as dist

    tmp = tmp_path_factory.mktemp("hosts")
    server = _spawn("-m", "hotswitch.cli", "rendezvous", "--port", "0", "--host", "127.0.0.1")
    agents: dict[str, subprocess.Popen] = {}
    try:
        port = int(server.stdout.readline().split(" --rdzv-endpoint ")[1].rpartition(":")[2])
        endpoint = f"127.0.0.1:{port}"
        store = dist.PrefixStore("hotswitch/test", dist.TCPStore("127.0.0.1", port, is_master=False))

        def start(name: str) -> None:
            code = (f"from tests.test_elastic_hosts import agent_main; "
                    f"agent_main({endpoint!r}, {str(tmp / 'ckpt')!r}, {str(tmp / (name + '.pt'))!r})")
            agents[name] = _spawn("-c", code)

        start("first")
        start("second")
        _until(lambda: store.check(["elastic/samples/2"]), "step 3 to be committed")
        # the agent whose workers are not the job's first two: the job's rank 0 survives either way
        record = json.loads(store.get("elastic/gen/0"))
        victim_aid = record["job"][-1][:2]
        victim = next(name for name, p in agents.items()
                      if f"agent {victim_aid} " in _peek(p, tmp / f"{name}.log"))
        killed_at = time.monotonic()
        os.kill(agents[victim].pid, signal.SIGKILL)
        _until(lambda: store.check(["elastic/gen/1"]), "the lost host's generation")
        noticed_s = time.monotonic() - killed_at
        start("third")
        codes = {name: p.wait(timeout=DEADLINE_S) for name, p in agents.items()}
        logs = {name: _peek(p, tmp / f"{name}.log") for name, p in agents.items()}
        results = {name: torch.load(tmp / f"{name}.pt") for name in agents if (tmp / f"{name}.pt").exists()}
        generations = [json.loads(store.get(f"elastic/gen/{g}")) for g in range(3)]
        yield dict(codes=codes, logs=logs, results=results, victim=victim, victim_aid=victim_aid,
                   generations=generations, noticed_s=noticed_s)
    finally:
        for p in [*agents.values(), server]:
            if p.poll() is None:
                p.kill()
            p.wait()


_LOGS: dict[int, str] = {}


def _peek(p: subprocess.Popen, path) -> str:
    """What an agent printed so far (read once its first line names it; whole once it ended)."""
    if p.poll() is not None:
        _LOGS[p.pid] = _LOGS.get(p.pid, "") + p.stdout.read()
    elif p.pid not in _LOGS:
        _LOGS[p.pid] = p.stdout.readline()
    return _LOGS[p.pid]


def test_a_lost_host_leaves_the_job_on_the_other_and_a_new_host_joins(hosts):
    assert hosts["codes"][hosts["victim"]] == -signal.SIGKILL
    survivor = next(n for n in ("first", "second") if n != hosts["victim"])
    assert hosts["codes"][survivor] == 0 and hosts["codes"]["third"] == 0, hosts["logs"]
    g0, g1, g2 = hosts["generations"]
    victim_workers = [w for w in g0["job"] if w.startswith(hosts["victim_aid"])]
    assert len(g0["job"]) == 4 and len(victim_workers) == NPROC
    assert g1["reason"] == "failure" and sorted(g1["lost"]) == sorted(victim_workers)
    assert g1["job"] == [w for w in g0["job"] if w not in victim_workers]
    assert g2["reason"] == "scale" and g2["job"] == g1["job"] + ["a2w0", "a2w1"]  # the third host's workers
    (result,) = hosts["results"].values()
    assert result["steps"] == STEPS and result["workers"] == g2["job"]
    changes = [(c["reason"], c["source"], c["destination"], c["restored_from"]) for c in result["reconfigurations"]]
    assert changes == [("failure", "dp4 on 4", "dp2 on 2", "survivors"), ("scale", "dp2 on 2", "dp4 on 4", "survivors")]
    print(f"host loss noticed (generation published) {hosts['noticed_s']:.1f} s after its agent's SIGKILL")


def test_weights_equal_single_device_adamw_and_each_batch_ran_once(hosts):
    (result,) = hosts["results"].values()
    dataset, order = _data()
    batches = [[dataset[i] for i in order.batch(step)] for step in range(STEPS)]
    *_, (_, _, reference) = _reference_steps(_build(), batches)
    final = {k.removeprefix("param:model."): v for k, v in result["final"].items() if k.startswith("param:")}
    assert final.keys() == reference.keys()
    worst = max(float((final[k] - reference[k]).norm() / reference[k].norm()) for k in reference)
    assert worst < 1e-5, worst
    assert result["samples"] == {step: order.batch(step) for step in range(STEPS)}
