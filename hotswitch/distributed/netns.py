"""Emulated multi-node networking on one machine, for honest switching benchmarks.

On loopback every byte costs the same, so a plan that keeps traffic inside nodes looks no better
than one that does not. `EmulatedNodes` gives each simulated node its own Linux network namespace;
the nodes meet on a bridge through veth links shaped with `tc tbf` to the inter-node bandwidth.
Ranks of one node talk over their namespace's local path (fast); ranks of different nodes cross a
shaped link (slow), as on a real cluster. Addresses are link-local (169.254.77.0/24) and exist only
inside namespaces this process created; everything is removed on exit. Needs root and iproute2.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
from dataclasses import dataclass, field

_CLONE_NEWNET = 0x40000000
INTERFACE = "hseth"  # the node-side link in every node namespace (names are per namespace)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _run(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, text=True)


def enter_namespace(name: str) -> None:
    """Move the calling process into network namespace `name` (before it opens any socket)."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name!r} failed")
    finally:
        os.close(fd)


@contextlib.contextmanager
def in_namespace(name: str | None):
    """Run the block in network namespace `name` (None: stay), then return to this one. Sockets opened
    in the block stay in `name` (how one process talks to a node's address)."""
    if name is None:
        yield
        return
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        enter_namespace(name)
        yield
    finally:
        ctypes.CDLL(None, use_errno=True).setns(home, _CLONE_NEWNET)
        os.close(home)


@dataclass
class EmulatedNodes:
    """`num_nodes` network namespaces joined by links of `inter_node_gbit` Gbit/s each way."""

    num_nodes: int
    inter_node_gbit: float = 1.0
    prefix: str = field(default_factory=lambda: f"hs{os.getpid()}")
    _created: list[str] = field(default_factory=list, repr=False)

    def node_namespace(self, node: int) -> str:
        return f"{self.prefix}n{node}"

    def address(self, node: int) -> str:
        return f"169.254.77.{node + 1}"

    def __enter__(self) -> EmulatedNodes:
        if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
            raise RuntimeError("emulating nodes needs root and iproute2 (`ip`, `tc`); run the benchmark without "
                               "--emulate-nodes to measure on loopback only")
        try:
            switch = f"{self.prefix}sw"
            _ip("netns", "add", switch)
            self._created.append(switch)
            _ip("netns", "exec", switch, "ip", "link", "add", "br0", "type", "bridge")
            _ip("netns", "exec", switch, "ip", "link", "set", "br0", "up")
            rate = f"{self.inter_node_gbit}gbit"
            for node in range(self.num_nodes):
                ns = self.node_namespace(node)
                _ip("netns", "add", ns)
                self._created.append(ns)
                port = f"{self.prefix}p{node}"
                _ip("link", "add", INTERFACE + str(node), "type", "veth", "peer", "name", port)
                _ip("link", "set", INTERFACE + str(node), "netns", ns)
                _ip("link", "set", port, "netns", switch)
                _ip("netns", "exec", ns, "ip", "link", "set", INTERFACE + str(node), "name", INTERFACE)
                _ip("netns", "exec", ns, "ip", "addr", "add", f"{self.address(node)}/24", "dev", INTERFACE)
                _ip("netns", "exec", ns, "ip", "link", "set", INTERFACE, "up")
                _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
                _ip("netns", "exec", switch, "ip", "link", "set", port, "master", "br0")
                _ip("netns", "exec", switch, "ip", "link", "set", port, "up")
                for where, dev in ((ns, INTERFACE), (switch, port)):  # shape both directions
                    _run("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                         "rate", rate, "burst", "512kb", "latency", "100ms")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in reversed(self._created):  # deleting a namespace deletes its links
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._created.clear()

    def rank_env(self, rank: int, devices_per_node: int) -> dict[str, str]:
        """Environment for a rank: its node's namespace and the interface gloo must use."""
        # link-local peers have no reverse DNS: c10d would warn once per socket that it cannot name them
        return {"HOTSWITCH_NETNS": self.node_namespace(rank // devices_per_node), "GLOO_SOCKET_IFNAME": INTERFACE,
                "TORCH_CPP_LOG_LEVEL": "ERROR"}
