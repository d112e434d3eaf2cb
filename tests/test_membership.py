"""The elastic agent's pure parts, without processes: generations proposed by compare_set (any agent
may publish, the first proposal wins), heartbeat silence, hosts from worker ids."""
import torch.distributed as dist

from hotswitch.distconfig import Topology
from hotswitch.elastic.job import hosts_topology
from hotswitch.elastic.membership import GenerationRecord, _Agent


def _agent(store, aid: str) -> _Agent:
    return _Agent(fn=None, args=(), min_size=1, max_size=4, store=store, address=None, env={}, aid=aid,
                  log=lambda m: None)


def test_the_first_proposal_of_a_generation_wins_and_the_other_agent_adopts_it():
    store = dist.HashStore()
    a, b = _agent(store, "a0"), _agent(store, "a1")
    start = GenerationRecord(0, ("a0w0", "a1w0"), ("a0w0", "a1w0"))
    assert a.propose(start)
    assert not b.propose(GenerationRecord(0, ("a1w0", "a0w0"), ("a1w0", "a0w0"))) and b.record == start
    # both saw a1w0 die; a publishes first, b re-reads and finds nothing left to do
    a.dead.add("a1w0"), b.dead.add("a1w0")
    a.drop_dead()
    b.follow()
    b.drop_dead()
    assert store.check(["elastic/gen/1"]) and not store.check(["elastic/gen/2"])
    assert b.record == GenerationRecord(1, ("a0w0",), ("a0w0",), ("a1w0",), "failure")


def test_heartbeat_silence_resets_when_the_counter_moves():
    store = dist.HashStore()
    agent = _agent(store, "a0")
    seen = [0, 0.0]
    store.add("hb", 1)
    assert agent.silent_for("hb", seen) == 0.0 and seen[0] == 1
    assert agent.silent_for("hb", seen) >= 0.0  # unchanged: the time since it was first seen
    first = seen[1]
    store.add("hb", 1)
    assert agent.silent_for("hb", seen) == 0.0 and seen[0] == 2 and seen[1] >= first


def test_hosts_topology_from_worker_ids():
    assert hosts_topology(["a0w0", "a0w1", "a1w0", "a1w1"]) == Topology(4, 2)
    assert hosts_topology(["w0", "w1", "w2"]) == Topology(3, 3)  # one host
    assert hosts_topology(["a0w0", "a1w0", "a1w1"]) == Topology(3, 3)  # unequal hosts: one node
