"""The private torch.distributed (c10d) calls elastic regrouping needs, in one place (torch 2.13).

gloo has no public way to drop every process group after a peer died (`destroy_process_group`
waits on the dead peer) or to change the timeout of existing groups.
"""
from __future__ import annotations

import datetime

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["abort_all_groups", "process_groups", "set_timeout"]


def abort_all_groups() -> None:
    """Abort and forget every process group of this process, so init_process_group can run again."""
    if dist.is_initialized():
        c10d._abort_process_group()


def process_groups() -> list:
    """Every live process group of this process (the default one and all subgroups)."""
    return list(c10d._world.pg_map)


def set_timeout(timeout: datetime.timedelta, group) -> None:
    """The timeout of every later operation on `group`."""
    c10d._set_pg_timeout(timeout, group)
