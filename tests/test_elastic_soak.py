"""Soak: 2 emulated hosts x 2 gloo workers (`tests.elastic_hosts`, loopback), 32 steps with seeded
random faults: SIGKILL or SIGSTOP of one worker or of a whole host (its agent and workers at once),
before a step or while it runs; a new host joins after each host fault (and after a worker fault
that leaves fewer than 3 workers), and a stopped host is resumed later (its agent must fence its
own workers out: the job moved on without them).

At the end the weights and both AdamW moments equal single-device AdamW on the same global batches
(what a fault-free run with the same membership changes computes, every config being exact), and
every global batch was committed once per step. Prints the faults injected and survived, and the
time from each fault to the next committed step (median, worst).

    python -m pytest -q -n 0 -s -m soak tests/test_elastic_soak.py      # HOTSWITCH_SOAK_SEED=N for another schedule
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import statistics
import time
from dataclasses import dataclass

import pytest

from tests import elastic_hosts as H

pytestmark = [pytest.mark.soak, pytest.mark.slow]

STEPS, TIMEOUT_S = 32, 3.0
SEED = int(os.environ.get("HOTSWITCH_SOAK_SEED", "0"))
KINDS = ("worker-kill", "worker-stop", "host-kill", "host-stop")


@dataclass
class Fault:
    step: int
    kind: str
    during: bool  # sent while the step runs (else just before it starts)
    victims: tuple[str, ...] = ()  # worker ids it took out
    recovered_s: float | None = None  # fault -> the next committed step


def schedule(rng: random.Random) -> dict[int, Fault]:
    """A fault every 3-5 steps from step 2; host faults and worker faults in a random mix."""
    faults, step = {}, 2
    while step < STEPS - 2:
        faults[step] = Fault(step, rng.choice(KINDS), rng.random() < 0.5)
        step += rng.randint(3, 5)
    return faults


class Driver:
    def __init__(self, cluster: H.Cluster, rng: random.Random):
        self.cluster, self.rng = cluster, rng
        self.hosts: dict[str, str] = {}  # agent name -> its id ("a<k>")
        self.stopped: list[str] = []  # hosts SIGSTOPped, to resume later
        self.joined = 0
        self.joining: list[str] = []  # replacement hosts not yet in the job

    def start_host(self) -> None:
        name = f"host{self.joined}"
        self.joined += 1
        self.cluster.start(name)
        self.hosts[name] = self.cluster.agent_id(name)

    def job(self) -> list[str]:
        store, g = self.cluster.store, 0
        while store.check([f"elastic/gen/{g + 1}"]):
            g += 1
        return json.loads(store.get(f"elastic/gen/{g}"))["job"]

    def inject(self, fault: Fault) -> None:
        """Send the fault to a victim that leaves at least one worker of the job holding its state."""
        job = self.job()
        by_host = {name: [w for w in job if w.startswith(aid + "w")] for name, aid in self.hosts.items()}
        hosts = [name for name, workers in by_host.items() if workers]
        kind = fault.kind
        if kind.startswith("host") and len(hosts) < 2:
            kind = fault.kind = "worker" + kind[4:]  # one host left: a worker fault instead
        signum = signal.SIGKILL if kind.endswith("kill") else signal.SIGSTOP
        if kind.startswith("host"):
            name = self.rng.choice(hosts)
            fault.victims = tuple(by_host[name])
            os.killpg(self.cluster.agents[name].pid, signum)  # the agent and its workers at once
            if signum == signal.SIGSTOP:
                self.stopped.append(name)
        elif len(job) >= 2:
            wid = self.rng.choice(job)
            fault.victims = (wid,)
            os.kill(int(self.cluster.store.get(f"test/pid/{wid}")), signum)
        if kind.startswith("host") or len(job) - len(fault.victims) < 3:
            self.start_host()  # a replacement joins (a scale-out once its rendezvous round completes)
            self.joining.append(self.hosts[f"host{self.joined - 1}"])

    def wait_for_joins(self) -> None:
        """Until each replacement host's workers are in the job, unless the job is full (so the job is
        still running when a host joins, however slowly this machine starts processes)."""
        for aid in self.joining:
            H.until(lambda: self.cluster.check() or len(self.job()) == 4
                    or any(w.startswith(aid + "w") for w in self.job()), f"host {aid} to join the job")
        self.joining.clear()

    def resume_stopped(self) -> None:
        for name in self.stopped:
            os.killpg(self.cluster.agents[name].pid, signal.SIGCONT)
        self.stopped.clear()


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    rng = random.Random(SEED)
    faults = schedule(rng)
    nodes = H.emulated_nodes(2 + 2 + len(faults))  # the rendezvous', the first hosts', replacements'
    with nodes if nodes is not None else contextlib.nullcontext():
        yield from _soak(tmp_path_factory, rng, faults, nodes)


def _soak(tmp_path_factory, rng, faults, nodes):
    cluster = H.Cluster(tmp_path_factory.mktemp("soak"), "soak", "go", STEPS, timeout_s=TIMEOUT_S, nodes=nodes)
    driver = Driver(cluster, rng)
    store = cluster.store
    logs = {}
    try:
        driver.start_host()
        driver.start_host()
        t_start = time.monotonic()
        pending: list[tuple[Fault, float, int]] = []  # (fault, when sent, the first step that can show recovery)

        def send(fault: Fault, step: int) -> None:
            driver.inject(fault)
            sent = time.monotonic()
            # a fault that landed after its step committed is survived when the next one commits
            pending.append((fault, sent, step + 1 if store.check([f"elastic/samples/{step}"]) else step))

        for step in range(STEPS):
            if step - 2 in faults:  # a couple of steps after a fault: stopped hosts resume, replacements are in
                driver.resume_stopped()
                driver.wait_for_joins()  # the job waits at this step's gate meanwhile
            fault = faults.get(step)
            if fault is not None and not fault.during:
                send(fault, step)
            store.set(f"test/go/{step}", "1")
            if fault is not None and fault.during:
                time.sleep(rng.uniform(0.0, 0.2))
                send(fault, step)
            H.until(lambda s=step: cluster.check() or store.check([f"elastic/samples/{s}"]),
                    f"step {step + 1} to be committed")
            committed = time.monotonic()  # a step commits only when every job worker is alive: after recovery
            for f, sent, first in [p for p in pending if p[2] <= step]:
                f.recovered_s = committed - sent
            pending = [p for p in pending if p[2] > step]
        codes = {name: p.wait(timeout=H.DEADLINE_S) for name, p in cluster.agents.items()
                 if name not in driver.stopped}
        generations, g = [], 0
        while store.check([f"elastic/gen/{g}"]):
            generations.append(json.loads(store.get(f"elastic/gen/{g}")))
            g += 1
        yield dict(faults=list(faults.values()), results=cluster.results(), codes=codes, generations=generations,
                   seconds=time.monotonic() - t_start, logs=logs,
                   network="a network namespace per host" if nodes is not None else "loopback")
    finally:
        logs.update(cluster.close())


def test_soak_survives_every_fault(soak):
    faults = [f for f in soak["faults"] if f.victims]
    assert len(faults) >= 6, soak["faults"]
    lost = {w for g in soak["generations"] for w in g["lost"]}
    for f in faults:
        assert set(f.victims) <= lost, (f, soak["generations"])  # every victim was noticed and dropped
    assert all(code == 0 for name, code in soak["codes"].items() if code is not None and code >= 0), soak["codes"]
    times = sorted(f.recovered_s for f in faults)
    kinds = {k: sum(f.kind == k for f in faults) for k in KINDS}
    print(f"\nsoak (seed {SEED}): {len(faults)} faults injected ({', '.join(f'{n} {k}' for k, n in kinds.items())}), "
          f"{len(faults)} survived; fault -> next committed step: median {statistics.median(times):.1f} s, worst "
          f"{times[-1]:.1f} s; {len(soak['generations'])} generations, {STEPS} steps in {soak['seconds']:.0f} s "
          f"({soak['network']})")


def test_soak_state_equals_single_device_adamw_and_each_batch_ran_once(soak):
    (result,) = soak["results"].values()
    assert result["steps"] == STEPS
    dataset, order = H.data()
    expected = H.reference([[dataset[i] for i in order.batch(step)] for step in range(STEPS)])
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        assert H.worst_error(result["final"], expected, kind) < H.ADAMW_TOLERANCE, kind
    assert result["samples"] == {step: order.batch(step) for step in range(STEPS)}
