"""ExecGraphs compiled by Inductor (`hs.compile(..., backend="inductor")`) on 2 gloo processes: the
losses and gradients of the eager ExecGraphs and of one device under a 2-stage pipeline (stage
programs and the once-per-step reduction compiled) and under tensor and sequence parallelism of an
HF Llama (its all-gathers, reduce-scatters and all-reduces in one compiled graph), and the Trainer
taking the backend. Inductor's C++ codegen is most of the cost, so the models are small and the
ranks two."""
import pytest

import hotswitch as hs
from tests.compile_checks import batch, eager_vs_inductor, make_model
from tests.distributed import dist_tests

pytestmark = pytest.mark.slow  # spawns gloo processes and compiles with Inductor

def check_gpt_pipeline():
    """pp = 2, two micro-batches of 2 rows (1F1B): stage 0 compiles its forward, its backward and the
    reduction; stage 1 its forward-and-backward program and the reduction (each once: both
    micro-batches have one shape)."""
    import torch.distributed as dist

    out = eager_vs_inductor("gpt", "pp2", micro_batches=2, rows=4)
    assert out["compiled"] == (3 if dist.get_rank() == 0 else 2), out
    return out


def check_llama_tensor_and_sequence_parallel():
    """tp2 with sequence parallelism, a Hugging Face Llama: one training-step program per rank,
    each its own (each names its group and holds its own pieces of the sequence)."""
    out = eager_vs_inductor("llama", "tp2sp", num_hidden_layers=1)
    assert out["compiled"] == 1 and out["waited"] == 0, out
    return out


def check_trainer_takes_the_backend():
    """The Trainer compiles its ExecGraphs with the backend it is given, and names the choices for an unknown one."""
    from hotswitch.train.trainer import Trainer

    trainer = Trainer(make_model("gpt", n_layers=1), ["dp2"], backend="inductor")
    assert trainer.cm.backend == "inductor"
    with pytest.raises(ValueError, match="'eager'.*'inductor'"):
        hs.compile(make_model("gpt", n_layers=1), batch(), configs=["dp2"], backend="tensorrt")


test_world2 = dist_tests(2, [check_gpt_pipeline, check_llama_tensor_and_sequence_parallel,
                              check_trainer_takes_the_backend])
