"""The persistent compile cache (pure: no process group): round trips, corrupt and truncated entries
recovered from, concurrent writers, and the environment switches."""
import os
import pickle
import threading
import warnings

import pytest
import torch

from hotswitch.compiler.cache import CompileCache, default_cache
from hotswitch.compiler.sharding import ShardingDecisions

DECISIONS = ShardingDecisions({"mm": (((("S", 0),), (("R",),)), (("P", "sum"),))}, frozenset({"add_3"}))


def test_round_trip_and_keys(tmp_path):
    cache = CompileCache(tmp_path)
    key = cache.key("graph code", (2, 2), ("dp", "tp"))
    assert key != cache.key("graph code", (4,), ("tp",)) and key == cache.key("graph code", (2, 2), ("dp", "tp"))
    assert cache.get(key) is None and cache.misses["decisions"] == 1
    cache.put(key, DECISIONS)
    assert cache.get(key) == DECISIONS and cache.hits["decisions"] == 1
    assert cache.get(cache.key("another graph"), "program") is None and cache.misses["program"] == 1


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_a_damaged_entry_is_reported_once_removed_and_recomputed(tmp_path, damage):
    cache = CompileCache(tmp_path)
    key = cache.key("g")
    cache.put(key, DECISIONS)
    path = next(tmp_path.rglob("*.pkl"))
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "flip": data[:-1] + bytes([data[-1] ^ 1]),
                      "garbage": b"not a cache entry"}[damage])
    with pytest.warns(UserWarning, match="corrupt or truncated.*removed and recomputed"):
        assert cache.get(key) is None
    assert not path.exists() and cache.recovered == 1
    cache.put(key, DECISIONS)  # the recomputed decisions take its place
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.get(key) == DECISIONS


def test_concurrent_writers_leave_a_whole_entry(tmp_path):
    cache = CompileCache(tmp_path)
    key = cache.key("g")
    big = ShardingDecisions({f"n{i}": ((("R",),), ("R",)) for i in range(20000)}, frozenset())
    threads = [threading.Thread(target=cache.put, args=(key, big)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert CompileCache(tmp_path).get(key) == big
    assert [p.name for p in tmp_path.rglob("*")  if p.is_file()] == [f"{key}.pkl"]  # no temporary file left


def test_environment_chooses_the_directory_or_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv("HOTSWITCH_CACHE_DIR", str(tmp_path / "here"))
    assert default_cache().directory == tmp_path / "here"
    monkeypatch.delenv("HOTSWITCH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache().directory == tmp_path / "xdg" / "hotswitch"
    monkeypatch.setenv("HOTSWITCH_CACHE", "0")
    assert default_cache() is None
    assert os.environ["HOTSWITCH_CACHE"] == "0"


def test_one_rank_searches_and_the_others_wait_for_its_decisions(tmp_path):
    """`hotswitch.runtime.shared` on a real c10d store, a thread per rank: the first rank to ask
    searches and publishes, a second waits for it; when the search raises, the waiting rank is told
    and searches itself (it raises the same error there), never waits forever."""
    import datetime

    import torch.distributed as dist

    from hotswitch.runtime.shared import JobOnce, SharedCache

    store = dist.HashStore()
    wait = datetime.timedelta(seconds=600)
    first = SharedCache(None, JobOnce(store, wait))
    second = SharedCache(None, JobOnce(store, wait))
    second.once.scope = first.once.scope  # two ranks' copies of one compiled model
    got = {}
    assert first.get("k1") is None  # ours to search
    waiter = threading.Thread(target=lambda: got.update(k1=second.get("k1")))
    waiter.start()
    first.put("k1", DECISIONS)
    waiter.join()
    assert got["k1"] == DECISIONS and (first.once.computed, second.once.received) == (1, 1)

    assert first.get("k2") is None
    waiter = threading.Thread(target=lambda: got.update(k2=second.get("k2")))
    waiter.start()
    first.failed("k2")
    waiter.join()
    assert got["k2"] is None and second.once.received == 1  # searches for itself

    other_model = SharedCache(None, JobOnce(store, wait))  # another scope: decides on its own
    assert other_model.get("k1") is None and other_model.once.computed == 1

    # a rank's own program is never claimed nor awaited: both ranks lower theirs
    assert first.get("p", "program") is None and second.get("p", "program") is None
    assert first.once.computed == 2 and second.once.received == 1


def test_a_logic_graph_traced_by_other_code_is_not_loaded(tmp_path, monkeypatch):
    """The LogicGraph's key holds the torch and hotswitch versions, not only the model's fingerprint: a
    Hugging Face model's code is its installed version, so an edited tracer (or kernel op) once loaded
    the graph an older hotswitch had traced."""
    import torch

    from hotswitch.compiler import cache as cache_module
    from hotswitch.models import GPT, GPTConfig
    from hotswitch.runtime import shared

    model = GPT(GPTConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, max_seq_len=16))
    ids = torch.randint(0, 64, (2, 8))
    store = shared.SharedCache(CompileCache(tmp_path), shared.JobOnce(store=None))
    monkeypatch.setattr(shared, "_LOADED", {})
    assert shared.trace_once(model, (ids, ids), store)[1] == "traced"
    monkeypatch.setattr(shared, "_LOADED", {})
    assert shared.trace_once(model, (ids, ids), store)[1] == "loaded"
    monkeypatch.setattr(cache_module, "_version", lambda: "another hotswitch")
    monkeypatch.setattr(shared, "_LOADED", {})
    assert shared.trace_once(model, (ids, ids), store)[1] == "traced"


def _program_with_collectives(group: str, rounding: str) -> torch.fx.GraphModule:
    """x -> all_reduce over `group` -> x // 2 (`rounding` mode): an ExecGraph-like program."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    reduced = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", group))
    waited = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (reduced,))
    halved = graph.call_function(torch.ops.aten.div.Tensor_mode, (waited, 2), {"rounding_mode": rounding})
    graph.output((halved,))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("rounding", ["trunc", "floor"])
def test_a_cached_program_runs_its_code_with_this_processs_group_names(rounding):
    """An ExecGraph's entry holds its code, compiled too, with each collective's group as its mesh
    axis: loaded, the code (source and compiled) names this process's group, and equals the code fx
    writes for the loaded graph. A string equal to the group's name elsewhere in the code ("floor",
    here) leaves the code out of the entry: fx writes it again on loading, the same."""
    from hotswitch.compiler.lengths import program_outline
    from hotswitch.compiler.logic_io import dumps_program, loads_program

    gm = _program_with_collectives("floor", rounding)
    entry = dumps_program(gm, {"floor": 0})
    *_, written, outline = pickle.loads(entry)  # its version, nodes, attributes, codegen, code and outline
    assert (written is None) == (rounding == "floor")
    loaded = loads_program(entry, ["tp-of-this-process"])
    assert program_outline(loaded) == outline == program_outline(gm)  # read off the entry, then off the graph
    assert loaded.code == loaded.graph.python_code("self").src
    assert "'tp-of-this-process'" in loaded.code and f"rounding_mode = '{rounding}'" in loaded.code
    constants = set(type(loaded).forward.__code__.co_consts)
    if rounding == "trunc":  # the entry's compiled code, its group renamed
        assert "tp-of-this-process" in constants and not any("hotswitch group" in str(c) for c in constants)
    x = torch.arange(6.0)
    with pytest.raises(Exception, match="tp-of-this-process"):  # the collective runs on the renamed group
        loaded(x)


def test_compiled_code_from_another_python_is_compiled_again():
    """An entry's compiled code is for the Python that wrote it (`marshal`'s format changes between
    versions): another Python compiles the entry's source instead, and runs the same."""
    from dataclasses import replace

    from hotswitch.compiler.logic_io import dumps_program, loads_program

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output((graph.call_function(torch.ops.aten.mul.Tensor, (x, x)),))
    version, nodes, attrs, codegen, written, outline = pickle.loads(
        dumps_program(torch.fx.GraphModule({}, graph), {}))
    assert written is not None and written.bytecode is not None
    other = pickle.dumps((version, nodes, attrs, codegen, replace(written, python="cpython-999"), outline))
    for entry in (other, pickle.dumps((version, nodes, attrs, codegen, written, outline))):
        loaded = loads_program(entry, [])
        assert loaded.code == loaded.graph.python_code("self").src
        torch.testing.assert_close(loaded(torch.arange(3.0))[0], torch.tensor([0.0, 1.0, 4.0]))
    # which path ran: only this Python's own compiled code is registered under hotswitch's name
    assert type(loads_program(other, [])).forward.__code__.co_filename.startswith("<eval_with_key>")
    assert type(loaded).forward.__code__.co_filename.startswith("<hotswitch code")


def test_a_loaded_program_runs_its_code_and_builds_its_graph_only_when_read():
    """Loading an ExecGraph whose entry holds its code builds no node: running it needs the code
    alone. The first read of the graph builds it in place: the same nodes, values and code as the
    program that was stored, owned by the loaded module, and editable as any graph."""
    from hotswitch.compiler._torch import graph_built
    from hotswitch.compiler.logic_io import dumps_program, loads_program
    from tests.reference_lowering import same_program

    gm = _program_with_collectives("tp", "trunc")
    loaded = loads_program(dumps_program(gm, {"tp": 0}), ["tp-of-this-process"])
    assert not graph_built(loaded) and isinstance(loaded.graph, torch.fx.Graph)  # isinstance reads no attribute
    assert not graph_built(loaded)
    with pytest.raises(Exception, match="tp-of-this-process"):  # its code ran: the collective's group is this one
        loaded(torch.arange(6.0))
    assert not graph_built(loaded)
    nodes = list(loaded.graph.nodes)  # the first read builds it
    assert graph_built(loaded) and type(loaded.graph) is torch.fx.Graph and loaded.graph.owning_module is loaded
    assert [n.name for n in nodes] == [n.name for n in gm.graph.nodes]
    assert same_program(loaded, gm, portable=True) is None
    assert loaded.code == loaded.graph.python_code("self").src
    div = next(n for n in nodes if n.target is torch.ops.aten.div.Tensor_mode)
    div.kwargs = {"rounding_mode": "floor"}  # an edit, then the code written again, as for any graph
    loaded.recompile()
    assert "rounding_mode = 'floor'" in loaded.code
