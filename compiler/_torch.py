"""The private torch APIs the compiler uses outside torch.distributed.tensor (that is `_dtensor.py`),
behind names of ours, so that an upstream change breaks this file and no other. Pinned to torch 2.13."""
from __future__ import annotations

import torch
from torch._decomp import core_aten_decompositions
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

__all__ = ["FakeTensorMode", "OpOverload", "core_aten_decompositions", "detect_fake_mode", "is_mutable", "op_schema",
           "pytree"]

OpOverload = torch._ops.OpOverload


def op_schema(target):
    """The schema of an aten op overload (arguments, their alias and mutation annotations)."""
    return target._schema


def is_mutable(target) -> bool:
    """Does the op write into one of its inputs?"""
    return isinstance(target, OpOverload) and target._schema.is_mutable
