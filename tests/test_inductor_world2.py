"""ExecGraphs compiled by Inductor (`hs.compile(..., backend="inductor")`) on 2 gloo processes: the
losses and gradients of the eager ExecGraphs and of one device, under tensor + sequence parallelism,
data parallelism (an HF model, uneven rows) and a 2-stage pipeline (stage programs and the once-per-step
reduction compiled). One-layer models where the config allows: Inductor's C++ codegen is most of the cost."""
import pytest

import hotswitch as hs
from tests.compile_checks import batch, make_model, reference, rel_err
from tests.distributed import dist_tests

pytestmark = pytest.mark.slow  # spawns gloo processes and compiles with Inductor

TOL = 1e-5


def _eager_vs_inductor(kind: str, config: str, micro_batches: int = 1, rows: int | None = None, **overrides) -> dict:
    """Compile `kind` under `config` with both backends, run one step of the same batch, and compare
    each with the other and with the single-device model (relative errors, asserted <= TOL)."""
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
    assert all(e <= TOL for e in errors.values()), errors
    return {"errors": errors, "compiled": runner.compiled}


def check_gpt_tp_sp():
    """Megatron TP + SP: all-gathers and reduce-scatters on the sequence, all-reduced norm gradients."""
    out = _eager_vs_inductor("gpt", "tp2sp", n_layers=1)
    assert out["compiled"] == 1, out  # one training-step program per rank
    return out


def check_hf_llama_dp():
    """Data parallelism of a Hugging Face Llama on 5 rows (3 and 2 per rank): the bucketed gradient
    all-reduce and the global loss denominator inside the compiled graph."""
    return _eager_vs_inductor("llama", "dp2", num_hidden_layers=1)


def check_gpt_pipeline():
    """pp = 2, two micro-batches of 2 rows (1F1B): stage 0 compiles its forward, its backward and the
    reduction; stage 1 its forward-and-backward program and the reduction (each once: both
    micro-batches have one shape)."""
    import torch.distributed as dist

    out = _eager_vs_inductor("gpt", "pp2", micro_batches=2, rows=4)
    assert out["compiled"] == (3 if dist.get_rank() == 0 else 2), out
    return out


def check_trainer_takes_the_backend():
    """The Trainer compiles its ExecGraphs with the backend it is given, and names the choices for an unknown one."""
    from hotswitch.train.trainer import Trainer

    trainer = Trainer(make_model("gpt", n_layers=1), ["dp2"], backend="inductor")
    assert trainer.cm.backend == "inductor"
    with pytest.raises(ValueError, match="'eager'.*'inductor'"):
        hs.compile(make_model("gpt", n_layers=1), batch(), configs=["dp2"], backend="tensorrt")


test_world2 = dist_tests(2, [check_gpt_tp_sp, check_hf_llama_dp, check_gpt_pipeline, check_trainer_takes_the_backend])
