"""What moves besides the weights: the kinds of per-parameter state, and how a switched tensor is named.

A switch plan and a job state name a state tensor "<kind>:<parameter>" (`state_key`); the weights
themselves go by the parameter's name. CompiledModel moves accumulated gradients (GRAD) and any
attached state; the Trainer's job state (`JOB_STATE`) is the fp32 masters and AdamW's two moments.
"""
from __future__ import annotations

import enum

__all__ = ["JOB_STATE", "StateKind", "split_key", "state_key"]


class StateKind(str, enum.Enum):
    """A kind of per-parameter state (a str: user code may attach kinds of its own by name)."""

    PARAM = "param"  # fp32 master weights, in a job state
    GRAD = "grad"  # accumulated gradients (reserved: CompiledModel holds them)
    MASTER = "master"  # fp32 masters moved beside lower-precision compute weights
    EXP_AVG = "exp_avg"  # AdamW's first moment
    EXP_AVG_SQ = "exp_avg_sq"  # AdamW's second moment

    def __str__(self) -> str:
        return self.value


JOB_STATE = (StateKind.PARAM, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)


def state_key(kind: str, param: str) -> str:
    """The name of `param`'s state of `kind` in plans and job states."""
    return f"{str(kind)}:{param}"


def split_key(name: str) -> tuple[str, str]:
    """("kind", "param") from a state key; ("", "param") for a weight."""
    kind, _, param = name.rpartition(":")
    return kind, param
