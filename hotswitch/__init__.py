"""hotswitch: compile a model once for several parallel layouts and switch between them while training."""
from distconfig import DistConfig, Topology

__all__ = ["CompiledModel", "DistConfig", "StepReport", "Topology", "Trainer", "compile"]


def __getattr__(name):
    # The compiler (torch.export, DTensor) loads on first use: `hotswitch plan` never needs it.
    if name in ("compile", "CompiledModel"):
        from . import api

        return getattr(api, name)
    if name in ("Trainer", "StepReport"):
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'hotswitch' has no attribute {name!r}")
