"""The search space: every DistConfig a job of a given size could run, pruned by the model and the nodes.

dp x tp x pp = number of devices, sp on or off wherever tp > 1, fsdp on or off wherever dp > 1 and
pp = 1, and each with activation recomputation none, selective or full (slower, less memory: they
win a length only where memory binds). Context parallelism is not enumerated. A config is pruned,
with the reason kept for the report, when:

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
from hotswitch.distconfig.config import RECOMPUTE, default_name
from hotswitch.switch.cluster import check_config

from .workload import Workload

__all__ = ["NoConfigFits", "Space", "default_base", "enumerate_configs", "plain"]


class NoConfigFits(ValueError):
    """No config holds some length (a bucket) within the memory budget."""


def default_base(configs: Sequence[DistConfig]) -> DistConfig:
    """The most model-parallel config (fsdp's dp counting as model-parallel: it shards the state
    too): it needs the least memory for masters and optimizer states (the Trainer's base, and the
    search's)."""
    return max(configs, key=lambda c: (c.tp * c.pp * (c.dp if c.fsdp else 1), c.sp, -c.dp))


def plain(config: DistConfig) -> DistConfig:
    """`config` without fsdp and recomputation: the config whose compiled collectives a variant's
    are priced from (`cost.micro_batch_work`), so that calibration lowers each layout once."""
    if not config.fsdp and config.recompute == "none":
        return config
    c = config
    return DistConfig(default_name(c.dp, c.tp, c.pp, c.sp, c.cp), dp=c.dp, tp=c.tp, pp=c.pp, sp=c.sp, cp=c.cp,
                      devices=c.devices)


@dataclass(frozen=True, slots=True)
class Space:
    """The configs worth pricing, and every config left out with its reason (name -> why)."""

    configs: tuple[DistConfig, ...]
    pruned: tuple[tuple[str, str], ...]

    @property
    def plain(self) -> tuple[DistConfig, ...]:
        """The configs without fsdp or recomputation (`plain`): the ones calibration measures."""
        return tuple(c for c in self.configs if plain(c) is c)


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
                for fsdp in (False, True) if dp > 1 and pp == 1 else (False,):
                    for recompute in RECOMPUTE:
                        config = DistConfig(default_name(dp, tp, pp, sp, fsdp=fsdp, recompute=recompute), dp=dp,
                                            tp=tp, pp=pp, sp=sp, fsdp=fsdp, recompute=recompute)
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
