"""The search space: every DistConfig a job of a given size could run, pruned by the model and the nodes.

dp x tp x pp = number of devices, sp on or off wherever tp > 1 (DistConfig has no context-parallel
axis, so none is enumerated). A config is pruned, with the reason kept for the report, when:

- tp does not fit inside a node (tp > devices per node, or does not divide it): tensor parallelism
  issues collectives in every layer, so Megatron keeps it on NVLink; the mesh puts tp innermost, so
  a tp group of consecutive ranks stays within one node exactly when tp divides the node size;
- the model cannot be sharded so: tp must give every rank whole attention heads, and grouped-query
  kv heads and tp must divide one another (the compiler's rule, `cluster.check_config` /
  `compiler.tp_rules.heads_sharded`), and pp may not exceed the number of blocks;
- the workload runs pp = 1 only (the Trainer: pipeline configs train through
  `CompiledModel.forward_backward(..., micro_batches=k)` instead).

Memory is pruned per length later (`hotswitch.search.search`), where the budget is known.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hotswitch.distconfig import DistConfig, Topology
from hotswitch.distconfig.config import default_name
from hotswitch.switch.cluster import check_config

from .workload import Workload

__all__ = ["NoConfigFits", "Space", "default_base", "enumerate_configs"]


class NoConfigFits(ValueError):
    """No config holds some length (a bucket) within the memory budget."""


def default_base(configs: Sequence[DistConfig]) -> DistConfig:
    """The most model-parallel config: it needs the least memory for masters and optimizer states
    (the Trainer's base, and the search's)."""
    return max(configs, key=lambda c: (c.tp * c.pp, c.sp, -c.dp))


@dataclass(frozen=True, slots=True)
class Space:
    """The configs worth pricing, and every config left out with its reason (name -> why)."""

    configs: tuple[DistConfig, ...]
    pruned: tuple[tuple[str, str], ...]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_configs(workload: Workload, topology: Topology) -> Space:
    """Every (dp, tp, pp, sp) on `topology.num_devices` devices, pruned (see the module doc); ordered by
    tp, then pp, then sp, so that ties in cost keep the least model-parallel config first."""
    n, per_node = topology.num_devices, topology.devices_per_node
    configs, pruned = [], []
    for tp in _divisors(n):
        for pp in _divisors(n // tp):
            dp = n // (tp * pp)
            for sp in (False, True) if tp > 1 else (False,):
                config = DistConfig(default_name(dp, tp, pp, sp), dp=dp, tp=tp, pp=pp, sp=sp)
                reason = _reason(workload, config, n, per_node)
                if reason:
                    pruned.append((config.name, reason))
                else:
                    configs.append(config)
    return Space(tuple(configs), tuple(pruned))


def _reason(workload: Workload, config: DistConfig, n: int, per_node: int) -> str | None:
    if config.tp > per_node or per_node % config.tp:
        return f"tp={config.tp} does not fit in a node of {per_node} devices"
    if config.pp > 1 and not workload.pipeline:
        return "pp > 1: the Trainer runs pp = 1 configs"
    try:
        check_config(workload.model, config, n)
    except ValueError as e:
        return str(e).split(": ", 1)[-1]
    return None
