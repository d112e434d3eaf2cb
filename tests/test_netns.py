"""Emulated nodes (network namespaces joined by shaped links): functional checks, no timing."""
import os
import shutil
import subprocess

import pytest
import torch
import torch.distributed as dist

from hotswitch.distributed.launch import launch
from hotswitch.distributed.netns import EmulatedNodes

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
                                reason="network namespaces need root and iproute2")


def _where(rank):
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)  # crosses the shaped link between the two nodes
    peers = [None] * dist.get_world_size()
    dist.all_gather_object(peers, (os.stat("/proc/self/ns/net").st_ino, os.environ["GLOO_SOCKET_IFNAME"]))
    return x.item(), peers


def test_nodes_are_separate_namespaces_and_ranks_still_form_one_group():
    home = os.stat("/proc/self/ns/net").st_ino
    with EmulatedNodes(2, inter_node_gbit=2.0) as nodes:
        total, peers = launch(_where, 4, devices_per_node=2, nodes=nodes, timeout=120)
        names = [nodes.node_namespace(0), nodes.node_namespace(1)]
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(n in listed for n in names)
    assert total == 0 + 1 + 2 + 3
    inodes = [ino for ino, _ in peers]
    assert inodes[0] == inodes[1] != inodes[2] == inodes[3]  # ranks 0,1 on node 0; 2,3 on node 1
    assert home not in inodes  # and neither is the namespace the test runs in
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)  # removed on exit
    assert os.stat("/proc/self/ns/net").st_ino == home  # the launcher came back home
