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


def test_heartbeat_silence_is_never_overestimated(monkeypatch):
    """Silence counts from the clock read *after* the read that first saw the value to the clock read
    *before* the present read: an observer stopped between two reads (clock jumped) cannot see more."""
    from hotswitch.elastic import membership

    store = dist.HashStore()
    agent = _agent(store, "a0")
    clock = iter([100.0, 101.0,   # counter 1 first seen: before 100, after 101
                  104.0,          # unchanged: before the read at 104 -> silent 3 s
                  110.0, 150.0,   # moved (the observer was stopped meanwhile): 0, first seen at 150
                  151.0])         # unchanged: 1 s, not the 50 s the clock jumped
    monkeypatch.setattr(membership.time, "monotonic", lambda: next(clock))
    seen = [0, 0.0]
    store.add("hb", 1)
    assert agent.silent_for("hb", seen) == 0.0 and seen == [1, 101.0]
    assert agent.silent_for("hb", seen) == 3.0
    store.add("hb", 1)
    assert agent.silent_for("hb", seen) == 0.0 and seen == [2, 150.0]
    assert agent.silent_for("hb", seen) == 1.0


def test_hosts_topology_from_worker_ids():
    assert hosts_topology(["a0w0", "a0w1", "a1w0", "a1w1"]) == Topology(4, 2)
    assert hosts_topology(["w0", "w1", "w2"]) == Topology(3, 3)  # one host
    assert hosts_topology(["a0w0", "a1w0", "a1w1"]) == Topology(3, 3)  # unequal hosts: one node


def test_a_worker_whose_pipe_closed_before_it_was_reaped_counts_as_dead():
    """A killed worker's pipe can close before its process is reaped. The agent once took deaths only
    from ready sentinels, and `exitcode` had reaped this one first (its sentinel is never ready then):
    the death was never seen, and the survivors waited at a commit for it forever (a hung suite run)."""
    import multiprocessing

    from hotswitch.elastic.membership import _Worker

    closed, write_end = multiprocessing.Pipe(duplex=False)
    write_end.close()  # the dead worker's end: reading gives EOF
    result, result_end = multiprocessing.Pipe(duplex=False)
    result_end.send(("left", None))  # a worker that left the job, then exited: not a death
    never_ready = [multiprocessing.Pipe(duplex=False) for _ in range(2)]  # (read end, write end kept open)

    class Reaped:  # exitcode known (reaped already): its sentinel is never ready
        exitcode = -9

        def __init__(self, sentinel) -> None:
            self.sentinel = sentinel

        def join(self) -> None:
            pass

    agent = _agent(dist.HashStore(), "")
    agent.workers = {"w1": _Worker("w1", Reaped(never_ready[0][0]), closed),
                     "w2": _Worker("w2", Reaped(never_ready[1][0]), result)}
    assert agent.poll_workers(0.01) is None
    assert agent.dead == {"w1"} and agent.workers["w2"].done


def test_a_store_wait_for_a_peer_that_never_comes_ends_naming_it():
    """Barriers and commits are bounded as collectives are: a peer that neither arrives nor is declared
    lost ends the wait with an error naming it, never an endless wait."""
    import datetime

    import pytest

    from hotswitch.elastic.membership import Membership

    m = Membership("w0", dist.HashStore(), 1, 2, backend="gloo")
    m.record, m.job_members = GenerationRecord(0, ("w0", "w1"), ("w0", "w1")), ("w0", "w1")
    m.wait_timeout = datetime.timedelta(seconds=0.1)
    with pytest.raises(TimeoutError, match=r"w0 waited \d+ s at 'g0/init' of generation 0 for w1, which neither"):
        m.barrier("g0/init")
    with pytest.raises(TimeoutError, match="at 's0/update' of generation 0 for w1"):
        m.agree_to_commit("s0/update")
    assert m.decide_abort("s0/update") is False  # nothing was decided: the recovery decides abort


class _StoreWithoutCompareSet(dist.Store):
    """A store like torch's EtcdStore: set, get, add, check and wait, but no compare_set."""

    def __init__(self):
        super().__init__()
        self.values: dict[str, int] = {}

    def add(self, key, amount):
        self.values[key] = self.values.get(key, 0) + amount
        return self.values[key]


def test_a_rendezvous_store_without_compare_set_is_refused_by_name():
    import pytest

    from hotswitch.elastic.membership import Rendezvous, _check_store

    _check_store(dist.HashStore(), "file")  # a c10d store has every operation
    with pytest.raises(ValueError, match="rendezvous backend 'etcd' cannot serve an elastic job: it needs .*"
                                         "compare_set"):
        _check_store(_StoreWithoutCompareSet(), "etcd")
    with pytest.raises(ValueError, match="register_rendezvous_store\\('etcd', open_store\\)"):
        Rendezvous("etcd0:2379", backend="etcd")


def test_a_rendezvous_store_opener_is_found_by_entry_point_as_torchrun_finds_handlers(monkeypatch):
    import importlib.metadata

    from hotswitch.elastic import membership
    from tests.elastic_hosts import open_file_store

    declared = [importlib.metadata.EntryPoint("file-plugin", "tests.elastic_hosts:open_file_store",
                                              membership.STORE_ENTRY_POINTS)]
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group, name: [e for e in declared if e.group == group and e.name == name])
    monkeypatch.setattr(membership, "_RENDEZVOUS_STORES", {})
    address = membership.Rendezvous("/shared/rendezvous.store", "job", 2, "file-plugin").address
    assert address.opener is open_file_store and address.rendezvous == ("file-plugin", "/shared/rendezvous.store",
                                                                         "job")
    assert address.prefix == "hotswitch/job"
