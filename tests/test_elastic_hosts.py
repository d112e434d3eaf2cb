"""Elastic training across hosts (`tests.elastic_hosts`: one agent process per emulated host, 2 gloo
workers each), on torch's c10d rendezvous served by `hotswitch rendezvous` in a process apart, and
again on a rendezvous backend registered from outside (torch's dynamic rendezvous on a FileStore).

Agents "first" and "second" start the job (dp4). After step 3 the test SIGKILLs the agent whose
workers are the job's last two: its workers die with it (parent-death signal), the other agent
notices its heartbeat stop and the job goes on with 2 workers from the survivors' state. A third
agent started then joins as a scale-out (back to dp4); at step 5 every worker waits for that
scale-out, so the sequence does not depend on how fast this machine is. The final weights and
AdamW moments equal single-device AdamW on the same global batches.
"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests import elastic_hosts as H

pytestmark = [pytest.mark.hosts, pytest.mark.slow]  # spawns 3 agents and 6 workers: -m hosts

STEPS = 8


@pytest.fixture(scope="module", params=["c10d", "file"])
def hosts(request, tmp_path_factory):
    cluster = H.Cluster(tmp_path_factory.mktemp("hosts"), "hosts", "scale-out:5", STEPS, timeout_s=3.0,
                        backend=request.param)
    logs = {}
    try:
        cluster.start("first")
        cluster.start("second")
        ids = {name: cluster.agent_id(name) for name in ("first", "second")}
        H.until(lambda: cluster.store.check(["elastic/samples/2"]), "step 3 to be committed")
        g0 = json.loads(cluster.store.get("elastic/gen/0"))
        victim = next(name for name, aid in ids.items() if g0["job"][-1].startswith(aid))
        pids = [int(cluster.store.get(f"test/pid/{w}")) for w in g0["job"] if w.startswith(ids[victim])]
        killed_at = time.monotonic()
        os.kill(cluster.agents[victim].pid, signal.SIGKILL)  # the agent only: its workers die with it
        H.until(lambda: cluster.store.check(["elastic/gen/1"]), "the lost host's generation")
        noticed_s = time.monotonic() - killed_at
        H.until(lambda: not any(_alive(pid) for pid in pids), "the lost agent's workers to die with it")
        cluster.start("third")
        codes = {name: p.wait(timeout=H.DEADLINE_S) for name, p in cluster.agents.items()}
        generations = [json.loads(cluster.store.get(f"elastic/gen/{g}")) for g in range(3)]
        yield dict(codes=codes, results=cluster.results(), victim=victim, victim_aid=ids[victim],
                   generations=generations, noticed_s=noticed_s, logs=logs)
    finally:
        logs.update(cluster.close())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie (dead, not yet reaped) counts as dead
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_lost_host_leaves_the_job_on_the_other_and_a_new_host_joins(hosts):
    assert hosts["codes"][hosts["victim"]] == -signal.SIGKILL
    survivor = next(n for n in ("first", "second") if n != hosts["victim"])
    assert hosts["codes"][survivor] == 0 and hosts["codes"]["third"] == 0
    g0, g1, g2 = hosts["generations"]
    victim_workers = [w for w in g0["job"] if w.startswith(hosts["victim_aid"])]
    assert len(g0["job"]) == 4 and len(victim_workers) == H.NPROC
    assert g1["reason"] == "failure" and sorted(g1["lost"]) == sorted(victim_workers)
    assert g1["job"] == [w for w in g0["job"] if w not in victim_workers]
    assert g2["reason"] == "scale" and g2["job"] == g1["job"] + ["a2w0", "a2w1"]  # the third host's workers
    (result,) = hosts["results"].values()
    assert result["steps"] == STEPS and result["workers"] == g2["job"]
    changes = [(c["reason"], c["source"], c["destination"], c["restored_from"]) for c in result["reconfigurations"]]
    assert changes == [("failure", "dp4 on 4", "dp2 on 2", "survivors"), ("scale", "dp2 on 2", "dp4 on 4", "survivors")]
    print(f"host loss noticed (generation published) {hosts['noticed_s']:.1f} s after its agent's SIGKILL")


def test_state_equals_single_device_adamw_and_each_batch_ran_once(hosts):
    (result,) = hosts["results"].values()
    dataset, order = H.data()
    expected = H.reference([[dataset[i] for i in order.batch(step)] for step in range(STEPS)])
    assert H.worst_error(result["final"], expected, "param") < H.ADAMW_TOLERANCE
    assert H.worst_error(result["final"], expected, "exp_avg") < H.ADAMW_TOLERANCE
    assert H.worst_error(result["final"], expected, "exp_avg_sq") < H.ADAMW_TOLERANCE
    assert result["samples"] == {step: order.batch(step) for step in range(STEPS)}
