"""Compiled ExecGraphs on 2 gloo processes: equivalence, and errors that name the problem and the fix."""
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hotswitch as hs
from hotswitch.compiler.sharding import ShardingError
from hotswitch.models import GPT, GPTConfig
from tests.compile_checks import (
    alike_ops_equal_deciding_each,
    assert_equivalent,
    batch,
    lowering_equals_make_fx,
    make_model,
    reference,
    rel_err,
    second_pass_equals_deciding_again,
)
from tests.distributed import dist_fixture

pytestmark = pytest.mark.slow  # spawns gloo processes and compiles; `-m 'not slow'` leaves it out

CONFIGS = [hs.DistConfig("dp2", dp=2), hs.DistConfig("tp2", tp=2), hs.DistConfig("tp2sp", tp=2, sp=True)]


def check_gpt_equivalence():
    return assert_equivalent("gpt", CONFIGS)


def check_llama_equivalence():
    return assert_equivalent("llama", CONFIGS, extra_seq=None)


def check_gpt2_equivalence():
    return assert_equivalent("gpt2", CONFIGS, extra_seq=None)


def check_learned_positions_with_a_tied_embedding():
    """GPT-2 style (learned positions, tied embedding; `gpt2-small` shrunk): two embedding backwards
    whose specs are equal and whose table sizes differ. DTensor's OpSchema compares only the specs
    for that op, so the propagation memo once gave the token table the positions' shape; a new
    shape then failed to lower ("broadcast 256 ... 1001"). Traced at 2 x 16, run at 4 x 32."""
    import copy

    from hotswitch.models import PackedCausalLMLoss, build_model
    from hotswitch.train.data import full_length_micro_batch

    torch.manual_seed(0)
    model = PackedCausalLMLoss(build_model("gpt2-small", dim=64, n_layers=1, n_heads=4, vocab_size=1001,
                                           max_seq_len=256))
    cm = hs.compile(model, full_length_micro_batch(2, 16), configs=["dp2", "tp2"])
    inputs = full_length_micro_batch(4, 32, seed=3)
    ref = copy.deepcopy(model)
    loss_ref = ref(*inputs)
    loss_ref.backward()
    errors = {}
    for name in ("dp2", "tp2"):
        cm.switch(name)
        cm.zero_grad()
        loss = cm.forward_backward(*cm.shard_inputs(*inputs))
        full = cm.full_grads()
        errors[name] = max([abs(loss.item() - loss_ref.item()),
                            *((full[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())])
    return errors


def _error(fn):
    try:
        fn()
    except (ValueError, ShardingError) as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("no error raised")


def check_wrong_device_count():
    return _error(lambda: hs.compile(make_model("gpt"), batch(), configs=[hs.DistConfig("dp2tp2", dp=2, tp=2)]))


def check_tp_not_dividing_heads():
    model = GPT(GPTConfig(vocab_size=1001, dim=48, n_layers=1, n_heads=3))
    return _error(lambda: hs.compile(model, batch(), configs=[hs.DistConfig("tp2", tp=2)]))


def check_unknown_config():
    cm = hs.compile(make_model("gpt"), batch(), configs=[hs.DistConfig("dp2", dp=2)])
    return _error(lambda: cm.switch("tp8"))


class CDistModel(nn.Module):
    """A model using an op (torch.cdist) that DTensor has no sharding rule for, on a sharded tensor."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1001, 32)
        self.up = nn.Linear(32, 64, bias=False)  # column-parallel: its output is sharded under tp
        self.down = nn.Linear(64, 1001, bias=False)

    def forward(self, ids, labels):
        h = self.up(self.embed(ids))
        h = h + 0.01 * torch.cdist(h, h).sum(-1, keepdim=True)
        return F.cross_entropy(self.down(h).flatten(0, 1), labels.flatten(), ignore_index=-100)


def check_op_without_rule():
    torch.manual_seed(0)
    return _error(lambda: hs.compile(CDistModel(), batch(), configs=[hs.DistConfig("tp2", tp=2)]))


def check_op_without_rule_non_strict():
    torch.manual_seed(0)
    model = CDistModel()
    ids, labels = batch()
    loss_ref, grads_ref = reference(model, ids, labels)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cm = hs.compile(model, (ids, labels), configs=[hs.DistConfig("tp2", tp=2)], strict=False)
    assert any("cdist" in str(w.message) and "replicated" in str(w.message) for w in caught), [
        str(w.message) for w in caught
    ]
    loss = cm.forward_backward(*cm.shard_inputs(ids, labels))
    grads = cm.full_grads()
    assert abs(loss.item() - loss_ref.item()) < 1e-5 * loss_ref.item()
    assert max(rel_err(grads[n], grads_ref[n]) for n in grads_ref) < 1e-5


class BatchCentered(nn.Module):
    """Subtracts the batch's mean features: rows of different data-parallel ranks are averaged."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(1001, 16), nn.Linear(16, 1001)

    def forward(self, ids, labels):
        h = self.embed(ids)
        h = h - h.mean(dim=0, keepdim=True)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten(), reduction="sum") / (labels != -100).sum()


def check_rows_mixed_across_dp_ranks():
    """Even rows: exact. Uneven rows: every rank refuses, naming the op, before any collective
    (each rank lowered for its own rows times dp; gloo aborted the process on the size mismatch)."""
    torch.manual_seed(0)
    model = BatchCentered()
    ids, labels = batch(batch=4)
    loss_ref, grads_ref = reference(model, ids, labels)
    cm = hs.compile(model, (ids, labels), configs=[hs.DistConfig("dp2", dp=2)])
    loss = cm.forward_backward(*cm.shard_inputs(ids, labels))
    errors = (rel_err(loss, loss_ref), max(rel_err(g, grads_ref[n]) for n, g in cm.full_grads().items()))
    uneven = batch(batch=5)
    return (errors, _error(lambda: cm.forward_backward(*cm.shard_inputs(*uneven))),
            _error(lambda: cm.forward_backward(*cm.shard_inputs(*uneven), micro_batches=2)))


def check_a_warm_cache_replays_decisions():
    """A second compiled model (as another process would be) finds the first one's LogicGraph on disk
    (no trace), its decisions (replayed: no strategy search) and its ExecGraph (no lowering trace):
    the same collectives, the same numbers. A training step runs the loaded program's code without
    building its graph; reading the graph builds it, the same as the first model's."""
    import os
    import tempfile

    import hotswitch.compiler._torch as fx_wrapper
    from hotswitch.compiler._torch import graph_built
    from hotswitch.compiler.lower import collectives
    from hotswitch.runtime import shared

    os.environ["HOTSWITCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="warm-")  # cold for this check
    model, inputs = make_model("gpt"), batch()
    config = hs.DistConfig("tp2sp", tp=2, sp=True)
    out = []
    written = []  # the graphs fx (or our writer of fx's code) writes code for (a loaded graph runs its entry's)
    write, write_as_fx = torch.fx.Graph.python_code, fx_wrapper.python_code

    def writing(graph, *args, **kwargs):
        written.append(len(graph.nodes))
        return write(graph, *args, **kwargs)

    def writing_as_fx(graph, *args, **kwargs):
        written.append(len(graph.nodes))
        with mock.patch.object(torch.fx.Graph, "python_code", write):  # (its fallback: one graph written)
            return write_as_fx(graph, *args, **kwargs)

    for _ in range(2):
        shared._LOADED.clear()  # as in another process: no LogicGraph in memory, only on disk
        written.clear()
        with mock.patch.object(torch.fx.Graph, "python_code", writing), \
                mock.patch.object(fx_wrapper, "python_code", writing_as_fx):
            cm = hs.compile(model, inputs, [config])
            gm = cm.exec_graph("tp2sp")
        codes_written = len(written)
        program = next(iter(cm._state("tp2sp").programs.values()))
        loss = cm.forward_backward(*cm.shard_inputs(*inputs))
        built = graph_built(gm)  # before anything here reads the graph: the step did not
        disk = cm._cache.disk
        out.append(dict(replayed=program.replayed, loss=float(loss), graph_built=built,
                        cache=(disk.hits["decisions"], disk.misses["decisions"]),
                        programs=(disk.hits["program"], disk.misses["program"]), loaded=program.loaded,
                        logic=(cm.logic_source, disk.hits["logic"]), nodes=[n.name for n in cm.logic.joint.graph.nodes],
                        collectives=[str(n.target) for n in collectives(gm)],
                        targets=[str(n.target) for n in gm.graph.nodes], codes_written=codes_written,
                        # the code the program runs is the code fx writes for its graph (the collectives'
                        # groups named as this model's, though the entry was written by another's)
                        code_is_the_graphs=gm.code == write(gm.graph, "self").src,
                        # and its compiled code (loaded, not compiled again) names this model's groups
                        groups=({n.args[-1] for n in collectives(gm)}, set(type(gm).forward.__code__.co_consts),
                                {cm.process_group("tp2sp", "tp").group_name}),
                        grads={k: v.clone() for k, v in cm.full_grads().items()}))
    return out


def check_a_warm_cache_fits_later_lengths():
    """The first model lowers its first length, samples the second (a graph only) and writes it,
    the third and the fourth from the fit of the two. A second compiled model loads the first
    length's program from disk and the fit (filed under that program's key), and writes the other
    three from it (fitted programs are not written to disk: writing one again costs less): the same
    code and numbers as the first model's. Every program, lowered, loaded or fitted, holds torch's
    fused attention kernels already: the runner runs it as it is, with no rewrite at its first step.
    A third model finds program entries that do not load (written by another torch build, say): it
    warns, lowers the first length again and binds the fit to it, with the same numbers; a fourth
    finds a fit that does not load: it warns and samples and fits again.
    Compiled with `dynamic=True`, a model that finds the fit at the example's length and its half
    lowers no half: its later lengths are written from the fit an earlier model filed."""
    import contextlib
    import os
    import tempfile

    from hotswitch.runtime import shared

    os.environ["HOTSWITCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="warm-lengths-")  # cold for this check
    model = make_model("gpt")
    config = hs.DistConfig("tp2sp", tp=2, sp=True)
    out = []
    unreadable = mock.patch("hotswitch.compiler.program.loads_program", side_effect=ValueError("another build"))
    unfitting = mock.patch("hotswitch.compiler.program.loads_fit", side_effect=ValueError("another build"))
    for entries in (contextlib.nullcontext(), contextlib.nullcontext(), unreadable, unfitting):
        shared._LOADED.clear()  # as in another process: no LogicGraph in memory, only on disk
        with entries, warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            lengths = _at_four_lengths(model, config)
        lengths["warned"] = [str(w.message) for w in warned if "compile cache" in str(w.message)]
        out.append(lengths)
    dynamic = []
    for _ in range(2):
        shared._LOADED.clear()
        said: list[str] = []
        cm = hs.compile(model, batch(), [config], dynamic=True, progress=said.append)
        state = cm._state(config.name)
        gm = cm.exec_graph(config.name, tuple(tuple(x.shape) for x in batch(seq=20)))
        (program,) = [p for p in state.programs.values() if p.joint is gm]
        dynamic.append(dict(said=said, code=gm.code, fitted=program.fitted,
                            lengths=[[length for length, _ in f.lowered] for f in state.lengths.values()],
                            fit_loaded=[f.fit_loaded for f in state.lengths.values()]))
    out.append(dynamic)
    return out


def _at_four_lengths(model, config) -> dict:
    """A training step at each of four lengths of a newly compiled `model`: what each program was,
    and which programs' graphs the four steps built (before anything here reads one)."""
    from hotswitch.compiler._torch import graph_built

    cm = hs.compile(model, batch(), [config])
    lengths, programs = {}, {}
    for seq in (12, 16, 20, 24):
        inputs = batch(seq=seq)
        gm = cm.exec_graph(config.name, tuple(tuple(x.shape) for x in inputs))
        (program,) = [p for p in cm._state(config.name).programs.values() if p.joint is gm]
        loss = cm.forward_backward(*cm.shard_inputs(*inputs))
        programs[seq] = gm
        lengths[seq] = dict(loaded=program.loaded, fitted=program.fitted, loss=float(loss), code=gm.code,
                            fits=[f.fit is not None for f in cm._state(config.name).lengths.values()],
                            fit_loaded=[f.fit_loaded for f in cm._state(config.name).lengths.values()],
                            runs_as_lowered=cm.graph_runner(gm) is gm)
    for seq, gm in programs.items():
        lengths[seq]["graph_built"] = graph_built(gm)
    for seq, gm in programs.items():
        lengths[seq]["attention"] = sorted(str(n.target) for n in gm.graph.nodes if "attention" in str(n.target))
    return lengths


def check_gradient_buckets_reduce_behind_the_backward():
    """Gradients over DDP's 25 MiB bucket (an 8192 x 512 embedding and LM head: 32 MiB) make two
    buckets under dp2. The first (the LM head and the last block, which the backward finishes first)
    is all-reduced right after its last gradient, while the rest of the backward runs; its wait stays
    at the end. Loss and gradients equal one device's."""
    from hotswitch.compiler.lower import collective_kind, collectives
    from hotswitch.models import build_model

    torch.manual_seed(0)
    model = build_model("gpt-tiny", vocab_size=8192, dim=512, n_layers=1, n_heads=4, n_kv_heads=4)
    ids, labels = batch()
    loss_ref, grads_ref = reference(model, ids, labels)
    cm = hs.compile(model, (ids, labels), configs=["dp2"])
    gm = cm.exec_graph("dp2")
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    reduces = [n for n in collectives(gm, "reduce") if collective_kind(n) == "all_reduce"]
    last_backward = max(i for i, n in enumerate(nodes) if n.meta.get("custom", {}).get("phase") == "backward")
    first, wait = reduces[0], next(iter(reduces[0].users))
    loss = cm.forward_backward(*cm.shard_inputs(ids, labels))
    grads = cm.full_grads()
    return dict(buckets=len(reduces), first=position[first], wait=position[wait], last_backward=last_backward,
                wait_target=str(wait.target), loss_error=rel_err(loss, loss_ref),
                grad_error=max(rel_err(grads[n], grads_ref[n]) for n in grads_ref))


def check_waits_sit_where_results_are_read():
    """Under tp2 every collective's wait sits right before the first op that reads its result (with
    the other waits that op reads), and
    some ops that do not need it (weight gradients in the backward) run while it is in flight."""
    cm = hs.compile(make_model("gpt"), batch(), configs=["tp2"])
    nodes = list(cm.exec_graph("tp2").graph.nodes)
    waits = [(i, n) for i, n in enumerate(nodes) if "wait_tensor" in str(n.target)]

    def next_op(i):  # waits read by one op sit together before it
        return next(m for m in nodes[i + 1:] if "wait_tensor" not in str(m.target))
    return dict(waits=len(waits),
                right_before_a_reader=sum(next_op(i) in n.users for i, n in waits),
                with_work_in_flight=sum(i - nodes.index(n.args[0]) > 1 for i, n in waits))


def check_lowering_equals_make_fx():
    """Programs built node by node equal the make_fx interpreter's: a vocab-parallel embedding and
    sequence parallelism (our GPT), pipeline stages, data parallelism's loss and gradient buckets,
    GQA's strided heads (Llama), Conv1D (GPT-2)."""
    return {"gpt": lowering_equals_make_fx("gpt", [hs.DistConfig("tp2sp", tp=2, sp=True), hs.DistConfig("pp2", pp=2),
                                                   hs.DistConfig("dp2", dp=2)]),
            "llama": lowering_equals_make_fx("llama", [hs.DistConfig("tp2sp", tp=2, sp=True)]),
            "gpt2": lowering_equals_make_fx("gpt2", [hs.DistConfig("tp2", tp=2)])}


def check_second_pass_reuses_unchanged_decisions():
    """The partial policy's second pass takes the first pass's decision for an op whose inputs arrive
    as they did, and that equals deciding it again: sequence parallelism (partials reduce-scattered),
    and GPT-2's vocab-parallel embedding tied to its head (a _MaskPartial)."""
    return {"llama": second_pass_equals_deciding_again("llama", [hs.DistConfig("tp2sp", tp=2, sp=True)]),
            "gpt2": second_pass_equals_deciding_again("gpt2", [hs.DistConfig("tp2", tp=2)])}


def check_alike_ops_are_decided_once():
    """An op of a repeated block whose inputs arrive as the first block's did takes that block's
    decision, bound to its own inputs: the same decisions as deciding every op on its own, in the
    search and in a replay at another length, under sequence parallelism (Llama) and data
    parallelism (our GPT, whose loss reads rows of both dp ranks)."""
    return {"llama": alike_ops_equal_deciding_each("llama", [hs.DistConfig("tp2sp", tp=2, sp=True)]),
            "gpt": alike_ops_equal_deciding_each("gpt", [hs.DistConfig("dp2", dp=2)])}


def check_dynamic_lengths():
    """`dynamic=True` fits a config in the sequence length while compiling (the example's length and
    half of it), so a first step at any later length runs a program written from that fit: the same
    program as a replay there, with one device's numbers. `dynamic=False` lowers every length; an
    odd example length is not fitted, and the progress and a warning say so."""
    import os

    from tests.reference_lowering import same_program

    model = make_model("llama")
    config = hs.DistConfig("tp2sp", tp=2, sp=True)
    os.environ["HOTSWITCH_CACHE"] = "0"  # every program lowered or fitted here, none loaded
    try:
        said, odd_said = [], []
        dynamic = hs.compile(model, batch(), [config], dynamic=True, progress=said.append)
        fits_at_compile = [f.fit is not None for f in dynamic._state(config.name).lengths.values()]
        fixed = hs.compile(model, batch(), [config], dynamic=False, logic=dynamic.logic)
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            odd = hs.compile(model, batch(seq=11), [config], dynamic=True, logic=dynamic.logic,
                             progress=odd_said.append)
    finally:
        del os.environ["HOTSWITCH_CACHE"]
    out = {"rank": dist.get_rank(), "fits_at_compile": fits_at_compile, "said": said, "odd_said": odd_said,
           "odd_warned": [str(w.message) for w in warned if "dynamic=True" in str(w.message)],
           "odd_fits": [f.fit is not None for f in odd._state(config.name).lengths.values()]}
    for seq in (16, 20):
        ids, labels = batch(seq=seq)
        loss_ref, grads_ref = reference(model, ids, labels)
        row, programs = {}, []
        for label, cm in (("dynamic", dynamic), ("fixed", fixed)):
            gm = cm.exec_graph(config.name, (tuple(ids.shape), tuple(labels.shape)))
            programs.append(gm)
            (program,) = [p for p in cm._state(config.name).programs.values() if p.joint is gm]
            cm.zero_grad()
            loss = cm.forward_backward(*cm.shard_inputs(ids, labels))
            grads = cm.full_grads()
            row[label] = dict(fitted=program.fitted, loss=float(loss),
                              loss_err=abs(loss.item() - loss_ref.item()) / loss_ref.item(),
                              grad_err=max(rel_err(grads[n], grads_ref[n]) for n in grads_ref))
        row["difference"] = same_program(*programs, portable=True)
        out[seq] = row
    out["fixed_fits"] = [f.fit is not None for f in fixed._state(config.name).lengths.values()]
    return out


def check_a_second_length_that_does_not_fit():
    """The default mode samples a config's second length and fits it with the first. An odd length
    under sequence parallelism (13 tokens on 2 ranks: uneven pieces) does not fit: its sample, one
    lowering, becomes its program (code written, nothing lowered twice), and the next length (16) is
    sampled and fitted in its place; the one after (20) is written from that fit. One device's
    numbers at each. Lengths that never fit (13, 15, 17) are sampled three times, then the rows are
    refused: 19 is lowered, not sampled."""
    import os

    from hotswitch.compiler import program

    model = make_model("llama")
    config = hs.DistConfig("tp2sp", tp=2, sp=True)
    propagated, real = [], program.propagate_graph

    def propagate(*args, **kwargs):
        propagated.append(1)
        return real(*args, **kwargs)

    said = []
    os.environ["HOTSWITCH_CACHE"] = "0"  # every program lowered here, none loaded
    try:
        cm = hs.compile(model, batch(), [config], progress=said.append)
        out = {}
        for seq in (13, 16, 20):
            ids, labels = batch(seq=seq)
            loss_ref, grads_ref = reference(model, ids, labels)
            with mock.patch.object(program, "propagate_graph", propagate):
                propagated.clear()
                gm = cm.exec_graph(config.name, (tuple(ids.shape), tuple(labels.shape)))
            (made,) = [p for p in cm._state(config.name).programs.values() if p.joint is gm]
            cm.zero_grad()
            loss = cm.forward_backward(*cm.shard_inputs(ids, labels))
            grads = cm.full_grads()
            out[seq] = dict(lowerings=len(propagated), fitted=made.fitted, cut=made.backward is not None,
                            code_is_the_graphs=gm.code == gm.graph.python_code("self").src,
                            loss_err=abs(loss.item() - loss_ref.item()) / loss_ref.item(),
                            grad_err=max(rel_err(grads[n], grads_ref[n]) for n in grads_ref))
        # lengths that never fit (odd ones): three are sampled, then the rows are refused and the
        # fourth is lowered without a sample
        odd = hs.compile(model, batch(), [config], logic=cm.logic)
        out["odd_lowerings"] = []
        for seq in (13, 15, 17, 19):
            ids, labels = batch(seq=seq)
            with mock.patch.object(program, "propagate_graph", propagate):
                propagated.clear()
                odd.exec_graph(config.name, (tuple(ids.shape), tuple(labels.shape)))
            out["odd_lowerings"].append(len(propagated))
    finally:
        del os.environ["HOTSWITCH_CACHE"]
    (family,) = odd._state(config.name).lengths.values()
    out["odd_unfit"], out["odd_refused"] = [length for length, _ in family.unfit], family.refused
    out["refused"] = [f.refused for f in cm._state(config.name).lengths.values()]
    out["unfit"] = [[length for length, _ in f.unfit] for f in cm._state(config.name).lengths.values()]
    out["said"] = [m for m in said if "no fit in the length" in m or "the next is tried" in m]
    return out


def check_a_dp_family_fits_the_sample_of_either_dp_rank():
    """Data-parallel ranks share one program where it reads nothing of their dp coordinate, and one
    of them samples the second length for the fit of all (whichever gets there first). A rank's own
    piece of a value whose pieces all hold the same values (the loss's gradient seed, made whole and
    cut into rows) is taken by index, and the index is the lowering rank's: a program lowered on the
    other dp rank takes the other piece. Fitted with either rank's sample, the shared first program
    gives the same program at a third length (an index is never fitted as if it were a size)."""
    import os

    from hotswitch.compiler.lengths import fit
    from hotswitch.compiler.logic_io import dumps_program, loads_program
    from hotswitch.compiler.program import _group_names
    from tests.reference_lowering import same_program

    config = hs.DistConfig("dp2", dp=2)
    os.environ["HOTSWITCH_CACHE"] = "0"  # shared between the ranks, not on disk
    try:
        cm = hs.compile(make_model("gpt"), batch(batch=4), configs=[config])
    finally:
        del os.environ["HOTSWITCH_CACHE"]
    st = cm._state(config.name)
    first = cm.exec_graph(config.name, (tuple(batch(batch=4)[0].shape),) * 2)
    (key,) = [k for k, p in st.programs.items() if p.joint is first]
    at = lambda length: (tuple((s[0], length, *s[2:]) for s in key[0]), *key[1:])  # noqa: E731
    sample = cm._programs.lower(st, at(16), sample=True).joint  # this rank's own, lowered here
    groups = _group_names(st.mesh)
    samples = [None] * dist.get_world_size()
    dist.all_gather_object(samples, dumps_program(sample, {g: i for i, g in enumerate(groups)}))
    samples = [loads_program(data, groups) for data in samples]
    fitted = [fit(first, key[0][0][1], s, 16).at(20) for s in samples]
    return {"samples_differ": same_program(*samples) is not None,
            "fitted_differ": same_program(*fitted, portable=True)}


def check_dynamic_pipeline_stages():
    """pp2, each stage on a device of its own (nothing to shard, so no decision to replay): with
    `dynamic=True` each stage's micro-batch programs are fitted in the length while compiling, and
    steps at later lengths run programs written from the fit, with the numbers of programs lowered
    at each length (`dynamic=False`), bit for bit, and one device's."""
    import os

    model = make_model("llama")
    os.environ["HOTSWITCH_CACHE"] = "0"  # every program lowered or fitted here, none loaded
    try:
        dynamic = hs.compile(model, batch(), ["pp2"], dynamic=True)
        fixed = hs.compile(model, batch(), ["pp2"], dynamic=False, logic=dynamic.logic)
    finally:
        del os.environ["HOTSWITCH_CACHE"]
    out = {"fits": [f.fit is not None for f in dynamic._state("pp2").lengths.values()]}
    for seq in (16, 20):
        ids, labels = batch(seq=seq)
        loss_ref, grads_ref = reference(model, ids, labels)
        row = {}
        for label, cm in (("dynamic", dynamic), ("fixed", fixed)):
            cm.zero_grad()
            loss = cm.forward_backward(*cm.shard_inputs(ids, labels))
            grads = cm.full_grads()
            row[label] = dict(loss=float(loss), grads={n: g.clone() for n, g in grads.items()},
                              fitted=sorted({p.fitted for k, p in cm._state("pp2").programs.items()
                                             if k[0][0][1] == seq}, key=str),
                              loss_err=abs(loss.item() - loss_ref.item()) / loss_ref.item(),
                              grad_err=max(rel_err(grads[n], grads_ref[n]) for n in grads_ref))
        row["same_grads"] = all(torch.equal(row["dynamic"]["grads"][n], row["fixed"]["grads"][n])
                                for n in row["fixed"]["grads"])
        for run in ("dynamic", "fixed"):
            del row[run]["grads"]
        out[seq] = row
    return out


def check_decisions_made_on_one_row_replay_on_several():
    """tp2sp decided at 1 row x 24 (flattening [1, s] sharded on s is a Shard), then lowered at 4
    rows x 16 (a _StridedShard there): the replay must see the size-1 dim changed and decide those
    ops again (replayed as they were, the gradients came out wrong)."""
    model = make_model("llama")
    cm = hs.compile(model, batch(batch=2, seq=16), configs=["tp2sp"], lazy=True)
    errors = []
    for rows, seq in ((1, 24), (4, 16)):
        ids, labels = batch(batch=rows, seq=seq, seed=rows)
        loss_ref, grads_ref = reference(model, ids, labels)
        cm.zero_grad()
        loss = cm.forward_backward(*cm.shard_inputs(ids, labels))
        grads = cm.full_grads()
        errors.append((rel_err(loss, loss_ref), max(rel_err(grads[n], grads_ref[n]) for n in grads_ref)))
    return errors


results = dist_fixture(2, [check_decisions_made_on_one_row_replay_on_several,
                           check_second_pass_reuses_unchanged_decisions, check_lowering_equals_make_fx,
                           check_alike_ops_are_decided_once,
                           check_gpt_equivalence, check_llama_equivalence, check_gpt2_equivalence,
                           check_learned_positions_with_a_tied_embedding,
                           check_a_warm_cache_replays_decisions, check_a_warm_cache_fits_later_lengths,
                           check_dynamic_lengths, check_dynamic_pipeline_stages,
                           check_a_dp_family_fits_the_sample_of_either_dp_rank,
                           check_a_second_length_that_does_not_fit,
                           check_gradient_buckets_reduce_behind_the_backward,
                           check_waits_sit_where_results_are_read, check_wrong_device_count,
                           check_tp_not_dividing_heads, check_unknown_config, check_op_without_rule,
                           check_op_without_rule_non_strict, check_rows_mixed_across_dp_ranks])


def test_gpt_matches_single_device(results):
    results["check_gpt_equivalence"].raise_if_failed()


def test_hf_llama_matches_single_device(results):
    results["check_llama_equivalence"].raise_if_failed()


def test_hf_gpt2_matches_single_device(results):
    results["check_gpt2_equivalence"].raise_if_failed()


def test_learned_positions_with_a_tied_embedding_match_single_device(results):
    for errors in results["check_learned_positions_with_a_tied_embedding"].raise_if_failed():
        assert all(e <= 1e-5 for e in errors.values()), errors


def test_gradient_buckets_reduce_behind_the_backward(results):
    for r in results["check_gradient_buckets_reduce_behind_the_backward"].raise_if_failed():
        assert r["buckets"] == 2, r
        assert r["first"] < r["last_backward"] < r["wait"], r  # issued mid-backward, awaited after it
        assert "wait_tensor" in r["wait_target"], r
        assert r["loss_error"] <= 1e-5 and r["grad_error"] <= 1e-5, r


def test_waits_sit_where_results_are_read(results):
    for r in results["check_waits_sit_where_results_are_read"].raise_if_failed():
        assert r["waits"] > 0 and r["right_before_a_reader"] == r["waits"], r
        assert r["with_work_in_flight"] >= 2, r  # at least the two blocks' backward all-reduces


def test_wrong_device_count(results):
    (msg, *_) = results["check_wrong_device_count"].raise_if_failed()
    assert "ValueError" in msg and "4 devices" in msg and "2 processes" in msg and "dp*tp*pp" in msg, msg


def test_tp_not_dividing_heads(results):
    (msg, *_) = results["check_tp_not_dividing_heads"].raise_if_failed()
    assert "tp=2 does not divide the 3 attention heads" in msg and "choose tp from [1, 3]" in msg, msg


def test_unknown_config_name(results):
    (msg, *_) = results["check_unknown_config"].raise_if_failed()
    assert "unknown config 'tp8'" in msg and "['dp2']" in msg, msg


def test_op_without_sharding_rule_names_node_and_source(results):
    (msg, *_) = results["check_op_without_rule"].raise_if_failed()
    assert msg.startswith("ShardingError") and "cdist" in msg and "test_compile_world2.py" in msg, msg
    assert "strict=False" in msg, msg  # the fix


def test_op_without_rule_runs_replicated_when_not_strict(results):
    results["check_op_without_rule_non_strict"].raise_if_failed()


def test_rows_mixed_across_dp_ranks_need_an_even_split(results):
    for errors, message, micro_message in results["check_rows_mixed_across_dp_ranks"].raise_if_failed():
        assert max(errors) < 1e-5, errors
        for text in (message, micro_message):
            assert text.startswith("ValueError: 'dp2' combines rows of different data-parallel ranks other than by "
                                   "a sum, at mean (aten.mean.dim) from "), text
            assert "h = h - h.mean(dim=0, keepdim=True)" in text, text
        assert "a global batch of 5 does not split evenly. Use a batch divisible by 2" in message, message
        # micro-batches (the pipeline's path): ranks of 3 and 2 rows cut into 2 micro-batches each
        assert "the dp=2 ranks hold equally many rows, and they hold 2 to 3 rows. Use a batch divisible by 2" \
            in micro_message, micro_message


def test_a_warm_cache_replays_decisions(results):
    ranks = results["check_a_warm_cache_replays_decisions"].raise_if_failed()
    # one rank traced the model for both; the other loaded it from the job's store
    assert sorted(cold["logic"] for cold, _ in ranks) == [("loaded", 0), ("traced", 0)]
    (searcher,) = [cold for cold, _ in ranks if cold["replayed"] == 0]  # one rank searched, for both
    assert searcher["cache"] == (0, 1)  # not on disk, then stored
    for cold, warm in ranks:
        if cold is not searcher:  # it waited for the searcher's decisions, or (a late rank) found them on disk
            assert cold["replayed"] > 100 and cold["cache"] in ((0, 1), (1, 0)), cold
        assert warm["logic"] == ("loaded", 1) and warm["nodes"] == cold["nodes"]  # from this rank's disk
        # its decisions found (each rank has its own disk), and with them its ExecGraph: nothing propagated
        assert warm["cache"] == (1, 0) and warm["replayed"] == 0
        assert warm["collectives"] == cold["collectives"] and warm["loss"] == cold["loss"]
        # its ExecGraph too: loaded (its collectives bound to the second model's own process groups),
        # not traced again; the same ops and the same numbers
        # (the searcher has no decisions to look its program up by before it searches)
        assert cold["programs"] == ((0, 0) if cold is searcher else (0, 1)) and not cold["loaded"]
        assert warm["programs"] == (1, 0) and warm["loaded"] and warm["targets"] == cold["targets"]
        assert cold["graph_built"] and not warm["graph_built"]
        assert all(torch.equal(warm["grads"][k], v) for k, v in cold["grads"].items())
        # the LogicGraph and the program are loaded with the code written for them: none written again
        assert cold["codes_written"] > 0 and warm["codes_written"] == 0, (cold["codes_written"], warm["codes_written"])
        assert cold["code_is_the_graphs"] and warm["code_is_the_graphs"]
        for run in (cold, warm):
            named, constants, own = run["groups"]
            assert named == own and named <= constants and not any("hotswitch group" in str(c) for c in constants)


def test_a_warm_cache_fits_later_lengths(results):
    for ranks in results["check_a_warm_cache_fits_later_lengths"].raise_if_failed():
        cold, warm, unreadable, unfitting, dynamic = ranks
        # the second length is written from the fit too: its sample is a graph, never a program
        assert [cold[s]["fitted"] for s in (12, 16, 20, 24)] == [None, (12, 16), (12, 16), (12, 16)], cold
        assert warm[12]["loaded"], warm  # from the first model's disk
        assert [warm[s]["fitted"] for s in (16, 20, 24)] == [(12, 16)] * 3, warm
        for run in (cold, warm):  # written from the fit of the two programs, in each process
            assert [run[s]["loaded"] for s in (16, 20, 24)] == [False] * 3 and run[24]["fits"] == [True], run
        assert cold[24]["fit_loaded"] == [False] and warm[16]["fit_loaded"] == [True]  # fitted once, then loaded
        # a step runs a program's code: a fitted one's graph is never written, and in the warm process
        # neither is a loaded one's, not even the first's, which the fit is bound to
        assert [cold[s]["graph_built"] for s in (12, 16, 20, 24)] == [True, False, False, False], cold
        assert [warm[s]["graph_built"] for s in (12, 16, 20, 24)] == [False] * 4, warm
        assert all(warm[s]["loss"] == cold[s]["loss"] and warm[s]["code"] == cold[s]["code"] for s in (12, 16, 20, 24))
        assert cold["warned"] == warm["warned"] == []
        # a fit that does not load: said once, the second length sampled and fitted again, the same code
        assert unfitting[12]["loaded"] and not unfitting[16]["loaded"] and unfitting[24]["fit_loaded"] == [False]
        assert [unfitting[s]["fitted"] for s in (16, 20, 24)] == [(12, 16)] * 3, unfitting
        assert len(unfitting["warned"]) == 1 and "length fit did not load" in unfitting["warned"][0], unfitting
        assert all(unfitting[s]["code"] == cold[s]["code"] for s in (12, 16, 20, 24))
        # dynamic=True: the first model lowers the half length (6) and files the fit; the second loads it
        first, second = dynamic
        assert first["lengths"] == [[12, 6]] and first["fit_loaded"] == [False], first
        assert second["lengths"] == [[12]] and second["fit_loaded"] == [True], second  # no half lowered
        assert any("the compile cache had the fit" in m for m in second["said"]), second["said"]
        assert first["fitted"] == second["fitted"] == (12, 6) and first["code"] == second["code"]
        # entries that do not load: said once, then the first lowered (its decisions replayed), the fit bound to it
        assert [unreadable[s]["loaded"] for s in (12, 16, 20, 24)] == [False] * 4, unreadable
        assert [unreadable[s]["fitted"] for s in (16, 20, 24)] == [(12, 16)] * 3 and unreadable[24]["fits"] == [True]
        assert len(unreadable["warned"]) == 1 and "did not load" in unreadable["warned"][0], unreadable["warned"]
        assert all(unreadable[s]["loss"] == cold[s]["loss"] for s in (12, 16, 20, 24))
        layers = 2
        for lengths in (cold, warm):
            for seq, r in lengths.items():
                if seq == "warned":
                    continue
                assert r["attention"] == ["aten._scaled_dot_product_flash_attention_for_cpu.default"] * layers + [
                    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"] * layers, (seq, r["attention"])
                assert r["runs_as_lowered"], seq


def test_dynamic_lengths(results):
    for r in results["check_dynamic_lengths"].raise_if_failed():
        assert r["fits_at_compile"] == [True], r["fits_at_compile"]
        assert any("fitted in the sequence length from lengths 6 and 12" in m for m in r["said"]), r["said"]
        for seq in (16, 20):
            dynamic, fixed = r[seq]["dynamic"], r[seq]["fixed"]
            assert dynamic["fitted"] == (12, 6) and fixed["fitted"] is None, (seq, dynamic, fixed)
            assert r[seq]["difference"] is None, (seq, r[seq]["difference"])
            assert dynamic["loss"] == fixed["loss"], seq
            for run in (dynamic, fixed):
                assert run["loss_err"] < 1e-5 and run["grad_err"] < 1e-4, (seq, run)
        assert r["fixed_fits"] == [False], r["fixed_fits"]  # two lengths after the first, none fitted
        assert r["odd_fits"] == [False] and any("11, is odd" in m for m in r["odd_said"]), r["odd_said"]
        # asked for and not given: a warning says so too, where no progress callback is passed; every
        # rank refuses an odd example length alike, so rank 0 alone says it
        assert len(r["odd_warned"]) == (r["rank"] == 0), (r["rank"], r["odd_warned"])
        assert all("11, is odd" in w for w in r["odd_warned"]), r["odd_warned"]


def test_a_second_length_that_does_not_fit_is_its_sample_completed_and_the_next_is_sampled(results):
    for r in results["check_a_second_length_that_does_not_fit"].raise_if_failed():
        assert r[13]["lowerings"] == 1 and r[13]["fitted"] is None, r[13]  # sampled once, completed
        assert r[13]["code_is_the_graphs"] and not r[13]["cut"], r[13]
        assert r[16]["lowerings"] == 1 and r[16]["fitted"] == (12, 16), r[16]  # sampled in 13's place, fitted
        assert r[20]["lowerings"] == 0 and r[20]["fitted"] == (12, 16), r[20]  # written from that fit
        for seq in (13, 16, 20):
            assert r[seq]["loss_err"] < 1e-5 and r[seq]["grad_err"] < 1e-4, (seq, r[seq])
        assert r["refused"] == [None] and r["unfit"] == [[13]], (r["refused"], r["unfit"])
        assert len(r["said"]) == 2 and all("13" in m for m in r["said"]), r["said"]
        assert r["odd_lowerings"] == [1] * 4, r["odd_lowerings"]  # a sample completed, or a lowering: one each
        assert r["odd_unfit"] == [13, 15, 17] and r["odd_refused"], (r["odd_unfit"], r["odd_refused"])


def test_a_dp_family_fits_the_sample_of_either_dp_rank(results):
    for out in results["check_a_dp_family_fits_the_sample_of_either_dp_rank"].raise_if_failed():
        assert out["samples_differ"]  # the two dp ranks' samples take other pieces: the case is here
        assert out["fitted_differ"] is None


def test_dynamic_pipeline_stages_are_fitted(results):
    for r in results["check_dynamic_pipeline_stages"].raise_if_failed():
        assert r["fits"] and all(r["fits"]), r["fits"]  # every stage program's rows, fitted while compiling
        for seq in (16, 20):
            dynamic, fixed = r[seq]["dynamic"], r[seq]["fixed"]
            assert dynamic["fitted"] == [(12, 6)] and fixed["fitted"] == [None], (seq, dynamic, fixed)
            assert dynamic["loss"] == fixed["loss"] and r[seq]["same_grads"], seq
            for run in (dynamic, fixed):
                assert run["loss_err"] < 1e-5 and run["grad_err"] < 1e-4, (seq, run)


def test_lowering_builds_the_program_make_fx_would_trace(results):
    for rank in results["check_lowering_equals_make_fx"].raise_if_failed():
        for model, differences in rank.items():
            expected = 3 if model == "gpt" else 1  # tp2sp's program, this rank's pp2 stage, dp2's program
            assert len(differences) >= expected, (model, "programs lowered:", len(differences))
            assert differences == [None] * len(differences), (model, differences)


def test_alike_ops_are_decided_once(results):
    for rank in results["check_alike_ops_are_decided_once"].raise_if_failed():
        for model, propagations in rank.items():
            assert "replay" in [how for how, _, _ in propagations], (model, propagations)
            for how, difference, served in propagations:
                assert difference is None, (model, how, difference)
                # the second block's ops (and repeated ops within one): more than a few served
                assert served > 50, (model, how, served)


def test_the_second_pass_reuses_unchanged_decisions(results):
    ranks = results["check_second_pass_reuses_unchanged_decisions"].raise_if_failed()
    for model in ("llama", "gpt2"):
        # one rank searches for the job, the other replays what it published (no second pass)
        searches = [search for rank in ranks for search in rank[model]]
        assert len(searches) >= 1, (model, "searches:", len(searches))
        assert [difference for difference, _ in searches] == [None] * len(searches), (model, searches)
        assert all(reused > 100 for _, reused in searches), (model, searches)  # most ops, not none


def test_decisions_made_on_one_row_replay_on_several(results):
    for errors in results["check_decisions_made_on_one_row_replay_on_several"].raise_if_failed():
        assert all(loss <= 1e-5 and grads <= 1e-5 for loss, grads in errors), errors
