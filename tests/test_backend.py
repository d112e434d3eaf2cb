"""hotswitch.runtime.backend on one process: how an ExecGraph runs (eager, or compiled by Inductor once,
its caches under hotswitch's), and a graph Inductor refuses running eagerly with a warning naming it."""
import os

import pytest
import torch
import torch.fx as fx

from hotswitch.runtime.backend import GraphRunner, check_backend


def _graph(fn) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(fn, (x,)),))
    return fx.GraphModule(torch.nn.Module(), g)


def _affine(x):
    return torch.ops.aten.add.Tensor(torch.ops.aten.mul.Tensor(x, 3.0), 1.0)


def _scaled_by_its_max(x):
    # a Python number read from a tensor's value: no compiled graph can hold it
    return x * float(x.max())


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="'eager'.*'inductor'"):
        check_backend("tensorrt")


def test_eager_runs_the_graph_module_itself():
    gm = _graph(_affine)
    assert GraphRunner("eager")(gm) is gm


def test_inductor_compiles_once_into_hotswitch_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    runner = GraphRunner("inductor", cache_directory=tmp_path)
    gm = _graph(_affine)
    run = runner(gm, "the affine graph")
    assert runner(gm) is run  # one compiled program per graph
    x = torch.randn(5)
    for _ in range(2):
        (out,) = run(x)
        torch.testing.assert_close(out, x * 3 + 1)
    assert runner.compiled == 1 and runner.fallbacks == [] and runner.seconds > 0
    assert any((tmp_path / "inductor").iterdir())  # Inductor's artifacts, beside hotswitch's cache
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # restored after compiling


def test_a_graph_inductor_refuses_runs_eagerly_with_a_warning(tmp_path):
    runner = GraphRunner("inductor", cache_directory=tmp_path)
    gm = _graph(_scaled_by_its_max)
    x = torch.tensor([1.0, -2.0, 4.0])
    with pytest.warns(UserWarning, match=r"Inductor could not compile dp4's step \(.*\); that graph runs eagerly"):
        (out,) = runner(gm, "dp4's step")(x)
    torch.testing.assert_close(out, x * 4.0)
    assert runner.fallbacks == ["dp4's step"] and runner.compiled == 0


def test_alike_graphs_compile_once_per_host(tmp_path):
    """Two runners on one store (as two data-parallel ranks): the first claims the graph, compiles it
    and says so; the second finds the claim, waits for that word, and gets Inductor's result from the
    cache instead of compiling again."""
    import datetime

    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from hotswitch.runtime.shared import JobOnce

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    first, second = (JobOnce(store, wait=datetime.timedelta(seconds=60)) for _ in range(2))
    second.scope = first.scope  # one job: the ranks number their scopes alike
    x = torch.randn(7)
    hits = counters["inductor"]["fxgraph_cache_hit"]
    outs = []
    for once in (first, second):
        runner = GraphRunner("inductor", cache_directory=tmp_path, once=once)
        (out,) = runner(_graph(_affine), "the step")(x)
        outs.append(out)
    assert (first.computed, first.received, second.computed, second.received) == (1, 0, 0, 1)
    assert counters["inductor"]["fxgraph_cache_hit"] == hits + 1  # the second compile was a cache hit
    torch.testing.assert_close(outs[0], outs[1])


def test_inductor_compiles_a_graph_with_hand_offs_without_them(tmp_path):
    """A training graph's hand-off calls (compiler.handoff) are Python: Inductor gets the graph
    without them, compiles it (no fallback), and an armed handler is never called from it."""
    from hotswitch.compiler.handoff import gradients_final, handing_off, is_hand_off

    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.mul.Tensor, (x, 3.0))
    g.call_function(gradients_final, ((0,), y))
    g.output((y,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    gm.graph.eliminate_dead_code()
    assert sum(is_hand_off(n) for n in gm.graph.nodes) == 1  # side-effecting: never dead code
    calls = []
    with handing_off(lambda indices, grads: calls.append(indices)):
        gm(torch.ones(2))  # eager: the hook runs
        assert calls == [(0,)]
        runner = GraphRunner("inductor", cache_directory=tmp_path)
        (out,) = runner(gm, "a step with hand-offs")(torch.ones(2))
    torch.testing.assert_close(out, torch.full((2,), 3.0))
    assert runner.compiled == 1 and runner.fallbacks == [] and calls == [(0,)]
