"""A deliberately simple planner, for tests only: the four algorithms of `hotswitch.planner`, in loops.

It follows the semantics documented in `hotswitch.planner`'s module docstring, written from the
documentation rather than from the vectorized code, so that the two can be checked against each
other on small cases (same transfers, same bytes, same estimates and bounds):

- Work items, in order: for every tensor (order of `moves`), every receiver (a device of the
  destination mesh with a non-empty box, ascending id), every source box (a distinct non-empty box
  of the source layout) that meets the receiver's box, in row-major order of the intersection
  ("slice"). The slice's owners are the devices holding that source box, ascending. A receiver that
  owns the slice copies it locally (all algorithms).
- greedy: owners on the receiver's node if any (intra-node link), else all owners (inter-node link);
  items with one candidate are committed first, then the others in item order, each to the
  candidate with the least load on that link so far (ties: lowest id). Relay first: a (tensor,
  slice) that no device of a node owns and several of its receivers need goes to one of them (the
  least inter-node receive load so far, ties lowest id; slices needed by one receiver of the node
  counted first, then shared ones in the order of their first item), who forwards it to the others
  in a second stage; only that receiver's item chooses a sender. The relays are kept only when the
  plan's estimate is lower with them.
- fcfs: the lowest-id owner. round_robin: the k-th receiver lacking a (tensor, slice), by id, takes
  the slice's owners in turn (owner k mod n). gather: every receiver gets every source box it does
  not own, whole, from the box's lowest-id owner.
- Pricing and lower bounds: the planner's formulas, summed per device / receiver / owner set.

Nothing here is vectorized or cached: it is O(tensors x devices x boxes) Python, fine for tests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hotswitch.distconfig import Topology
from hotswitch.distconfig.layout import Box
from hotswitch.switch.planner import ALGORITHMS, TensorMove, Transfer

__all__ = ["ReferencePlan", "plan_switch"]


@dataclass(frozen=True)
class ReferencePlan:
    algorithm: str
    transfers: list[Transfer]
    local_copies: list[Transfer]
    relays: list[Transfer]
    bytes_moved: int
    inter_node_bytes: int
    intra_node_bytes: int
    send_bytes_intra: list[int]
    send_bytes_inter: list[int]
    recv_bytes_intra: list[int]
    recv_bytes_inter: list[int]
    lower_bound_bytes: int
    inter_node_lower_bound_bytes: int
    lower_bound_seconds: float
    estimated_seconds: float


@dataclass
class _Item:
    tensor: int
    recv: int
    box: Box  # the slice
    owners: tuple[int, ...]  # ascending
    nbytes: int


def _intersect(a: Box, b: Box) -> Box | None:
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if hi <= lo:
            return None
        out.append((lo, hi))
    return tuple(out)


def _volume(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def plan_switch(moves: Sequence[TensorMove], topology: Topology, algorithm: str = "greedy") -> ReferencePlan:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown switch algorithm {algorithm!r}; use one of {ALGORITHMS}")
    dpn = topology.devices_per_node

    def node(d: int) -> int:
        return d // dpn

    items: list[_Item] = []  # slices receivers lack, in item order
    local_copies: list[Transfer] = []
    lower_bound_bytes = 0
    gather: list[Transfer] = []
    for t, m in enumerate(moves):
        owners = {box: tuple(sorted(devs)) for box, devs in m.src.owners().items()}
        dst_owners = m.dst.owners()
        receivers = sorted(d for devs in dst_owners.values() for d in devs)
        for r in receivers:
            mine = m.dst.box(r)
            own_box = next((b for b, devs in owners.items() if r in devs), None)
            # lower bound: what the receiver's box holds beyond its own source box
            kept = _intersect(mine, own_box) if own_box is not None else None
            lower_bound_bytes += (_volume(mine) - (_volume(kept) if kept is not None else 0)) * m.itemsize
            pieces = []
            for box, devs in owners.items():
                piece = _intersect(mine, box)
                if piece is not None:
                    pieces.append((piece, devs))
            for piece, devs in sorted(pieces, key=lambda p: [a for a, _ in p[0]]):
                nbytes = _volume(piece) * m.itemsize
                if r in devs:
                    local_copies.append(Transfer(m.name, r, r, piece, nbytes))
                else:
                    items.append(_Item(t, r, piece, devs, nbytes))
            if algorithm == "gather":
                for box, devs in owners.items():
                    if r not in devs:
                        gather.append(Transfer(m.name, devs[0], r, box, _volume(box) * m.itemsize))

    def build(forwarded: dict[int, int]) -> ReferencePlan:
        return _plan(moves, topology, algorithm, items, local_copies, gather, lower_bound_bytes, forwarded)

    forwarded = _relays(items, node, topology.num_devices) if algorithm == "greedy" else {}
    if not forwarded:
        return build({})
    plain, relayed = build({}), build(forwarded)
    return relayed if relayed.estimated_seconds < plain.estimated_seconds else plain


def _plan(moves, topology: Topology, algorithm: str, items: list[_Item], local_copies: list[Transfer],
          gather: list[Transfer], lower_bound_bytes: int, forwarded: dict[int, int]) -> ReferencePlan:
    dpn = topology.devices_per_node

    def node(d: int) -> int:
        return d // dpn

    relays: list[Transfer] = []
    if algorithm == "gather":
        transfers = gather
    else:
        direct = [it for i, it in enumerate(items) if i not in forwarded]
        senders = _choose(direct, algorithm, node, topology.num_devices)
        transfers = [Transfer(moves[it.tensor].name, s, it.recv, it.box, it.nbytes) for it, s in zip(direct, senders)]
        relays = [Transfer(moves[items[i].tensor].name, r, items[i].recv, items[i].box, items[i].nbytes)
                  for i, r in sorted(forwarded.items())]

    n = topology.num_devices
    bi, be = topology.intra_node_bandwidth, topology.inter_node_bandwidth
    send_intra, send_inter, recv_intra, recv_inter = [0] * n, [0] * n, [0] * n, [0] * n
    estimated = 0.0
    for stage in (transfers, relays):
        loads = [[0] * n for _ in range(4)]  # send intra, send inter, receive intra, receive inter
        for tr in stage:
            assert tr.src_device != tr.dst_device
            near = node(tr.src_device) == node(tr.dst_device)
            loads[0 if near else 1][tr.src_device] += tr.nbytes
            loads[2 if near else 3][tr.dst_device] += tr.nbytes
        for total, part in zip((send_intra, send_inter, recv_intra, recv_inter), loads):
            for d in range(n):
                total[d] += part[d]
        estimated += max([max(loads[0][d] / bi, loads[1][d] / be, loads[2][d] / bi, loads[3][d] / be)
                          for d in range(n)], default=0.0)
    inter_once = {(it.tensor, it.box, node(it.recv)): it.nbytes for it in items
                  if not any(node(d) == node(it.recv) for d in it.owners)}
    return ReferencePlan(
        algorithm=algorithm,
        transfers=transfers,
        local_copies=local_copies,
        relays=relays,
        bytes_moved=sum(tr.nbytes for tr in transfers + relays),
        inter_node_bytes=sum(send_inter),
        intra_node_bytes=sum(send_intra),
        send_bytes_intra=send_intra,
        send_bytes_inter=send_inter,
        recv_bytes_intra=recv_intra,
        recv_bytes_inter=recv_inter,
        lower_bound_bytes=lower_bound_bytes,
        inter_node_lower_bound_bytes=sum(inter_once.values()),
        lower_bound_seconds=_lower_bound_seconds(items, node, bi, be, topology.devices_per_node),
        estimated_seconds=estimated,
    )


def _candidates(it: _Item, node) -> tuple[tuple[int, ...], int]:
    """The owners to choose from and the link class (0 intra-node, 1 inter-node)."""
    near = tuple(d for d in it.owners if node(d) == node(it.recv))
    return (near, 0) if near else (it.owners, 1)


def _relays(items: list[_Item], node, num_devices: int) -> dict[int, int]:
    """Item index -> the receiver on its node that forwards it to it (greedy's relay)."""
    groups: dict[tuple, list[int]] = {}  # (tensor, slice, node) -> items, in item order
    for i, it in enumerate(items):
        if not any(node(d) == node(it.recv) for d in it.owners):
            groups.setdefault((it.tensor, it.box, node(it.recv)), []).append(i)
    load = [0] * num_devices  # inter-node bytes received so far
    for members in groups.values():
        if len(members) == 1:
            load[items[members[0]].recv] += items[members[0]].nbytes
    out = {}
    for members in sorted((m for m in groups.values() if len(m) > 1), key=lambda m: m[0]):
        best = min(members, key=lambda i: (load[items[i].recv], items[i].recv))
        load[items[best].recv] += items[best].nbytes
        out.update({i: items[best].recv for i in members if i != best})
    return out


def _choose(items: list[_Item], algorithm: str, node, num_devices: int) -> list[int]:
    if algorithm == "fcfs":
        return [it.owners[0] for it in items]
    if algorithm == "round_robin":
        taken: dict[tuple[int, Box], int] = {}  # receivers served so far per (tensor, slice)
        out = []
        for it in items:  # item order puts one slice's receivers in ascending id
            k = taken.get((it.tensor, it.box), 0)
            taken[(it.tensor, it.box)] = k + 1
            out.append(it.owners[k % len(it.owners)])
        return out
    assert algorithm == "greedy"
    loads = [[0] * num_devices, [0] * num_devices]  # per link class
    out: list[int | None] = [None] * len(items)
    for i, it in enumerate(items):  # single-candidate items first
        cands, c = _candidates(it, node)
        if len(cands) == 1:
            out[i] = cands[0]
            loads[c][cands[0]] += it.nbytes
    for i, it in enumerate(items):
        if out[i] is not None:
            continue
        cands, c = _candidates(it, node)
        best = min(cands, key=lambda d: (loads[c][d], d))
        out[i] = best
        loads[c][best] += it.nbytes
    return out


def _lower_bound_seconds(items: list[_Item], node, bi: float, be: float, devices_per_node: int) -> float:
    """The planner's per-receiver, per-node and per-owner-set bounds, summed with dicts."""
    per_recv: dict[int, list[int]] = {}
    per_node: dict[int, int] = {}
    per_set: dict[tuple[int, ...], list[int]] = {}
    seen = set()  # (tensor, slice, node): the node and the owner set count each once
    for it in items:
        near = sum(node(d) == node(it.recv) for d in it.owners)
        k = 0 if near == len(it.owners) else 1 if near == 0 else 2  # I, E, F
        per_recv.setdefault(it.recv, [0, 0, 0])[k] += it.nbytes
        if (it.tensor, it.box, node(it.recv)) in seen:
            continue
        seen.add((it.tensor, it.box, node(it.recv)))
        if k == 1:
            per_node[node(it.recv)] = per_node.get(node(it.recv), 0) + it.nbytes
        per_set.setdefault(it.owners, [0, 0, 0])[k] += it.nbytes

    best = 0.0
    for i, e, f in per_recv.values():
        best = max(best, i / bi, (i + e + f) / (bi + be))
    for e in per_node.values():
        best = max(best, e / (devices_per_node * be))
    for owners, (i, e, f) in per_set.items():
        best = max(best, max(i / bi, e / be, (i + e + f) / (bi + be)) / len(owners))
    return best
