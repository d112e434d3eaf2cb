"""Emulated hosts for the elastic tests: `hotswitch rendezvous` and one agent process per "host"
(`run_elastic(rendezvous=...)`, 2 gloo workers each) on this machine's loopback, plus the
single-device AdamW reference the jobs must equal.

The workers train gpt-tiny under pure DP (every count of workers fits; every survivor holds the
whole state) and wait at a gate before each step's batch, so a test decides when steps run:
"scale-out:S" waits at step S for generation 2 (a third host's scale-out); "go" waits before every
step for the test's key "test/go/<step>". A gate also opens when a newer generation is published
(there is a change to recover from first).

Rendezvous backends: torch's c10d (a TCPStore served by `hotswitch rendezvous`), or "file", a
backend torch's registry does not have, registered here as an out-of-tree one would be: torch's own
dynamic rendezvous (the algorithm behind c10d's and etcd-v2's handlers) on a FileStore, whose store
hotswitch opens through `register_rendezvous_store`.
"""
from __future__ import annotations

import contextlib
import copy
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hotswitch.distconfig import DistConfig

BATCH, NPROC, LR = 8, 2, 1e-3
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEADLINE_S = 300 * float(os.environ.get("HOTSWITCH_TEST_TIMEOUT_SCALE", "1"))  # a hang fails, never a slow run


@contextlib.contextmanager
def workers_aborted_after(seconds: float = DEADLINE_S):
    """A job run in this process (`run_elastic`) that hangs becomes a failure that shows where: after
    `seconds`, every worker this process spawned gets SIGABRT, so faulthandler prints its threads'
    stacks (to the test's captured stderr) and the agent reports the workers' deaths."""
    def abort() -> None:
        for p in multiprocessing.active_children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGABRT)
            time.sleep(0.5)  # one worker's stacks at a time, not interleaved

    timer = threading.Timer(seconds, abort)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def configs(n: int) -> list[DistConfig]:
    return [DistConfig(f"dp{n}", dp=n)]


def data():
    from hotswitch.train import data as D

    return D.synthetic_skewed(64, 1001, 64, seed=0), D.SampleOrder(64, BATCH, seed=0)


def build():
    from hotswitch.models import build_model

    torch.manual_seed(0)
    return build_model("gpt-tiny")


def _gate(membership, gate: str, step: int) -> None:
    if gate.startswith("scale-out:"):
        if step != int(gate.partition(":")[2]):
            return
        key = "elastic/gen/2"
    else:
        key = f"test/go/{step}"
    while not membership.store.check([key]) and not membership.newer_published():
        time.sleep(0.02)


def worker(membership, checkpoint_dir: str, gate: str, steps: int, step_timeout_s: float):
    import warnings

    from hotswitch.elastic import ElasticJob

    warnings.filterwarnings("ignore")
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks on demand (a hang's diagnosis)
    membership.store.set(f"test/pid/{membership.wid}", str(os.getpid()))
    dataset, order = data()

    def batch(step):
        _gate(membership, gate, step)
        ids = order.batch(step)
        return ids, [dataset[i] for i in ids]

    job = ElasticJob(membership, build, configs, batch,
                     trainer_options=dict(optimizer=dict(name="adamw", lr=LR), buckets=(64,)),
                     checkpoint_dir=checkpoint_dir, checkpoint_every=2, step_timeout_s=step_timeout_s,
                     log=lambda m: print(m, flush=True))
    result = job.run(steps)
    final = job.trainer.full_job_state() if job.trainer is not None else None
    if result is not None:
        result.update(final=final)
    return result


def open_file_store(params):
    """The "file" backend's store: a FileStore at the endpoint, a path on this machine (module level:
    the workers import it)."""
    import torch.distributed as dist

    return dist.FileStore(params.endpoint, -1)


def file_rendezvous_handler(params):
    """The "file" backend's handler: torch's dynamic rendezvous with its store-based backend, on a FileStore."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class FileRendezvousBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:  # torch checks that a handler's backend is the one asked for
            return "file"

    store = open_file_store(params)
    return create_handler(store, FileRendezvousBackend(store, params.run_id), params)


def register_file_backend() -> None:
    """"file" in torch's rendezvous registry (its handler) and in hotswitch's (its store)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    from hotswitch.elastic import register_rendezvous_store

    rendezvous_handler_registry.register("file", file_rendezvous_handler)
    register_rendezvous_store("file", open_file_store)


def agent_main(endpoint: str, run_id: str, checkpoint_dir: str, out: str, gate: str, steps: int,
               timeout_s: float, backend: str = "c10d") -> None:
    """One host's agent (run as `python -c`): the same call on every host; the result to `out`."""
    from hotswitch.elastic.membership import Rendezvous, run_elastic

    if backend == "file":
        register_file_backend()
    result = run_elastic(worker, 4, checkpoint_dir, gate, steps, timeout_s, min_size=1, max_size=4,
                         log=lambda m: print(m, flush=True), heartbeat_timeout_s=timeout_s,
                         rendezvous=Rendezvous(endpoint, run_id, NPROC, backend, agent_timeout_s=timeout_s))
    if result is not None:
        torch.save(result, out)


def spawn(*args: str, namespace: str | None = None) -> subprocess.Popen:
    """A Python process in a session of its own (so a whole "host" can be signalled at once), in
    network namespace `namespace` if given (its own emulated node)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, *args]
    if namespace is not None:  # `ip netns exec` execs the command: the pid stays the Python process's
        from hotswitch.distributed.netns import INTERFACE

        command = ["ip", "netns", "exec", namespace, *command]
        env.update(GLOO_SOCKET_IFNAME=INTERFACE, TORCH_CPP_LOG_LEVEL="ERROR")
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def emulated_nodes(n: int):
    """`n` network namespaces on a shaped bridge where this machine allows it (root, iproute2), else
    None: everything on loopback."""
    import shutil

    from hotswitch.distributed.netns import EmulatedNodes

    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return None
    return EmulatedNodes(n, inter_node_gbit=10.0)


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {DEADLINE_S:.0f} s for {what}")
        time.sleep(0.02)


class Cluster:
    """`hotswitch rendezvous` and the agents started on it; `store` reads the job's keys. With `nodes`
    (an entered `EmulatedNodes`), the rendezvous runs in node 0 and the k-th host started in node k.
    With `backend="file"`, the rendezvous is a file in `tmp` instead (no server; one machine only)."""

    def __init__(self, tmp, run_id: str, gate: str, steps: int, timeout_s: float, nodes=None,
                 backend: str = "c10d"):
        import torch.distributed as dist

        from hotswitch.distributed.netns import in_namespace

        self.tmp, self.run_id, self.gate, self.steps, self.timeout_s = tmp, run_id, gate, steps, timeout_s
        self.nodes, self.backend = nodes, backend
        self.agents: dict[str, subprocess.Popen] = {}
        self.server = None
        if backend == "file":
            assert nodes is None, "a FileStore reaches no other node"
            self.endpoint = str(tmp / "rendezvous.store")
            client = dist.FileStore(self.endpoint, -1)
        else:
            host = "127.0.0.1" if nodes is None else nodes.address(0)
            self.server = spawn("-m", "hotswitch.cli", "rendezvous", "--port", "0", "--host", host,
                                namespace=self._namespace(0))
            port = int(self.server.stdout.readline().split(" --rdzv-endpoint ")[1].rpartition(":")[2])
            self.endpoint = f"{host}:{port}"
            with in_namespace(self._namespace(0)):  # the client's socket stays in node 0
                client = dist.TCPStore(host, port, is_master=False)
        self.store = dist.PrefixStore(f"hotswitch/{run_id}", client)

    def _namespace(self, node: int) -> str | None:
        return None if self.nodes is None else self.nodes.node_namespace(node)

    def check(self) -> bool:
        """Raise, with its output, if an agent ended with an error (the job failed): no waiting on."""
        for name, p in self.agents.items():
            if p.poll() is not None and p.returncode > 0:
                raise AssertionError(f"agent {name} failed (exit code {p.returncode}):\n{p.stdout.read()[-6000:]}")
        return False

    def start(self, name: str) -> None:
        code = (f"from tests.elastic_hosts import agent_main; agent_main({self.endpoint!r}, {self.run_id!r}, "
                f"{str(self.tmp / 'ckpt')!r}, {str(self.tmp / (name + '.pt'))!r}, {self.gate!r}, {self.steps}, "
                f"{self.timeout_s}, {self.backend!r})")
        self.agents[name] = spawn("-c", code, namespace=self._namespace(len(self.agents) + 1))

    def agent_id(self, name: str) -> str:
        """The id ("a<k>") agent `name` drew, from the first line it printed."""
        line = self.agents[name].stdout.readline()
        return line.split("[elastic] agent ")[1].split()[0]

    def results(self) -> dict[str, dict]:
        return {name: torch.load(self.tmp / f"{name}.pt") for name in self.agents
                if (self.tmp / f"{name}.pt").exists()}

    def close(self) -> dict[str, str]:
        """Stop whatever still runs (stopped hosts included); every agent's output. With
        HOTSWITCH_TEST_LOGS=FILE, first the job's generations, its keys and every live worker's
        stacks, then every agent's output, go to FILE (to read after a failure)."""
        debug = os.environ.get("HOTSWITCH_TEST_LOGS")
        state = self._state() if debug else ""
        logs = {}
        for name, p in [*self.agents.items(), *([("rendezvous", self.server)] if self.server else [])]:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGCONT)
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
            logs[name] = p.stdout.read()
        if debug:
            with open(debug, "w") as f:
                f.write(state)
                f.writelines(f"== {name} (exit code {self.agents[name].returncode if name in self.agents else '-'})"
                             f"\n{text}\n" for name, text in logs.items())
        return logs

    def _state(self) -> str:
        store, lines, g = self.store, [], 0
        while store.check([f"elastic/gen/{g}"]):
            lines.append(store.get(f"elastic/gen/{g}").decode())
            g += 1
        for key in ("elastic/finished", "elastic/failed", "elastic/started"):
            lines.append(f"{key}: {store.get(key).decode() if store.check([key]) else '-'}")
        lines.append(f"committed: {[s for s in range(self.steps) if store.check([f'elastic/samples/{s}'])]}")
        for k in range(store.add("elastic/agents", 0)):  # stacks into each agent's output (faulthandler)
            for wid in json.loads(store.get(f"elastic/agent/a{k}/workers")):
                if store.check([f"test/pid/{wid}"]):
                    try:
                        os.kill(int(store.get(f"test/pid/{wid}")), signal.SIGUSR1)
                    except ProcessLookupError:
                        pass
        time.sleep(2)
        return "\n".join(lines) + "\n"


def reference(batches) -> dict[str, torch.Tensor]:
    """Single-device AdamW on `batches` (every sequence alone; loss = token losses / targets): the
    final {"param:<name>", "exp_avg:<name>", "exp_avg_sq:<name>"}, named as the job state is."""
    model = copy.deepcopy(build())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for seqs in batches:
        total = sum(len(s) - 1 for s in seqs)
        loss = sum(F.cross_entropy(model(input_ids=s[None])[0, :-1].float(), s[1:], reduction="sum")
                   for s in seqs) / total
        loss.backward()
        opt.step()
        opt.zero_grad()
    out = {}
    for name, p in model.named_parameters():
        out[f"param:model.{name}"] = p.detach()
        out.update({f"{k}:model.{name}": opt.state[p][k] for k in ("exp_avg", "exp_avg_sq")})
    return out


# How far an elastic job's AdamW state may be from one device's (relative norm per tensor). Each
# layout it crosses sums gradients in its own order, and AdamW amplifies that where a gradient is
# near its eps (1e-8): the update lr * g / (|g| + eps) then moves with g's last digits. Seen on one
# 2-core Xeon (one thread per process, before and after attention ran as fused kernels): in the faults test a
# single element of layers.0.mlp.up_proj had a step-0 gradient of 5.9e-9, and its weight ended 2.9e-5
# (0.03 lr) from one device's, 1.3e-5 of the tensor's norm; every other tensor stayed under 2e-6. A
# batch lost or run twice moves the state by 1e-3 or more; the run-once checks stay exact.
ADAMW_TOLERANCE = 1e-4


def worst_error(final: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], kind: str) -> float:
    """The largest relative error (norm) over the tensors of `kind` ("param", "exp_avg", ...)."""
    keys = [k for k in expected if k.startswith(kind + ":")]
    assert keys and all(k in final for k in keys), sorted(set(keys) - set(final))
    return max(float((final[k] - expected[k]).norm() / expected[k].norm().clamp_min(1e-30)) for k in keys)
