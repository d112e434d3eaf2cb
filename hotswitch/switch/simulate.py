"""Predicted wall time of a switch plan on a GPU cluster: links, shared NICs and per-message latency.

The planner's own `estimated_seconds` prices a plan as if every byte flowed at full link speed with
no start-up cost: per device, the largest of its four loads (intra-/inter-node x send/receive) over
the link's bandwidth, the links overlapping. `simulate` keeps that model (same bandwidths: the
plan's Topology) and adds what is cheap to know and honest to charge:

- **Per-message latency.** The executor sends one fused buffer per (sender, receiver) pair; each
  costs `intra_latency` (NVLink, default 5 us) or `inter_latency` (network, default 10 us) on both
  the sender's and the receiver's link of that class, serialized with that link's bytes (alpha-beta
  model). A plan that scatters a device's data over many peers pays for it.
- **Shared node NICs.** A node's devices share `node_inter_bandwidth` bytes/s out of and into the
  node (default devices_per_node x the per-device inter-node bandwidth: one NIC per GPU, as on
  DGX H100 with 8 x 400 Gb/s, where it never binds beyond the per-device links). Set it lower for
  nodes with fewer NICs than GPUs (e.g. 4 NICs for 8 GPUs: 4 x 50 GB/s), where the node, not the
  device, is the bottleneck of inter-node traffic.

Every term is at least the planner's corresponding term (same bytes, same or smaller bandwidth,
plus non-negative latency), so `seconds >= plan.estimated_seconds >= plan.lower_bound_seconds`.
Not modelled: congestion inside the network fabric (a non-blocking fat tree is assumed), the
packing and unpacking of fused buffers (memory-bandwidth bound, about 1 ms per GB on a GPU), and
stragglers.

`gpu_cluster()` builds the Topology of H100-class nodes: NVLink about 450 GB/s per GPU and
direction, one 400 Gb/s (50 GB/s) NIC per GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from hotswitch.distconfig import Topology

__all__ = [
    "NIC_BANDWIDTH", "NVLINK_BANDWIDTH", "Simulation", "compare_algorithms", "gpu_cluster", "plot_send_volume",
    "report", "simulate",
]

NVLINK_BANDWIDTH = 450e9  # bytes/s per GPU and direction (H100 NVLink 4: 900 GB/s bidirectional)
NIC_BANDWIDTH = 50e9  # bytes/s per GPU and direction (one 400 Gb/s InfiniBand / RoCE NIC per GPU)
INTRA_LATENCY = 5e-6
INTER_LATENCY = 10e-6

_TERMS = ("intra send", "inter send", "intra recv", "inter recv")  # link class and direction


def gpu_cluster(
    num_devices: int,
    devices_per_node: int = 8,
    intra_node_bandwidth: float = NVLINK_BANDWIDTH,
    inter_node_bandwidth: float = NIC_BANDWIDTH,
) -> Topology:
    """A Topology of H100-class nodes (bandwidths in bytes/s per device and direction)."""
    return Topology(num_devices, devices_per_node, intra_node_bandwidth, inter_node_bandwidth)


@dataclass(frozen=True, eq=False)
class Simulation:
    """Predicted time of one plan. `per_device_seconds[d]`: device d's slowest link (bytes + latency);
    `per_node_seconds[k]`: node k's shared NICs; `seconds`: the largest of all of them."""

    algorithm: str
    seconds: float
    busiest_device: int
    bottleneck: str  # e.g. "dev 17 inter recv" (its inter-node receive link) or "node 3 NICs out"
    per_device_seconds: np.ndarray = field(repr=False)
    per_node_seconds: np.ndarray = field(repr=False)
    latency_seconds: float  # the busiest device's share of `seconds` spent on message latency
    messages: int  # (sender, receiver) pairs, one fused buffer each
    plan_estimated_seconds: float
    lower_bound_seconds: float

    @property
    def bound_ratio(self) -> float:
        """seconds / the plan's lower bound: 1.0 when nothing needs to move and nothing does, inf when
        nothing needs to move but the plan moves something anyway (`gather`)."""
        if self.lower_bound_seconds:
            return self.seconds / self.lower_bound_seconds
        return 1.0 if self.seconds == 0 else math.inf

    def summary(self) -> dict:
        return {
            "algorithm": self.algorithm,
            "seconds": self.seconds,
            "busiest_device": self.busiest_device,
            "bottleneck": self.bottleneck,
            "latency_seconds": self.latency_seconds,
            "messages": self.messages,
            "plan_estimated_seconds": self.plan_estimated_seconds,
            "lower_bound_seconds": self.lower_bound_seconds,
            "bound_ratio": _finite(self.bound_ratio),
        }


def simulate(
    plan,
    *,
    intra_latency: float = INTRA_LATENCY,
    inter_latency: float = INTER_LATENCY,
    node_inter_bandwidth: float | None = None,
) -> Simulation:
    """Predict how long `plan` (a `SwitchPlan`) takes on its Topology (see the module doc)."""
    topo: Topology = plan.topology
    n, dpn = topo.num_devices, topo.devices_per_node
    be = topo.inter_node_bandwidth
    for name, value in (("intra_latency", intra_latency), ("inter_latency", inter_latency)):
        if not 0 <= value < float("inf"):
            raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")
    node_bw = dpn * be if node_inter_bandwidth is None else float(node_inter_bandwidth)
    if not 0 < node_bw < float("inf"):
        raise ValueError(f"node_inter_bandwidth must be a positive number of bytes/s, got {node_inter_bandwidth!r}")

    stages = [_stage(a, topo, node_bw, intra_latency, inter_latency)
              for a in (plan.transfer_array, plan.relay_array) if len(a)]
    if not stages:
        seconds, bottleneck, busiest, latency_seconds, messages = 0.0, "nothing moves", 0, 0.0, 0
        per_device, per_node = np.zeros(n), np.zeros(topo.num_nodes)
    else:  # a relay stage starts when the first has arrived: the stages add up
        seconds = sum(st.seconds for st in stages)
        slowest = max(range(len(stages)), key=lambda i: stages[i].seconds)
        bottleneck = ("relay stage: " if slowest else "") + stages[slowest].bottleneck
        busiest, latency_seconds = stages[slowest].busiest_device, stages[slowest].latency_seconds
        messages = sum(st.messages for st in stages)
        per_device = sum(st.per_device_seconds for st in stages)
        per_node = sum(st.per_node_seconds for st in stages)
    assert seconds >= plan.estimated_seconds * (1 - 1e-12), "a simulated link beat the planner's estimate"
    return Simulation(
        algorithm=plan.algorithm,
        seconds=seconds,
        busiest_device=busiest,
        bottleneck=bottleneck,
        per_device_seconds=per_device,
        per_node_seconds=per_node,
        latency_seconds=latency_seconds,
        messages=messages,
        plan_estimated_seconds=plan.estimated_seconds,
        lower_bound_seconds=plan.lower_bound_seconds,
    )


class _Stage(NamedTuple):
    seconds: float
    bottleneck: str
    busiest_device: int
    latency_seconds: float  # of the busiest device's bottleneck term
    messages: int
    per_device_seconds: np.ndarray
    per_node_seconds: np.ndarray


def _stage(tr: np.ndarray, topo: Topology, node_bw: float, intra_latency: float, inter_latency: float) -> _Stage:
    """One stage of transfers (a plan's first, or its relay stage) simulated alone."""
    n, dpn, nodes = topo.num_devices, topo.devices_per_node, topo.num_nodes
    s, d, nb = tr["src"].astype(np.int64), tr["dst"].astype(np.int64), tr["nbytes"]
    near = s // dpn == d // dpn
    loads = [np.bincount(s[near], weights=nb[near], minlength=n), np.bincount(s[~near], weights=nb[~near], minlength=n),
             np.bincount(d[near], weights=nb[near], minlength=n), np.bincount(d[~near], weights=nb[~near], minlength=n)]
    # one message per (sender, receiver) pair; count each device's peers per link class and direction
    pairs = np.unique(s * n + d)
    src, dst = pairs // n, pairs % n
    intra = src // dpn == dst // dpn
    msgs = [np.bincount(src[intra], minlength=n), np.bincount(src[~intra], minlength=n),
            np.bincount(dst[intra], minlength=n), np.bincount(dst[~intra], minlength=n)]
    bandwidth = (topo.intra_node_bandwidth, topo.inter_node_bandwidth) * 2
    latency = (intra_latency, inter_latency, intra_latency, inter_latency)
    terms = np.stack([load / bw + m * lat for load, m, bw, lat in zip(loads, msgs, bandwidth, latency)])
    per_device = terms.max(axis=0)
    out_of = np.bincount(np.arange(n) // dpn, weights=loads[1], minlength=nodes) / node_bw
    into = np.bincount(np.arange(n) // dpn, weights=loads[3], minlength=nodes) / node_bw
    per_node = np.maximum(out_of, into)
    busiest = int(per_device.argmax())
    term = int(terms[:, busiest].argmax())
    seconds, bottleneck = float(per_device[busiest]), f"dev {busiest} {_TERMS[term]}"
    node = int(per_node.argmax())
    if per_node[node] > seconds:
        seconds = float(per_node[node])
        bottleneck = f"node {node} NICs {'out' if out_of[node] >= into[node] else 'in'}"
    return _Stage(seconds, bottleneck, busiest, float(msgs[term][busiest] * latency[term]), len(pairs), per_device,
                  per_node)


# ---------------------------------------------------------------- comparing algorithms


def compare_algorithms(moves, topology: Topology, algorithms=None, **simulate_options) -> dict:
    """Plan `moves` with every algorithm (default all four) and simulate each: {algorithm: (plan, simulation)}."""
    from hotswitch.switch.planner import ALGORITHMS, plan_switch

    out = {}
    for algorithm in algorithms or ALGORITHMS:
        plan = plan_switch(moves, topology, algorithm)
        out[algorithm] = (plan, simulate(plan, **simulate_options))
    return out


def report(plan, sim: Simulation) -> dict:
    """One JSON-friendly row: the plan's bytes and bounds, the simulated time as `estimated_seconds`."""
    return {
        "bytes_moved": plan.bytes_moved,
        "inter_node_bytes": plan.inter_node_bytes,
        "intra_node_bytes": plan.intra_node_bytes,
        "max_send_bytes": plan.max_send_bytes,
        "max_recv_bytes": plan.max_recv_bytes,
        "lower_bound_bytes": plan.lower_bound_bytes,
        "lower_bound_seconds": plan.lower_bound_seconds,
        "estimated_seconds": sim.seconds,
        "plan_estimated_seconds": plan.estimated_seconds,
        "bound_ratio": _finite(sim.bound_ratio),
        "bottleneck": sim.bottleneck,
        "latency_seconds": sim.latency_seconds,
        "messages": sim.messages,
        "num_transfers": int(len(plan.transfer_array)),
        "num_relays": int(len(plan.relay_array)),
        "inter_node_lower_bound_bytes": plan.inter_node_lower_bound_bytes,
        "planning_seconds": plan.planning_seconds,
    }


def _finite(x: float) -> float | None:
    """JSON has no infinity: None stands for it."""
    return x if math.isfinite(x) else None


def plot_send_volume(plans: dict, path: str, title: str = "") -> None:
    """Heatmaps of the bytes each device sends (rows: nodes, columns: devices of a node), one per plan."""
    import matplotlib

    matplotlib.use("Agg")
    import textwrap

    import matplotlib.pyplot as plt

    names = list(plans)
    topo = plans[names[0]].topology
    height = min(12.0, 2.5 + 0.08 * topo.num_nodes)
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), height), squeeze=False, layout="constrained")
    for ax, name in zip(axes[0], names):  # one colour scale per plan: their maxima differ by orders of magnitude
        grid = plans[name].send_bytes.reshape(topo.num_nodes, topo.devices_per_node) / 1e9
        im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0.0,
                       vmax=float(grid.max(initial=0.0)) or 1.0)
        ax.set_title(f"{name}: max {grid.max(initial=0.0):.2f} GB", fontsize=9)
        ax.set_xlabel("device in node")
        ax.set_xticks(range(topo.devices_per_node))
        fig.colorbar(im, ax=ax, label="GB sent")
    axes[0][0].set_ylabel("node")
    if title:
        fig.suptitle(textwrap.fill(title, 110), fontsize=9)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
