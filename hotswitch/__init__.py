"""hotswitch: compile a model once for several parallel layouts and switch between them while training."""
from distconfig import DistConfig, Topology

from .api import CompiledModel, compile

__all__ = ["CompiledModel", "DistConfig", "Topology", "compile"]
