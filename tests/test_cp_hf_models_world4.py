"""Context parallelism on Hugging Face causal LMs as a user calls them (keyword `input_ids` and
`labels`, the labels shifted inside the model, its `.loss`), on 4 gloo processes: GPT-2 (fused
`c_attn` split along its features, learned positions, tied head), Llama (grouped-query attention,
RoPE), Qwen2 (biased q/k/v, tied head) and Phi-3 (fused q/k/v and gate/up projections) under cp4,
dp2cp2 and tp2cp2 at a length cp divides, and at one it does not under one of them per model, each
config with some model (torch.chunk's pieces: the last rank holds fewer positions, or none); GPT-2
also packed into documents with their ids, in the document layout and, at the uneven length, in the
contiguous one. Each equal to one device. OPT under cp4 and dp2cp2, every rank lowering the same
collectives.
Also: the redistributions of [batch x seq] rows those configs lower when a fused projection is
replicated over tp (the rows strided over cp, then split over tp), and the errors of an op that
cannot be sharded along the sequence and of a lowering that fails.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hotswitch as hs
from hotswitch.compiler import _dtensor as dt
from hotswitch.models import PackedCausalLMLoss, build_hf_model, document_ids_of
from tests.compile_checks import rel_err
from tests.distributed import dist_fixture

pytestmark = pytest.mark.slow  # spawns gloo processes and compiles

CONFIGS = ("cp4", "dp2cp2", "tp2cp2")
VOCAB = 97
EVEN, UNEVEN = 8, 5  # 5: 2, 2, 1 and 0 positions over cp4 (torch.chunk's pieces), 3 and 2 over cp2
TINY = {"gpt2": dict(n_embd=32, n_layer=1, n_positions=64),
        **{kind: dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, max_position_embeddings=64)
           for kind in ("llama", "qwen2", "phi3")}}


def _batch(length: int, rows: int = 2) -> dict:
    ids = torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(length))
    return dict(input_ids=ids, labels=ids)  # as Hugging Face takes them: the model shifts the labels


def _packed_batch(length: int = EVEN) -> tuple:
    """Two rows of documents (positions restart per document), with their ids."""
    documents = {EVEN: ([3, 5], [1, 4, 3]), UNEVEN: ([2, 3], [5])}[length]
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in documents])
    ids = torch.randint(0, VOCAB, positions.shape, generator=torch.Generator().manual_seed(3))
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[positions.roll(-1, dims=1) == 0] = -100  # no target across a document boundary
    return ids, positions, labels, document_ids_of(positions)


def _errors(cm, inputs, ref_model, configs=CONFIGS) -> dict:
    """Per config of `configs`: (the loss's relative error, the worst gradient's) against `ref_model`
    on the whole batch (`inputs`: keyword inputs of a Hugging Face model, or positional ones). A
    gradient that is zero in exact arithmetic (a key projection's bias: softmax ignores a shift every
    key shares) is rounding noise on both sides: its error is taken against a thousandth of the
    largest gradient instead of its own size."""
    ref = copy.deepcopy(ref_model)
    out = ref(**inputs) if isinstance(inputs, dict) else ref(*inputs)
    loss_ref = out.loss if hasattr(out, "loss") else out
    loss_ref.backward()
    errors = {}
    for name in configs:
        cm.switch(name)
        cm.zero_grad()
        if isinstance(inputs, dict):
            loss = cm.forward_backward(**cm.shard_inputs(**inputs))
        else:
            loss = cm.forward_backward(*cm.shard_inputs(*inputs))
        grads = cm.full_grads()
        refs = {n: p.grad for n, p in ref.named_parameters()}
        floor = 1e-3 * max(g.norm().item() for g in refs.values())
        errors[name] = (rel_err(loss, loss_ref.detach()),
                        max((grads[n] - g).norm().item() / max(g.norm().item(), floor) for n, g in refs.items()))
    return errors


def _equivalence(kind: str, document: bool, uneven: str) -> dict:
    """The model compiled once for the three configs, run at the even length under each and at the
    uneven length under `uneven` (each config meets the uneven length with some model: every such
    length is lowered, seconds each); with `document`, then packed documents with their ids
    (PackedCausalLMLoss, as the Trainer calls it: attention is `document_attention`, its keys and
    values fetched by the runtime) in the document layout, and at the uneven length in the
    contiguous one."""
    torch.manual_seed(0)  # the same weights on every rank
    model = build_hf_model(kind, vocab_size=VOCAB, **TINY[kind]).model
    cm = hs.compile(model, _batch(EVEN), configs=list(CONFIGS))
    errors = {("contiguous", EVEN): _errors(cm, _batch(EVEN), model),
              ("contiguous", UNEVEN): _errors(cm, _batch(UNEVEN), model, (uneven,))}
    if document:
        packed = PackedCausalLMLoss(model)
        documents = hs.compile(packed, _packed_batch(), configs=list(CONFIGS), cp_layout="document")
        errors["document", EVEN] = _errors(documents, _packed_batch(), packed)
        documents.cp_layout = "contiguous"
        errors["contiguous with document ids", UNEVEN] = _errors(documents, _packed_batch(UNEVEN), packed,
                                                                 (uneven,))
    return errors


# Llama's document and zigzag layouts: tests/test_cp_attention_world4.py; Qwen2's and Phi-3's attention is
# Llama's (a trace of each model costs seconds: the packed models are traced where they add a case)
UNEVEN_UNDER = {"gpt2": "tp2cp2", "llama": "cp4", "qwen2": "dp2cp2", "phi3": "cp4"}  # cp4: a rank holds none


def check_gpt2():
    return _equivalence("gpt2", document=True, uneven=UNEVEN_UNDER["gpt2"])


def check_llama():
    return _equivalence("llama", document=False, uneven=UNEVEN_UNDER["llama"])


def check_qwen2():
    return _equivalence("qwen2", document=False, uneven=UNEVEN_UNDER["qwen2"])


def check_phi3():
    return _equivalence("phi3", document=False, uneven=UNEVEN_UNDER["phi3"])


def check_opt_ranks_lower_alike_collectives():
    """OPT (positions from the attention mask's cumsum, offset by 2; a layer norm's backward over
    [batch x seq] rows strided over cp) under cp4 and dp2cp2: every rank lowers the same
    collectives, compared before the first step, and each config equals one device. Ranks that
    replay another's decisions build the strided rows' specs themselves; built unlike DTensor's
    (a shard order, not a view's stride), they priced that backward otherwise, gathered its inputs,
    and the step hung."""
    import torch.distributed as dist
    import transformers

    from hotswitch.compiler.lower import collective_kind, collectives

    config = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=1,
                                    num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                                    dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    torch.manual_seed(0)  # the same weights on every rank
    model = transformers.OPTForCausalLM(config)
    configs = ("cp4", "dp2cp2")
    cm = hs.compile(model, _batch(EVEN), configs=list(configs))
    for name in configs:
        mine = [(collective_kind(n), tuple(n.meta["val"].shape)) for n in collectives(cm.exec_graph(name))]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        assert all(theirs == mine for theirs in everyone), (name, everyone)
    return _errors(cm, _batch(EVEN), model, configs)


def _piece(x: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's piece of `x`, placements composed in mesh order with torch.chunk's sizes (a
    _StridedShard: every one of its split-factor pieces chunked, this rank's chunks concatenated)."""
    def chunk(index, k, c):
        step = -(-len(index) // k) if len(index) else 0
        return index[min(c * step, len(index)):min((c + 1) * step, len(index))]

    index = [torch.arange(n) for n in x.shape]
    for i, p in enumerate(placements):
        c, n = mesh.get_local_rank(i), mesh.size(i)
        if isinstance(p, dt.StridedShard):
            index[p.dim] = torch.cat([chunk(chunk(index[p.dim], p.split_factor, j), n, c)
                                      for j in range(p.split_factor)])
        elif isinstance(p, dt.Shard):
            index[p.dim] = chunk(index[p.dim], n, c)
    return x[index[0]][:, index[1]]


def check_nested_strided_redistributions():
    """[rows x seq] flattened rows strided over one mesh axis and split again over the other (cp
    then tp, or dp then cp), even and uneven (one rank's piece empty), moved to other layouts: every
    rank's result is its piece of the target. DTensor's planner sized tp's gather after cp's stride
    as the whole dim ("Expected cond to be True"), and aborted gloo on uneven strided gathers."""
    S, R = dt.Shard, dt.Replicate
    failures, cases = [], 0
    for names in (("cp", "tp"), ("dp", "cp")):
        mesh = dt.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=names)
        for rows, length in ((4, 6), (3, 5), (2, 5), (1, 3)):
            x = torch.arange(rows * length * 3, dtype=torch.float32).view(rows * length, 3)
            ss = dt.StridedShard(0, split_factor=rows)
            moves = [((ss, S(0)), (ss, R())), ((ss, S(0)), (R(), R())), ((ss, S(0)), (R(), S(0))),
                     ((ss, R()), (ss, S(0))), ((ss, S(0)), (ss, S(1))), ((ss, S(1)), (R(), R())),
                     ((S(0), ss), (R(), ss)), ((S(0), ss), (R(), R())), ((S(0), ss), (S(0), R())),
                     ((S(0), ss), (ss, S(0)))]
            for src, dst in moves:
                cases += 1
                got = dt.redistribute(_piece(x, mesh, src), dt.make_spec(mesh, src, x), dt.make_spec(mesh, dst, x))
                if not torch.equal(got, _piece(x, mesh, dst)):
                    failures.append((names, rows, length, src, dst))
    return cases, failures


class LocalWindows(nn.Module):
    """Windows of three tokens averaged by `Tensor.unfold` over the sequence, each predicting the
    token after it: an op DTensor has no sharding rule for."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)

    def forward(self, ids, labels):
        h = self.embed(ids).unfold(1, 3, 1).mean(-1)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels[:, 2:].flatten())


def check_unshardable_op_names_the_fix():
    """Under dp2cp2, windows over the sequence: hs.compile names the op, its module and line, the
    config, and what runs it; with strict=False it runs with its inputs gathered, equal to one device."""
    torch.manual_seed(0)
    model = LocalWindows()
    ids = torch.randint(0, VOCAB, (4, 7), generator=torch.Generator().manual_seed(0))
    labels = ids.roll(-1, 1)
    try:
        hs.compile(model, (ids, labels), configs=["dp2cp2"])
        message = None
    except ValueError as e:
        message = f"{type(e).__name__}: {e}"
    cm = hs.compile(model, (ids, labels), configs=["dp2cp2"], strict=False)
    loss = cm.forward_backward(*cm.shard_inputs(ids, labels))
    return message, rel_err(loss, model(ids, labels).detach())


class Bigram(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)

    def forward(self, ids, labels):
        h = self.embed(ids)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def check_failed_lowering_names_the_node():
    """A redistribution that fails while a program is lowered (as DTensor's unpadding check did for
    GPT-2 under tp2cp2) is said with the node it ran for, its module, the config and the way on,
    not as DTensor's bare message."""
    import os
    from unittest import mock

    def failing(local, src, dst):
        raise RuntimeError("Expected cond to be True, but got False.")

    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    # lowered here, not loaded from the compile cache
    with mock.patch.dict(os.environ, {"HOTSWITCH_CACHE": "0"}), mock.patch.object(dt, "redistribute", failing):
        try:
            hs.compile(Bigram(), (ids, ids.roll(-1, 1)), configs=["tp2cp2"])
        except ValueError as e:
            return f"{type(e).__name__}: {e}"
    return None


results = dist_fixture(4, [check_nested_strided_redistributions, check_unshardable_op_names_the_fix,
                           check_failed_lowering_names_the_node,
                           check_gpt2, check_llama, check_qwen2, check_phi3, check_opt_ranks_lower_alike_collectives])


def _assert_equal_to_one_device(errors: dict, document: bool, uneven: str) -> None:
    documents = [("document", EVEN), ("contiguous with document ids", UNEVEN)] if document else []
    assert set(errors) == {("contiguous", EVEN), ("contiguous", UNEVEN), *documents}, errors
    for (layout, length), by_config in errors.items():
        assert set(by_config) == ({uneven} if length == UNEVEN else set(CONFIGS)), by_config
        for name, (loss_err, grad_err) in by_config.items():
            assert loss_err <= 1e-5 and grad_err <= 1e-4, (layout, length, name, loss_err, grad_err)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2", "phi3"])
def test_hf_model_under_cp_configs_equals_one_device(results, kind):
    for errors in results[f"check_{kind}"].raise_if_failed():
        _assert_equal_to_one_device(errors, document=kind == "gpt2", uneven=UNEVEN_UNDER[kind])


def test_opt_ranks_lower_alike_collectives_and_equal_one_device(results):
    for errors in results["check_opt_ranks_lower_alike_collectives"].raise_if_failed():
        assert set(errors) == {"cp4", "dp2cp2"}, errors
        assert all(loss <= 1e-5 and grad <= 1e-4 for loss, grad in errors.values()), errors


def test_nested_strided_redistributions_give_every_rank_its_piece(results):
    for cases, failures in results["check_nested_strided_redistributions"].raise_if_failed():
        assert cases == 80 and failures == [], failures


def test_an_op_that_cannot_be_sharded_along_the_sequence_names_the_fix(results):
    for message, loss_err in results["check_unshardable_op_names_the_fix"].raise_if_failed():
        assert message is not None and message.startswith("ShardingError: 'dp2cp2' "), message
        assert "graph node 'unfold' (aten.unfold.default) in the model's own forward" in message, message
        assert "test_cp_hf_models_world4.py" in message, message
        assert "h = self.embed(ids).unfold(1, 3, 1).mean(-1)" in message, message
        assert "input placements: [(Shard(dim=0), Shard(dim=1))]" in message, message
        assert "replicated over dp and cp" in message and "strict=False" in message, message
        assert "leave 'dp2cp2' out of the configs" in message, message
        assert loss_err <= 1e-5, loss_err


def test_a_failed_lowering_names_the_node_and_the_config(results):
    for message in results["check_failed_lowering_names_the_node"].raise_if_failed():
        assert message is not None and message.startswith(
            "ShardingError: 'tp2cp2' cannot run graph node 'embedding' (aten.embedding.default) in embed (Embedding), "
            'from File "'), message
        assert "test_cp_hf_models_world4.py" in message and "in forward: h = self.embed(ids): " in message, message
        assert "lowering it failed (RuntimeError: Expected cond to be True, but got False.)" in message, message
        assert "Leave 'tp2cp2' out of the configs to go on, and report this." in message, message
