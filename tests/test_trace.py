"""Tracing and Megatron role inference, single process: real models we did not write, and ours."""
import pickletools

import pytest
import torch

from hotswitch.compiler.tp_rules import infer_tp_roles
from hotswitch.compiler.trace import trace
from hotswitch.models import build_hf_model, build_model

IDS = torch.randint(0, 1001, (3, 16), generator=torch.Generator().manual_seed(0))


def _roles(model):
    lg = trace(model, (IDS, IDS))
    roles = infer_tp_roles(lg.forward.graph, lg.param_names, len(lg.buffer_names))
    return lg, roles


def _role_of(lg, roles, suffix):
    (name,) = [n for n in lg.param_names if n.endswith(suffix)]
    return roles.roles[name], roles.shard_dims.get(name), roles.heads.get(name)


@pytest.fixture(scope="module")
def llama():
    return _roles(build_hf_model("llama"))


@pytest.fixture(scope="module")
def gpt2():
    return _roles(build_hf_model("gpt2"))


@pytest.fixture(scope="module")
def ours():
    return _roles(build_model("gpt-tiny", vocab_size=1001))


def test_llama_megatron_roles(llama):
    lg, roles = llama
    assert lg.split_loss and lg.seq_symbol is not None
    assert _role_of(lg, roles, "layers.0.self_attn.q_proj.weight") == ("column", 0, 4)
    assert _role_of(lg, roles, "layers.0.self_attn.k_proj.weight") == ("column", 0, 2)  # GQA: 2 kv heads
    assert _role_of(lg, roles, "layers.0.self_attn.o_proj.weight")[:2] == ("row", 1)
    assert _role_of(lg, roles, "layers.1.mlp.gate_proj.weight")[:2] == ("column", 0)
    assert _role_of(lg, roles, "layers.1.mlp.down_proj.weight")[:2] == ("row", 1)
    assert _role_of(lg, roles, "embed_tokens.weight")[:2] == ("vocab", 0)
    assert _role_of(lg, roles, "lm_head.weight")[0] == "replicate"  # feeds the log-softmax
    assert _role_of(lg, roles, "layers.0.input_layernorm.weight")[0] == "replicate"


def test_llama_on_packed_rows_keeps_the_out_projection_row_parallel():
    """Packed rows (what the Trainer compiles): the document mask, built from the input positions,
    reaches attention's output through `where`; it is not the residual stream, so o_proj still closes
    the block (column-parallel, it all-gathered the attention output twice per layer)."""
    from hotswitch.models import PackedCausalLMLoss
    from hotswitch.train.data import full_length_micro_batch

    lg = trace(PackedCausalLMLoss(build_hf_model("llama").model), full_length_micro_batch(2, 16))
    roles = infer_tp_roles(lg.forward.graph, lg.param_names, len(lg.buffer_names))
    assert _role_of(lg, roles, "layers.0.self_attn.o_proj.weight")[:2] == ("row", 1)
    assert _role_of(lg, roles, "layers.1.self_attn.q_proj.weight")[:2] == ("column", 0)
    assert _role_of(lg, roles, "layers.1.mlp.down_proj.weight")[:2] == ("row", 1)


def test_gpt2_conv1d_fused_qkv_and_tied_embedding(gpt2):
    lg, roles = gpt2
    assert lg.aliases == {"model.lm_head.weight": "model.transformer.wte.weight"}
    assert "model.lm_head.weight" not in lg.param_names  # one parameter per tied tensor
    assert _role_of(lg, roles, "h.0.attn.c_attn.weight")[0] == "replicate"  # fused q|k|v split on features
    assert _role_of(lg, roles, "h.0.attn.c_proj.weight")[:2] == ("row", 0)  # Conv1D weight is [in, out]
    assert _role_of(lg, roles, "h.0.mlp.c_fc.weight")[:2] == ("column", 1)
    assert _role_of(lg, roles, "h.0.mlp.c_fc.bias")[:2] == ("column_bias", 0)
    assert _role_of(lg, roles, "h.0.mlp.c_proj.bias")[0] == "replicate"
    assert _role_of(lg, roles, "transformer.wte.weight")[0] == "replicate"  # tied to the head
    assert _role_of(lg, roles, "transformer.wpe.weight")[0] == "replicate"  # positions, not tokens


def test_our_gpt_roles_and_joint_graph(ours):
    lg, roles = ours
    assert _role_of(lg, roles, "layers.0.attn.v_proj.weight") == ("column", 0, 2)
    assert _role_of(lg, roles, "layers.1.attn.o_proj.weight")[:2] == ("row", 1)
    assert _role_of(lg, roles, "embed.weight")[:2] == ("vocab", 0)
    outputs = next(n for n in lg.joint.graph.nodes if n.op == "output").args[0]
    assert len(outputs) == 2 + lg.num_params  # (num, den, one gradient per parameter)
    assert not any(n.op == "call_function" and getattr(n.target, "_schema", None) is not None
                   and n.target._schema.is_mutable for n in lg.joint.graph.nodes)  # functional
    forward = [n for n in lg.joint.graph.nodes if n.meta.get("nn_module_stack")]
    assert forward and all(n.meta.get("stack_trace") for n in forward)


def test_model_must_return_a_scalar_loss():
    with pytest.raises(ValueError, match="scalar loss"):
        trace(build_model("gpt-tiny", vocab_size=1001), (IDS,))


def test_sequence_stays_dynamic_when_it_equals_a_weight_dim():
    """64 tokens and a 64-wide model: symbolic tracing must not unify (and then specialize) them."""
    ids = torch.randint(0, 1001, (2, 64), generator=torch.Generator().manual_seed(1))
    lg = trace(build_model("gpt-tiny", vocab_size=1001), (ids, ids))  # dim=64
    for graph in (lg.forward.graph, lg.joint.graph):
        inputs = [n for n in graph.nodes if n.op == "placeholder"][-2:]
        sizes = [n.meta["val"].shape[1] for n in inputs]
        assert all(isinstance(s, torch.SymInt) and s.node.expr.free_symbols for s in sizes), sizes  # not 64
    assert lg.seq_symbol is not None and lg.seq_symbol.free_symbols


@pytest.mark.parametrize("pad", [(0, 1), (2, 0), (1, -1), (-2, 3, 1, 0), (0, 0, 0, 2)])
def test_constant_pad_matches_torch(pad):
    from hotswitch.compiler.trace import _constant_pad

    x = torch.arange(24.0).view(2, 3, 4)
    assert torch.equal(_constant_pad(x, pad, -7.0), torch.nn.functional.pad(x, pad, value=-7.0))


def test_hf_internal_loss_keeps_batch_and_sequence_dynamic():
    """A Hugging Face causal LM given labels pads them by one position (its own loss); aten.pad's
    kernel would pin the batch and sequence to the example's 3 x 16."""
    model = build_hf_model("llama").model
    lg = trace(model, dict(input_ids=IDS, labels=IDS.clone()))
    for graph in (lg.forward.graph, lg.joint.graph):
        shapes = [n.meta["val"].shape for n in graph.nodes if n.op == "placeholder"][-2:]
        assert all(isinstance(s, torch.SymInt) for shape in shapes for s in shape), shapes
    assert lg.call.tensor_names == ("input_ids", "labels") and lg.split_loss


def test_a_logic_graph_is_written_without_looking_up_memory_formats(ours):
    """pickle writes a torch.memory_format (clone(memory_format=...) nodes) as a global found by
    scanning sys.modules for a module that reaches it. In the ranks of a script run under hs.launch
    that can be the script's `__mp_main__`, and the entry then failed to load in the next process
    ("Can't get attribute 'torch.contiguous_format' on __mp_main__"): every run traced again.
    Memory formats are written by name instead."""
    from hotswitch.compiler.logic_io import dumps_logic, loads_logic

    lg, _ = ours
    formats = [a for g in (lg.forward, lg.joint) for n in g.graph.nodes for a in (*n.args, *n.kwargs.values())
               if isinstance(a, torch.memory_format)]
    assert formats  # otherwise this test tests nothing
    data = dumps_logic(lg)
    names = [arg for op, arg, _ in pickletools.genops(data) if op.name in ("SHORT_BINUNICODE", "BINUNICODE")]
    assert "torch.contiguous_format" not in names  # no global to look up (the saved code may mention it)
    loaded = loads_logic(data)
    assert loaded.joint.graph.python_code("self").src == lg.joint.graph.python_code("self").src
    assert [a for g in (loaded.forward, loaded.joint) for n in g.graph.nodes for a in (*n.args, *n.kwargs.values())
            if isinstance(a, torch.memory_format)] == formats


@pytest.mark.parametrize("which", ["llama", "gpt2", "ours"])
def test_a_loaded_logic_graph_is_the_traced_one(which, request):
    """One rank traces, the others load (hotswitch.runtime.shared): the loaded graphs have the same
    code (the decision cache's key), node metadata, symbolic shapes and roles, and compute the same
    loss and gradients."""
    from hotswitch.compiler.logic_io import dumps_logic, loads_logic

    lg, roles = request.getfixturevalue(which)
    loaded = loads_logic(dumps_logic(lg))
    for a, b in ((lg.forward, loaded.forward), (lg.joint, loaded.joint)):
        src = a.graph.python_code("self").src
        # the loaded graph runs the code written for the traced one (that is its own), not written again
        assert b.graph.python_code("self").src == src and a.code == src and b.code == src
        for x, y in zip(a.graph.nodes, b.graph.nodes, strict=True):
            described = [(n.name, n.target, n.meta.get("nn_module_stack"), n.meta.get("stack_trace")) for n in (x, y)]
            assert described[0] == described[1]
            vx, vy = x.meta.get("val"), y.meta.get("val")
            assert type(vx) is type(vy) and repr(vx) == repr(vy), (x.name, vx, vy)
            if isinstance(vx, torch.Tensor):
                assert (str(vx.stride()), vx.dtype, vx.requires_grad) == (str(vy.stride()), vy.dtype, vy.requires_grad)
    assert loaded.seq_symbol == lg.seq_symbol and loaded.param_names == lg.param_names
    assert repr(loaded.call) == repr(lg.call) and loaded.aliases == lg.aliases and loaded.split_loss == lg.split_loss
    assert infer_tp_roles(loaded.forward.graph, loaded.param_names, len(loaded.buffer_names)) == roles

    torch.manual_seed(0)
    params = [torch.randn(lg.param_shapes[n], dtype=lg.param_dtypes[n]) for n in lg.param_names]
    placeholders = [n for n in lg.joint.graph.nodes if n.op == "placeholder"]
    n_p, n_b = len(params), len(lg.buffer_names)
    buffers = [torch.rand(tuple(n.meta["val"].shape)) for n in placeholders[n_p:n_p + n_b]]
    ids = torch.randint(0, 1001, (2, 9))
    expected, got = lg.joint(params, buffers, [ids, ids]), loaded.joint(params, buffers, [ids, ids])
    assert len(expected) == len(got) and all(torch.equal(e, g) for e, g in zip(expected, got))


def test_tracing_pauses_the_garbage_collector_and_restores_it(monkeypatch):
    """Full collections walk every live object and tracing makes millions (compiler.garbage): the
    collector is off while a model is traced, and as it was afterwards (on, or left off by the caller)."""
    import gc

    from hotswitch.compiler import trace as trace_module

    seen, make_joint = [], trace_module._make_joint
    monkeypatch.setattr(trace_module, "_make_joint", lambda *a: (seen.append(gc.isenabled()), make_joint(*a))[1])
    assert gc.isenabled()
    trace(build_model("gpt-tiny", vocab_size=1001), (IDS, IDS))
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        trace(build_model("gpt-tiny", vocab_size=1001), (IDS, IDS))
        assert seen == [False, False] and not gc.isenabled()  # a caller's choice is kept
    finally:
        gc.enable()


def test_a_trace_writes_code_only_for_the_graphs_it_keeps(monkeypatch):
    """Export's passes and make_fx each wrote the Python code of a module nothing read (9 modules per
    trace). They now build their modules without code (`compiler._torch.codeless_modules`), and the
    graphs a LogicGraph keeps are plain GraphModules whose code, written once, is their graph's."""
    written, write = [], torch.fx.Graph.python_code

    def writing(graph, *args, **kwargs):
        written.append(len(graph.nodes))
        return write(graph, *args, **kwargs)

    monkeypatch.setattr(torch.fx.Graph, "python_code", writing)
    lg = trace(build_model("gpt-tiny", vocab_size=1001), (IDS, IDS))
    assert 2 <= len(written) <= 3, written  # the joint, the forward (and export's own module)
    for gm in (lg.joint, lg.forward):
        assert all(c.__name__ != "_LazyGraphModule" for c in type(gm).__mro__)
        assert gm.code == write(gm.graph, "self").src


class _MeanSquaredError(torch.nn.Module):
    """A loss that is no division before decomposing (a mean): traced the two-pass way, unsplit."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.proj(x), y)


@pytest.mark.parametrize("which", ["ours", "hf_internal_loss", "mse"])
def test_the_logic_graph_computes_the_models_loss_and_gradients(which, monkeypatch):
    """A loss that is a division before decomposing (ours: a sum over a count; Hugging Face's mean
    cross-entropy, given labels or not) is split and traced in one pass, the forward cut out of the
    joint graph; any other goes through the decomposed forward first. Either way the graphs give the
    model's loss and its gradients (the joint differentiates the numerator: the loss times `den`)."""
    import hotswitch.compiler.trace as T
    from hotswitch.compiler.signature import LossModule, ModelCall

    torch.manual_seed(0)
    if which == "mse":
        model, inputs = _MeanSquaredError(), (torch.randn(3, 5, 8), torch.randn(3, 5, 8))
    elif which == "hf_internal_loss":  # a mean cross-entropy (the Hugging Face loss wrapper's is one too)
        model, inputs = build_hf_model("llama").model, dict(input_ids=IDS, labels=IDS.clone())
    else:
        model, inputs = build_model("gpt-tiny", vocab_size=1001), (IDS, IDS)
    decomposed = []
    two_pass = T._decompose
    monkeypatch.setattr(T, "_decompose", lambda *a: decomposed.append(1) or two_pass(*a))
    lg = trace(model, inputs)
    assert (len(decomposed), lg.split_loss) == ((1, False) if which == "mse" else (0, True))

    flat = lg.call.flatten_example(inputs)
    state = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    params = [state[n].detach() for n in lg.param_names]
    buffers = [state[n] for n in lg.buffer_names]
    loss = LossModule(model, ModelCall.of(model, inputs))(*flat)
    model.zero_grad()
    loss.backward()
    forward = lg.forward(*params, *buffers, *flat)
    den = forward[1] if lg.split_loss else torch.tensor(1.0)
    assert torch.allclose(forward[0] / den, loss, rtol=1e-5, atol=0)
    joint = lg.joint(params, buffers, list(flat))
    for name, grad in zip(lg.param_names, joint[2 if lg.split_loss else 1:]):
        expected = dict(model.named_parameters())[name].grad * den
        error = ((grad - expected).norm() / expected.norm().clamp_min(1e-12)).item()  # summation order differs
        assert error < 1e-5, (name, error)
