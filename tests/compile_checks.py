"""Helpers shared by the multi-process compile tests (run inside the harness's workers)."""
from __future__ import annotations

import copy
import os
import re
from collections import Counter
from unittest import mock

import torch

import hotswitch as hs
from hotswitch.compiler.lower import collectives
from hotswitch.models import build_hf_model, build_model

VOCAB = 1001  # divides by neither 2 nor 4: vocab-parallel shards are uneven
BATCH = 5     # divides by neither 2 nor 4: data-parallel shards are uneven
SEQ = 12


def batch(batch=BATCH, seq=SEQ, vocab=VOCAB, seed=0):
    """Token ids and next-token labels (-100 at the end and on a few masked positions)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[0, :3] = -100
    return ids, labels


def make_model(kind: str, **overrides):
    torch.manual_seed(0)  # identical weights on every rank
    if kind in ("llama", "gpt2"):
        return build_hf_model(kind, vocab_size=VOCAB, **overrides)
    return build_model("gpt-tiny", vocab_size=VOCAB, **overrides)


def reference(model, ids, labels):
    ref = copy.deepcopy(model)
    loss = ref(ids, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.detach() for n, p in ref.named_parameters()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.norm().item()
    return (a - b).norm().item() / scale if scale > 0 else (a - b).norm().item()


def assert_equivalent(kind: str, configs, tol: float = 1e-5, extra_seq: int | tuple[int, ...] | None = 7) -> dict:
    """Loss and every full gradient of every config within `tol` relative of the single-device model;
    then, under the last config, at each other length of `extra_seq`."""
    model = make_model(kind)
    ids, labels = batch()
    loss_ref, grads_ref = reference(model, ids, labels)
    state_ref = {k: v.clone() for k, v in model.state_dict().items()}
    cm = hs.compile(model, (ids, labels), configs=configs)
    assert [c.name for c in cm.configs] == [c.name for c in configs]
    report = {}
    for config in configs:
        cm.switch(config.name)
        assert cm.active == config.name
        cm.zero_grad()
        local = cm.shard_inputs(ids, labels)
        loss = cm.forward_backward(*local)
        assert abs(loss.item() - loss_ref.item()) <= tol * abs(loss_ref.item()), (config.name, loss, loss_ref)
        forward_only = cm(*local)
        assert abs(forward_only.item() - loss_ref.item()) <= tol * abs(loss_ref.item()), (config.name, forward_only)
        grads = cm.full_grads()
        assert set(grads) == set(grads_ref), (set(grads) ^ set(grads_ref))
        worst = max(grads_ref, key=lambda n: rel_err(grads[n], grads_ref[n]))
        assert rel_err(grads[worst], grads_ref[worst]) <= tol, (
            config.name,
            worst,
            rel_err(grads[worst], grads_ref[worst]),
        )
        state = cm.full_state_dict()
        assert set(state) == set(state_ref)
        assert all(torch.equal(state[k], state_ref[k]) for k in state_ref), config.name
        report[config.name] = collective_counts(cm.exec_graph(config.name))
        # whether this rank loaded its training program (from a dp rank that lowered it for both)
        report.setdefault("loaded", {})[config.name] = any(
            program.loaded for key, program in cm._state(config.name).programs.items() if key[1])  # key[1]: train
    # the LogicGraph is dynamic in the sequence length: another length compiles on demand
    for seq in (extra_seq,) if isinstance(extra_seq, int) else extra_seq or ():
        ids2, labels2 = batch(seq=seq, seed=1)
        loss_ref2, grads_ref2 = reference(model, ids2, labels2)
        cm.zero_grad()
        loss2 = cm.forward_backward(*cm.shard_inputs(ids2, labels2))
        assert abs(loss2.item() - loss_ref2.item()) <= tol * abs(loss_ref2.item()), (seq, loss2, loss_ref2)
        grads2 = cm.full_grads()
        assert max(rel_err(grads2[n], grads_ref2[n]) for n in grads_ref2) <= tol, seq
    return report


def collective_counts(gm, phase=None) -> dict[str, int]:
    return dict(Counter(_kind(n) for n in collectives(gm, phase)))


def _kind(node) -> str:
    return str(node.target).split(".")[1].replace("_into_tensor", "").replace("_tensor", "")


_BLOCK = re.compile(r"layers\.(\d+)\.(attn|self_attn|mlp)$")


def forward_collectives_per_block(gm) -> dict[str, dict[str, int]]:
    """Forward collectives grouped by the transformer sub-block (attention / MLP) they belong to."""
    out: dict[str, Counter] = {}
    for n in collectives(gm, "forward"):
        paths = [path for path, _ in n.meta.get("nn_module_stack", {}).values()]
        blocks = [m.group(0) for p in paths for m in [_BLOCK.search(p)] if m]
        key = blocks[-1] if blocks else "outside blocks"
        out.setdefault(key, Counter())[_kind(n)] += 1
    return {k: dict(v) for k, v in out.items()}


def replay_equals_fresh(kind: str, config, seqs=(SEQ, 20), **overrides) -> dict:
    """Lower `config` at seqs[0] then at seqs[1] (the second replays the first's decisions) and, in
    another compiled model, at seqs[1] directly (DTensor's search): the same placements (every op's,
    read off the sharding each lowering propagated), the same collectives and the same numbers."""
    from hotswitch.compiler import program

    model = make_model(kind, **overrides)
    first, later = batch(seq=seqs[0]), batch(seq=seqs[1])
    shapes = tuple(tuple(x.shape) for x in later)
    propagated, real = [], program.propagate_graph  # the GraphSharding of each lowering (a program keeps none)

    def propagate(*args, **kwargs):
        propagated.append(real(*args, **kwargs))
        return propagated[-1]

    def lowering_once(lower):
        """`lower()` and the sharding of the one lowering it ran (not a program loaded instead)."""
        before = len(propagated)
        made = lower()
        assert len(propagated) == before + 1, f"{len(propagated) - before} lowerings, not 1"
        return made, propagated[-1]

    os.environ["HOTSWITCH_CACHE"] = "0"  # the fresh lowering must search, not find the first one's decisions
    try:
        with mock.patch.object(program, "propagate_graph", propagate):
            replayed = hs.compile(model, first, configs=[config])
            # the same graph, its own decisions; then seqs[1] replaying seqs[0]'s
            fresh, fresh_sharding = lowering_once(
                lambda: hs.compile(model, later, configs=[config], logic=replayed.logic))
            _, replayed_sharding = lowering_once(lambda: replayed.exec_graph(config.name, shapes))
    finally:
        del os.environ["HOTSWITCH_CACHE"]
    out = {}
    for label, cm, sharding in (("replayed", replayed, replayed_sharding), ("fresh", fresh, fresh_sharding)):
        gm = cm.exec_graph(config.name, shapes)
        placements = {n.name: str((tuple(tuple(w.placements) for w in d.want_specs),
                                   d.spec.placements if hasattr(d.spec, "placements") else None))
                      for n, d in sharding.decisions.items() if d.kind == "op"}
        coll = [(str(n.target), tuple(a for a in n.args[1:] if not isinstance(a, str))) for n in collectives(gm)]
        cm.zero_grad()
        loss = cm.forward_backward(*cm.shard_inputs(*later))
        out[label] = dict(placements=placements, collectives=coll, loss=float(loss), replayed=sharding.replayed,
                          searched=sharding.searched, grads={k: v.clone() for k, v in cm.full_grads().items()})
    return out


def fitted_equals_replayed(kind: str, config, seqs=(SEQ, 16), later=(20, 18)) -> dict:
    """Lower `config` at the lengths `seqs` (the second replays the first's decisions), then at each
    of `later`: written from the fit of the two (`compiler.lengths`) where it holds, lowered where
    it does not. Another compiled model replays the first length's decisions at each later length:
    the same program node for node, the same loss and gradients, and both equal to one device."""
    from tests.reference_lowering import same_program

    model = make_model(kind)
    os.environ["HOTSWITCH_CACHE"] = "0"  # the second length is a replay here, not an entry on disk
    try:
        cm = hs.compile(model, batch(seq=seqs[0]), configs=[config])
        replayed = hs.compile(model, batch(seq=seqs[0]), configs=[config], logic=cm.logic)
    finally:
        del os.environ["HOTSWITCH_CACHE"]
    name = config.name
    cm.exec_graph(name, tuple(tuple(x.shape) for x in batch(seq=seqs[1])))
    out = {}
    for seq in later:
        ids, labels = batch(seq=seq)
        shapes = (tuple(ids.shape), tuple(labels.shape))
        loss_ref, grads_ref = reference(model, ids, labels)
        row, programs = {}, []
        replayed._state(name).lengths.clear()  # its one earlier length: this one is replayed, not fitted
        for label, c in (("fitted", cm), ("replayed", replayed)):
            gm = c.exec_graph(name, shapes)
            programs.append(gm)
            (program,) = [p for p in c._state(name).programs.values() if p.joint is gm]
            c.zero_grad()
            loss = c.forward_backward(*c.shard_inputs(ids, labels))
            grads = c.full_grads()
            fits = [f.fit for f in c._state(name).lengths.values() if f.fit is not None]
            row[label] = dict(fitted=program.fitted, loss=float(loss),
                              # its code: fx's for its graph, written from the first program's (a fit's template)
                              code_is_the_graphs=gm.code == gm.graph.python_code("self").src,
                              templated=bool(fits) and all(f.code is not None for f in fits),
                              loss_err=abs(loss.item() - loss_ref.item()) / loss_ref.item(),
                              grad_err=max(rel_err(grads[n], grads_ref[n]) for n in grads_ref),
                              grads={k: v.clone() for k, v in grads.items()})
        row["difference"] = same_program(*programs, portable=True)  # None: the same graph, node for node
        out[seq] = row
    return out


def lowering_equals_make_fx(kind: str, configs, **overrides) -> list[str | None]:
    """Compile `configs` (one trace) with every program built twice: by `compiler.lower.lower` and by
    the make_fx interpreter of `tests.reference_lowering`. The first difference per program (None:
    the same graph, and the code fx writes for it: `compiler._torch.python_code` wrote it), in the
    order the programs were lowered."""
    import hotswitch.compiler.program as program
    from hotswitch.compiler.attention import fuse_attention
    from hotswitch.compiler.lower import (
        SOURCE_META,
        add_hand_offs,
        hand_off_early,
        issue_reductions_early,
        wait_where_read,
    )
    from hotswitch.compiler.reduce import BUCKET_BYTES
    from tests.reference_lowering import lower_by_make_fx, same_program

    found: list[str | None] = []
    original = program.lower

    def both(graph, sharding, local, plan, mesh, bucket_bytes=BUCKET_BYTES, device=None, traced=None,
             reduce_early=False, attention=None, codeless=False, fsdp=None, config=""):
        assert fsdp is None, "the make_fx interpreter lowers no fsdp program"
        gm = original(graph, sharding, local, plan, mesh, bucket_bytes, device=device, traced=traced,
                      reduce_early=reduce_early, attention=attention, codeless=codeless, config=config)
        expected = lower_by_make_fx(graph, sharding, local, plan, mesh, bucket_bytes, device)
        add_hand_offs(expected.graph, sharding.output_specs, plan, bucket_bytes)
        if attention is not None:  # torch's kernels for the runner's device, written in alike, and
            fuse_attention(expected.graph, *attention, keep_meta=SOURCE_META)
            expected.graph.eliminate_dead_code()  # what a causal kernel leaves unread (the mask) dropped
        if reduce_early:  # the graph passes `lower` applies, applied to the interpreter's trace alike
            issue_reductions_early(expected.graph)
            hand_off_early(expected.graph)
        wait_where_read(expected.graph)
        expected.recompile()
        by_fx = torch.fx.Graph.python_code(gm.graph, "self")
        fx_wrote = (gm.code, gm._lineno_map, gm._prologue_start) == \
            (by_fx.src, by_fx._lineno_map, by_fx._prologue_start)
        found.append(same_program(gm, expected) or (None if fx_wrote else "its code is not the code fx writes"))
        return gm

    os.environ["HOTSWITCH_CACHE"] = "0"  # every program lowered here, none loaded
    program.lower = both
    try:
        hs.compile(make_model(kind, **overrides), batch(), configs=list(configs))
        return found
    finally:
        program.lower = original
        del os.environ["HOTSWITCH_CACHE"]


def second_pass_equals_deciding_again(kind: str, configs) -> list[tuple[str | None, int]]:
    """Compile `configs` with each placement search run twice: as `propagate_graph` runs it (its
    second pass reuses the first pass's decision for every op whose inputs arrive as they did) and
    with every op of the second pass decided again. Per search, in order: the first difference (None:
    the same decisions, specs, reductions and arguments for every node) and the decisions reused."""
    import hotswitch.compiler.program as program
    import hotswitch.compiler.propagate as propagate

    found: list[tuple[str | None, int]] = []
    original, reuse = program.propagate_graph, propagate._as_before
    reused = [0]  # decisions the search being run reused

    def counted(d, specs):
        out = reuse(d, specs)
        reused[0] += out is not None
        return out

    def both(*args, **kwargs):
        reused[0] = 0
        propagate._as_before = counted
        try:
            got = original(*args, **kwargs)
        finally:
            propagate._as_before = reuse
        if kwargs.get("decided") is None:  # a search (a replay has no second pass)
            propagate._as_before = lambda d, specs: None
            try:
                again = original(*args, **kwargs)
            finally:
                propagate._as_before = reuse
            found.append((_first_difference(got, again), reused[0]))
        return got

    os.environ["HOTSWITCH_CACHE"] = "0"  # every program lowered here, none loaded
    program.propagate_graph = both
    try:
        hs.compile(make_model(kind), batch(), configs=list(configs))
        return found
    finally:
        program.propagate_graph = original
        del os.environ["HOTSWITCH_CACHE"]


def alike_ops_equal_deciding_each(kind: str, configs, lengths=(SEQ, 16)) -> list[tuple[str, str | None, int]]:
    """Compile `configs` and lower each at `lengths` (the first searched, the next replayed), every
    propagation run twice: as `propagate_graph` runs it (an op alike an earlier one, a repeated
    block's, takes that one's decision: `propagate._AlikeOps`) and with every op decided on its own. Per
    propagation: "search" or "replay", the first difference (None: the same decisions, specs,
    reductions and arguments for every node) and the decisions taken from an alike op."""
    import hotswitch.compiler.program as program
    import hotswitch.compiler.propagate as propagate

    found: list[tuple[str, str | None, int]] = []
    original, decision = program.propagate_graph, propagate._AlikeOps.decision
    served = [0]

    def counted(self, node, how, decide):
        decided = []
        d = decision(self, node, how, lambda: decided.append(1) or decide())
        served[0] += not decided  # an alike op's decision, nothing decided for this one
        return d

    def both(*args, **kwargs):
        served[0] = 0
        with mock.patch.object(propagate._AlikeOps, "decision", counted):
            got = original(*args, **kwargs)
        with mock.patch.object(propagate._AlikeOps, "decision", lambda self, node, how, decide: decide()):
            alone = original(*args, **kwargs)
        found.append(("search" if kwargs.get("decided") is None else "replay", _first_difference(got, alone),
                      served[0]))
        return got

    os.environ["HOTSWITCH_CACHE"] = "0"  # every program lowered here, none loaded
    program.propagate_graph = both
    try:
        cm = hs.compile(make_model(kind), batch(seq=lengths[0]), configs=list(configs))
        for config in configs:
            for seq in lengths[1:]:
                cm.exec_graph(config.name, tuple(tuple(x.shape) for x in batch(seq=seq)))
        return found
    finally:
        program.propagate_graph = original
        del os.environ["HOTSWITCH_CACHE"]


def _first_difference(a, b) -> str | None:
    if a.keep_partial != b.keep_partial or a.output_specs != b.output_specs:
        return "kept partials or output specs"
    fields = ("kind", "value", "tensor_nodes", "in_specs", "want_specs", "args", "kwargs", "out_spec", "reduce_to",
              "replayable")
    for node, d in a.decisions.items():
        e = b.decisions[node]
        for f in fields:
            if not _alike(getattr(d, f), getattr(e, f)):
                return f"{node.name}.{f}: {getattr(d, f)!r} != {getattr(e, f)!r}"
    return None if a.decisions.keys() == b.decisions.keys() else "nodes"


def _alike(x, y) -> bool:
    """Equal, a _MaskPartial aside: two propagations each make their own (DTensor compares them by
    the identity of the mask they carry), so placements are compared as `encode_placements` writes them."""
    from hotswitch.compiler import _dtensor as dt

    if isinstance(x, dt.DTensorSpec) and isinstance(y, dt.DTensorSpec):
        return (x.mesh == y.mesh and x.tensor_meta == y.tensor_meta
                and dt.encode_placements(x.placements) == dt.encode_placements(y.placements))
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        return type(x) is type(y) and len(x) == len(y) and all(map(_alike, x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_alike(x[k], y[k]) for k in x)
    return x == y


def eager_vs_inductor(kind: str, config: str, micro_batches: int = 1, rows: int | None = None, tol: float = 1e-5,
                      **overrides) -> dict:
    """Compile `kind` under `config` with both backends, run one step of the same batch, and compare
    each with the other and with the single-device model (relative errors, asserted <= tol). Returns
    the errors, how many graphs Inductor compiled here, and how many alike graphs this rank waited
    for another rank to compile (then loaded from Inductor's cache)."""
    model = make_model(kind, **overrides)
    ids, labels = batch() if rows is None else batch(batch=rows)
    loss_ref, grads_ref = reference(model, ids, labels)
    runs = {}
    for backend in ("eager", "inductor"):
        cm = hs.compile(model, (ids, labels), configs=[config], backend=backend)
        loss = cm.forward_backward(*cm.shard_inputs(ids, labels), micro_batches=micro_batches)
        runs[backend] = (loss, cm.full_grads(), cm.graph_runner)
    (loss_e, grads_e, _), (loss_i, grads_i, runner) = runs["eager"], runs["inductor"]
    assert runner.backend == "inductor" and runner.compiled >= 1, runner.compiled
    assert not runner.fallbacks, f"graphs left eager: {runner.fallbacks}"
    errors = {
        "loss vs eager": rel_err(loss_i, loss_e),
        "loss vs one device": rel_err(loss_i, loss_ref),
        "grads vs eager": max(rel_err(grads_i[n], grads_e[n]) for n in grads_e),
        "grads vs one device": max(rel_err(grads_i[n], grads_ref[n]) for n in grads_ref),
    }
    assert all(e <= tol for e in errors.values()), errors
    return {"errors": errors, "compiled": runner.compiled, "waited": runner.once.received if runner.once else 0}
