"""The private torch.distributed (c10d) calls hotswitch needs, in one place (torch 2.13).

gloo has no public way to drop every process group after a peer died (`destroy_process_group`
waits on the dead peer) or to change the timeout of existing groups; profiling one rank of a large
job on one device needs torch's fake process group (collectives return without communicating),
which torch ships among its testing utilities.
"""
from __future__ import annotations

import datetime

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["abort_all_groups", "default_store", "init_fake_process_group", "process_groups", "set_timeout"]


def abort_all_groups() -> None:
    """Abort and forget every process group of this process, so init_process_group can run again."""
    if dist.is_initialized():
        c10d._abort_process_group()


def default_store():
    """The key-value store the default process group was formed on (None without one): ranks use it
    to hand each other small results without a collective."""
    if not dist.is_initialized():
        return None
    return c10d._get_default_store()


def process_groups() -> list:
    """Every live process group of this process (the default one and all subgroups)."""
    return list(c10d._world.pg_map)


def set_timeout(timeout: datetime.timedelta, group) -> None:
    """The timeout of every later operation on `group`."""
    c10d._set_pg_timeout(timeout, group)


def init_fake_process_group(rank: int, world_size: int) -> None:
    """Make this process rank `rank` of a default process group of `world_size` ranks in which every
    collective returns at once without moving data (torch's "fake" backend): one rank's program of a
    large job runs on one device, with its real local shapes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
