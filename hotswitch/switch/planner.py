"""Switch planner: which device sends which slice of which tensor to whom when the layout changes.

Pure planning (no process group, numpy only, deterministic): every rank computes the same plan from
the same TensorMoves and Topology, so senders and receivers agree without a coordinator.

**Finest common slicing.** A Layout's distinct non-empty boxes form a grid: along every tensor dim
the intervals partition the dim (nested torch.chunk splits), and a box is one interval per dim. So
the source and destination grids of a tensor are refined dim by dim (the union of their interval
starts), and every cell of the product of those refined intervals ("slice") lies in exactly one
source box and one destination box. A work item is (tensor, receiver, slice) for every destination
device and every slice of its box; the source box's devices are the slice's owners (a Replicate
axis gives several). This is all array work (`_Geometry`), cached per (shapes, placements), then
mapped to device ids per (source Layout, destination Layout) pair, so the only Python loops are over
tensors and over the greedy's choices.

**Algorithms** (every one but `gather` keeps what the receiver already holds as a local copy):

- `greedy` (HotSPa's, in bytes): among the owners on the receiver's node pick the one with the least
  intra-node send load so far; only if no owner shares the node, the owner with the least
  inter-node send load; ties -> lowest device id; the bytes go to that sender's load (intra and
  inter loads kept apart: the links overlap in time). Order: work items with a single candidate
  sender are committed first (their loads are fixed whatever the order), then the items with a
  choice in (tensor order of `moves`, receiver device id, slice in row-major order) order.
  **Relay**: a slice that no device of a node owns, needed by several receivers there, crosses the
  node link once: to the receiver among them with the least inter-node receive load so far (ties ->
  lowest id; receivers that need a slice alone there are counted first, then the shared slices in
  item order of their first receiver), which forwards it to the others inside the node in a second
  stage of the switch (`relays`), from its new shard. Only the relay's item goes through the
  sender choice above. The relays are kept only when they make the plan's estimate faster (they
  save node-link bytes but add a stage); otherwise the plan is the one without them.
- `fcfs`: the owner with the lowest device id.
- `round_robin`: per (tensor, slice), the receivers that lack it (by device id) take its owners
  (by device id) in turn.
- `gather`: the "gather full tensors, then slice" baseline: every receiver with a non-empty
  destination box receives every source box it does not hold, whole, from the box's lowest-id
  owner, then keeps the part inside its own box (`Transfer.dst_local` / `Transfer.piece_local`);
  the part of its own source box inside its destination box is a local copy.

**Pricing.** Each device has an intra-node and an inter-node link, each with separate send and
receive directions, all four overlapping (HotSPa). A stage's time is its busiest device's: the
largest of that device's four loads divided by the link's bandwidth; the plan's
`estimated_seconds` is the first stage's plus the relay stage's.

**Lower bounds** (algorithm-independent, valid for any plan that sends each missing slice from one of
its owners, or forwards it from a receiver on the same node that got it already).
`lower_bound_bytes`: per receiver, the bytes of its destination box outside the source box it
holds. `inter_node_lower_bound_bytes`: per node, the bytes of every slice its receivers need and no
device of the node owns, once. `lower_bound_seconds` is the largest of three families of bounds.
Classify every missing (receiver, slice) by its owners: I = all owners on the receiver's node (it
arrives intra-node), E = none there (inter-node, or relayed inside the node), F = some (either).
With bandwidths bi, be:

- per receiver: max(I / bi, (I + E + F) / (bi + be)), since its two receive links together carry at
  most (bi + be) bytes per second;
- per node: its E bytes counted once per slice, over the inter-node receive links of its
  devices_per_node devices;
- per owner set G (the devices holding one source box, summed over every box with that same set,
  so the replicas of a data-parallel group share their work): each slice must leave G at least
  once per node that needs it (I, E, F counted once per (slice, node)), so the busiest member needs
  at least max(I / (|G| bi), E / (|G| be), (I + E + F) / (|G| (bi + be))). A single owner
  (|G| = 1) makes this the sender's unavoidable send time.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import numpy as np
import torch

from hotswitch.distconfig import Layout, Mesh, Topology
from hotswitch.distconfig.layout import Box

__all__ = ["ALGORITHMS", "LostState", "PlanCache", "SwitchPlan", "TensorMove", "Transfer", "lower_bound_seconds",
           "plan_switch", "unowned"]

ALGORITHMS = ("greedy", "fcfs", "round_robin", "gather")


# ---------------------------------------------------------------- public values


@dataclass(frozen=True, slots=True)
class TensorMove:
    """One piece of switched state: a tensor of `shape` going from layout `src` to layout `dst`.

    `itemsize` is bytes per element (an int, or a torch dtype for convenience).
    """

    name: str
    shape: tuple[int, ...]
    itemsize: int
    src: Layout
    dst: Layout

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TensorMove name must be a non-empty string, got {self.name!r}")
        if isinstance(self.itemsize, torch.dtype):
            object.__setattr__(self, "itemsize", self.itemsize.itemsize)
        if not isinstance(self.itemsize, numbers.Integral) or isinstance(self.itemsize, bool) or self.itemsize < 1:
            raise ValueError(
                f"TensorMove {self.name!r}: itemsize must be a positive number of bytes (or a torch "
                f"dtype), got {self.itemsize!r}"
            )
        object.__setattr__(self, "itemsize", int(self.itemsize))
        try:
            shape = tuple(int(s) for s in self.shape)
        except (TypeError, ValueError):
            raise ValueError(f"TensorMove {self.name!r}: shape must be a tuple of ints, got {self.shape!r}") from None
        object.__setattr__(self, "shape", shape)
        for side in ("src", "dst"):
            layout = getattr(self, side)
            if not isinstance(layout, Layout):
                raise ValueError(
                    f"TensorMove {self.name!r}: {side} must be a distconfig Layout, got {type(layout).__name__}"
                )
            if layout.global_shape != shape:
                raise ValueError(
                    f"TensorMove {self.name!r}: {side} layout is for global shape {layout.global_shape} "
                    f"but the tensor has shape {shape}; build the {side} Layout from the tensor's global shape"
                )


@dataclass(frozen=True, slots=True)
class Transfer:
    """`box` (global [start, stop) per dim) of `tensor` goes from `src_device` to `dst_device`.

    For every algorithm but `gather`, `box` lies inside the receiver's destination box. A `gather`
    transfer moves a whole source box; the receiver keeps `piece_local` of it at `dst_local`.
    """

    tensor: str
    src_device: int
    dst_device: int
    box: Box
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.box)

    def src_local(self, src_layout: Layout) -> tuple[slice, ...]:
        """Where the box sits in the sender's local shard of `src_layout` (a relay's sender forwards
        from its new shard: pass the destination layout)."""
        own = src_layout.box(self.src_device)
        if any(a < oa or b > ob for (a, b), (oa, ob) in zip(self.box, own)):
            raise ValueError(
                f"transfer of {self.tensor!r} box {self.box} is not inside device {self.src_device}'s "
                f"source box {own}; pass the source layout this plan was made for"
            )
        return tuple(slice(a - oa, b - oa) for (a, b), (oa, _) in zip(self.box, own))

    def dst_local(self, dst_layout: Layout) -> tuple[slice, ...]:
        """Where the kept part of the box (box ∩ receiver's box) sits in the receiver's local shard."""
        own = dst_layout.box(self.dst_device)
        return tuple(slice(lo - oa, hi - oa) for (lo, hi), (oa, _) in zip(_clip(self.box, own), own))

    def piece_local(self, dst_layout: Layout) -> tuple[slice, ...]:
        """The kept part of the box, relative to the moved piece (all of it unless algorithm `gather`)."""
        own = dst_layout.box(self.dst_device)
        return tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(_clip(self.box, own), self.box))


def _clip(box: Box, own: Box) -> Box:
    out = []
    for (a, b), (oa, ob) in zip(box, own):
        lo = max(a, oa)
        out.append((lo, max(lo, min(b, ob))))
    return tuple(out)


# Rows of a plan's transfer arrays (boxes padded to the plan's widest tensor with [0, 1)).
def _record_dtype(ndim: int) -> np.dtype:
    return np.dtype(
        [("tensor", np.int32), ("src", np.int64), ("dst", np.int64), ("nbytes", np.int64),
         ("lo", np.int64, (ndim,)), ("hi", np.int64, (ndim,))]
    )


@dataclass(frozen=True, eq=False)
class SwitchPlan:
    """Who sends which slice to whom, with its byte counts, estimated time and lower bounds.

    `transfer_array` / `local_copy_array` / `relay_array` hold the plan as structured numpy arrays
    (columns tensor (index into `tensor_names`), src, dst, nbytes, lo, hi), sorted by (src, dst,
    tensor, box), (dst, tensor, box) and (src, dst, tensor, box); `transfers`, `local_copies`,
    `relays`, `by_peer` and `receives` build Transfer objects from them on demand. Stage 0 sends
    from owners (`transfer_array`); stage 1 (`relay_array`) forwards slices a receiver got in stage 0
    from its new shard to receivers on its node.
    """

    algorithm: str
    topology: Topology
    tensor_names: tuple[str, ...]
    tensor_ndims: tuple[int, ...]
    transfer_array: np.ndarray = field(repr=False)
    local_copy_array: np.ndarray = field(repr=False)
    relay_array: np.ndarray = field(repr=False)  # the second stage: received slices forwarded inside a node
    bytes_moved: int
    inter_node_bytes: int
    intra_node_bytes: int
    send_bytes_intra: np.ndarray = field(repr=False)
    send_bytes_inter: np.ndarray = field(repr=False)
    recv_bytes_intra: np.ndarray = field(repr=False)
    recv_bytes_inter: np.ndarray = field(repr=False)
    lower_bound_bytes: int
    inter_node_lower_bound_bytes: int
    lower_bound_seconds: float
    estimated_seconds: float
    planning_seconds: float = 0.0
    # per (query, device, stage): the Transfer lists `by_peer`, `receives`, `local_copies_of` built once, as
    # a cached plan is executed at every switch (callers only read them)
    _per_device: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def send_bytes(self) -> np.ndarray:
        return self.send_bytes_intra + self.send_bytes_inter

    @property
    def recv_bytes(self) -> np.ndarray:
        return self.recv_bytes_intra + self.recv_bytes_inter

    @property
    def max_send_bytes(self) -> int:
        return int(self.send_bytes.max(initial=0))

    @property
    def max_recv_bytes(self) -> int:
        return int(self.recv_bytes.max(initial=0))

    @cached_property
    def transfers(self) -> tuple[Transfer, ...]:
        """Device-to-device transfers (src != dst), sorted by (src, dst, tensor, box)."""
        return self._build(self.transfer_array)

    @cached_property
    def local_copies(self) -> tuple[Transfer, ...]:
        """Copies within one device (src == dst), sorted by (dst, tensor, box)."""
        return self._build(self.local_copy_array)

    @cached_property
    def relays(self) -> tuple[Transfer, ...]:
        """Stage 1: slices forwarded inside a node by the receiver that got them in stage 0."""
        return self._build(self.relay_array)

    @property
    def stages(self) -> int:
        return 2 if len(self.relay_array) else 1

    def by_peer(self, device: int, stage: int = 0) -> dict[int, list[Transfer]]:
        """What `device` sends in `stage`, per receiving peer (ascending), each list in (tensor, box) order.

        The receiver's `receives(peer, stage)[device]` lists the same transfers in the same order, so
        one packed buffer per peer lines up on both sides.
        """
        key = ("by_peer", device, stage)
        if key not in self._per_device:
            rows = self._rows(self.relay_array if stage else self.transfer_array, "src", device)
            self._per_device[key] = self._group(rows, "dst")
        return self._per_device[key]

    def receives(self, device: int, stage: int = 0) -> dict[int, list[Transfer]]:
        """What `device` receives in `stage`, per sending peer (ascending), in the sender's packing order."""
        key = ("receives", device, stage)
        if key not in self._per_device:
            rows = self._by_dst[stage]
            lo, hi = np.searchsorted(rows["dst"], [device, device + 1])
            self._per_device[key] = self._group(rows[lo:hi], "src")
        return self._per_device[key]

    def local_copies_of(self, device: int) -> list[Transfer]:
        key = ("local", device, 0)
        if key not in self._per_device:
            self._per_device[key] = list(self._build(self._rows(self.local_copy_array, "dst", device)))
        return self._per_device[key]

    def summary(self) -> dict:
        """JSON-friendly numbers."""
        return {
            "algorithm": self.algorithm,
            "num_devices": self.topology.num_devices,
            "devices_per_node": self.topology.devices_per_node,
            "num_tensors": len(self.tensor_names),
            "num_transfers": int(len(self.transfer_array)),
            "num_relays": int(len(self.relay_array)),
            "num_local_copies": int(len(self.local_copy_array)),
            "bytes_moved": self.bytes_moved,
            "inter_node_bytes": self.inter_node_bytes,
            "inter_node_lower_bound_bytes": self.inter_node_lower_bound_bytes,
            "intra_node_bytes": self.intra_node_bytes,
            "local_copy_bytes": int(self.local_copy_array["nbytes"].sum()),
            "max_send_bytes": self.max_send_bytes,
            "max_recv_bytes": self.max_recv_bytes,
            "lower_bound_bytes": self.lower_bound_bytes,
            "estimated_seconds": self.estimated_seconds,
            "lower_bound_seconds": self.lower_bound_seconds,
            "bound_ratio": (self.estimated_seconds / self.lower_bound_seconds) if self.lower_bound_seconds else 1.0,
            "planning_seconds": self.planning_seconds,
        }

    def __repr__(self) -> str:
        return (
            f"SwitchPlan({self.algorithm}, {len(self.tensor_names)} tensors, "
            f"{len(self.transfer_array)} transfers + {len(self.relay_array)} relayed, {self.bytes_moved} bytes "
            f"({self.inter_node_bytes} inter-node), est {self.estimated_seconds:.3g} s "
            f">= bound {self.lower_bound_seconds:.3g} s)"
        )

    # -- helpers

    @cached_property
    def _by_dst(self) -> tuple[np.ndarray, np.ndarray]:
        """Each stage's transfers sorted by (dst, src), each pair's rows kept in the sender's order."""
        return tuple(a[np.lexsort((np.arange(len(a)), a["src"], a["dst"]))]
                     for a in (self.transfer_array, self.relay_array))

    @staticmethod
    def _rows(array: np.ndarray, column: str, device: int) -> np.ndarray:
        lo, hi = np.searchsorted(array[column], [device, device + 1])
        return array[lo:hi]

    def _group(self, rows: np.ndarray, column: str) -> dict[int, list[Transfer]]:
        out: dict[int, list[Transfer]] = {}
        for peer, t in zip(rows[column].tolist(), self._build(rows)):
            out.setdefault(peer, []).append(t)
        return out

    def _build(self, rows: np.ndarray) -> tuple[Transfer, ...]:
        names, ndims = self.tensor_names, self.tensor_ndims
        out = []
        for t, s, d, nb, lo, hi in zip(
            rows["tensor"].tolist(), rows["src"].tolist(), rows["dst"].tolist(), rows["nbytes"].tolist(),
            rows["lo"].tolist(), rows["hi"].tolist(),
        ):
            n = ndims[t]
            out.append(Transfer(names[t], s, d, tuple(zip(lo[:n], hi[:n])), nb))
        return tuple(out)


# ---------------------------------------------------------------- geometry (device-independent)


@dataclass(frozen=True, slots=True)
class _Geometry:
    """The finest common slicing of one (shape, source placements, destination placements) case.

    Devices appear as mesh positions; boxes are padded to at least one dim. Slices are sorted by
    (destination box, source box); `dst_ptr` indexes them by destination box.
    """

    src_box_of_pos: np.ndarray  # (src mesh size,) source box id of each mesh position, -1 if empty
    dst_box_of_pos: np.ndarray  # (dst mesh size,)
    src_lo: np.ndarray  # (num source boxes, ndim)
    src_hi: np.ndarray
    dst_lo: np.ndarray  # (num destination boxes, ndim)
    dst_hi: np.ndarray
    slice_src: np.ndarray  # (num slices,) source box of each slice
    slice_lo: np.ndarray  # (num slices, ndim)
    slice_hi: np.ndarray
    slice_vol: np.ndarray
    dst_ptr: np.ndarray  # (num destination boxes + 1,)


def _grid(boxes: np.ndarray, shape: tuple[int, ...]):
    """Distinct non-empty boxes as a grid: per dim sorted interval starts/stops, and each row's box id."""
    lo, hi = boxes[..., 0], boxes[..., 1]
    keep = np.all(hi > lo, axis=1)
    starts, stops, index = [], [], []
    for d, n in enumerate(shape):
        s, first = np.unique(lo[keep, d], return_index=True)
        e = hi[keep, d][first]
        if keep.any():
            assert s[0] == 0 and e[-1] == n and np.array_equal(e[:-1], s[1:]), "box intervals do not partition a dim"
        i = np.clip(np.searchsorted(s, lo[:, d]), 0, max(len(s) - 1, 0))
        assert np.array_equal(e[i[keep]], hi[keep, d]), "boxes with one start have different stops"
        starts.append(s)
        stops.append(e)
        index.append(i)
    dims = tuple(len(s) for s in starts)
    if not keep.any():
        return starts, stops, dims, np.full(len(boxes), -1, dtype=np.int64)
    box_id = np.where(keep, np.ravel_multi_index(tuple(index), dims), -1).astype(np.int64)
    assert len(np.unique(box_id[keep])) == math.prod(dims), "the boxes do not tile the tensor"
    return starts, stops, dims, box_id


def _cells(starts: list[np.ndarray], stops: list[np.ndarray], dims: tuple[int, ...]):
    """Every grid cell's lo/hi (row-major cell order)."""
    idx = [g.reshape(-1) for g in np.meshgrid(*[np.arange(k) for k in dims], indexing="ij")]
    lo = np.stack([s[i] for s, i in zip(starts, idx)], axis=1) if idx else np.zeros((1, 0), np.int64)
    hi = np.stack([e[i] for e, i in zip(stops, idx)], axis=1) if idx else np.zeros((1, 0), np.int64)
    return lo.astype(np.int64), hi.astype(np.int64)


def _layout_boxes(shape, mesh_shape, placements) -> np.ndarray:
    mesh = Mesh.from_shape(mesh_shape, tuple(f"a{i}" for i in range(len(mesh_shape))))
    boxes = Layout(shape, mesh, placements).boxes()
    if boxes.shape[1] == 0:  # a 0-dim tensor: one dim [0, 1), so every array has a dim
        boxes = np.broadcast_to(np.array([[0, 1]], dtype=np.int64), (len(boxes), 1, 2))
    return boxes


@lru_cache(maxsize=4096)
def _geometry(shape, src_mesh_shape, src_placements, dst_mesh_shape, dst_placements) -> _Geometry:
    padded = shape or (1,)
    src_boxes = _layout_boxes(shape, src_mesh_shape, src_placements)
    dst_boxes = _layout_boxes(shape, dst_mesh_shape, dst_placements)
    s_starts, s_stops, s_dims, src_box_of_pos = _grid(src_boxes, padded)
    d_starts, d_stops, d_dims, dst_box_of_pos = _grid(dst_boxes, padded)
    src_lo, src_hi = _cells(s_starts, s_stops, s_dims)
    dst_lo, dst_hi = _cells(d_starts, d_stops, d_dims)
    ndim = len(padded)
    if math.prod(s_dims) == 0 or math.prod(d_dims) == 0:  # an empty tensor: nothing to move
        z = np.zeros(0, np.int64)
        zz = np.zeros((0, ndim), np.int64)
        return _Geometry(src_box_of_pos, dst_box_of_pos, zz, zz, zz, zz, z, zz, zz, z, np.zeros(1, np.int64))
    # refine dim by dim: pieces start wherever a source or a destination interval starts
    p_lo, p_hi, p_src, p_dst = [], [], [], []
    for d, n in enumerate(padded):
        lo = np.union1d(s_starts[d], d_starts[d])
        p_lo.append(lo)
        p_hi.append(np.append(lo[1:], n))
        p_src.append(np.searchsorted(s_starts[d], lo, side="right") - 1)
        p_dst.append(np.searchsorted(d_starts[d], lo, side="right") - 1)
    idx = [g.reshape(-1) for g in np.meshgrid(*[np.arange(len(p)) for p in p_lo], indexing="ij")]
    slice_lo = np.stack([p[i] for p, i in zip(p_lo, idx)], axis=1)
    slice_hi = np.stack([p[i] for p, i in zip(p_hi, idx)], axis=1)
    slice_src = np.ravel_multi_index(tuple(p[i] for p, i in zip(p_src, idx)), s_dims)
    slice_dst = np.ravel_multi_index(tuple(p[i] for p, i in zip(p_dst, idx)), d_dims)
    order = np.lexsort((slice_src, slice_dst))
    slice_lo, slice_hi = slice_lo[order], slice_hi[order]
    slice_src, slice_dst = slice_src[order], slice_dst[order]
    return _Geometry(
        src_box_of_pos=src_box_of_pos,
        dst_box_of_pos=dst_box_of_pos,
        src_lo=src_lo,
        src_hi=src_hi,
        dst_lo=dst_lo,
        dst_hi=dst_hi,
        slice_src=slice_src.astype(np.int64),
        slice_lo=slice_lo.astype(np.int64),
        slice_hi=slice_hi.astype(np.int64),
        slice_vol=np.prod(slice_hi - slice_lo, axis=1).astype(np.int64),
        dst_ptr=np.searchsorted(slice_dst, np.arange(math.prod(d_dims) + 1)).astype(np.int64),
    )


def _concat_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """np.concatenate([np.arange(s, s + c) for s, c in zip(starts, counts)]), vectorized."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    offsets = np.cumsum(counts) - counts
    return np.repeat(starts - offsets, counts) + np.arange(total, dtype=np.int64)


# ---------------------------------------------------------------- one (src layout, dst layout) pair


@dataclass(frozen=True, slots=True)
class _Pair:
    """Work items of one (source Layout, destination Layout) pair, with devices; shared by every tensor
    of that pair. Items are ordered by (receiver device id, slice)."""

    geometry: _Geometry
    owner_dev: np.ndarray  # owners of every source box, sorted by (box, device id)
    owner_ptr: np.ndarray  # (num source boxes + 1,)
    recv: np.ndarray  # receivers with a non-empty destination box, ascending device id
    recv_box: np.ndarray  # their destination box
    recv_own: np.ndarray  # the source box each receiver holds, -1 if none
    item_recv: np.ndarray
    item_slice: np.ndarray  # index into the geometry's slices
    item_local: np.ndarray  # bool: the receiver already holds the slice
    lower_bound_elems: int  # elements receivers lack (sum over receivers)


def _pair(src: Layout, dst: Layout, unavailable: frozenset[int] = frozenset()) -> _Pair:
    g = _geometry(src.global_shape, src.mesh.shape, src.placements, dst.mesh.shape, dst.placements)
    src_dev = np.asarray(src.mesh.devices, dtype=np.int64)
    dst_dev = np.asarray(dst.mesh.devices, dtype=np.int64)
    keep = g.src_box_of_pos >= 0
    if unavailable:  # devices that are gone own nothing (and receive nothing: checked by plan_switch)
        keep &= ~np.isin(src_dev, np.fromiter(unavailable, dtype=np.int64))
    ob, od = g.src_box_of_pos[keep], src_dev[keep]
    order = np.lexsort((od, ob))
    owner_dev = od[order]
    owner_ptr = np.searchsorted(ob[order], np.arange(len(g.src_lo) + 1)).astype(np.int64)

    rkeep = g.dst_box_of_pos >= 0
    order = np.argsort(dst_dev[rkeep], kind="stable")
    recv, recv_box = dst_dev[rkeep][order], g.dst_box_of_pos[rkeep][order]
    # the source box each receiver holds (receivers outside the source mesh hold none)
    s_order = np.argsort(src_dev, kind="stable")
    sorted_src = src_dev[s_order]
    p = np.clip(np.searchsorted(sorted_src, recv), 0, len(sorted_src) - 1)
    recv_own = np.where(sorted_src[p] == recv, g.src_box_of_pos[s_order[p]], -1)

    counts = g.dst_ptr[recv_box + 1] - g.dst_ptr[recv_box]
    item_recv = np.repeat(recv, counts)
    item_slice = _concat_ranges(g.dst_ptr[recv_box], counts)
    item_local = g.slice_src[item_slice] == np.repeat(recv_own, counts)

    # lower bound, computed apart from the items: each receiver's box minus its own source box
    d_lo, d_hi = g.dst_lo[recv_box], g.dst_hi[recv_box]
    lost = np.prod(d_hi - d_lo, axis=1)
    has = recv_own >= 0
    if has.any():
        d_lo, d_hi = d_lo[has], d_hi[has]
        s_lo, s_hi = g.src_lo[recv_own[has]], g.src_hi[recv_own[has]]
        overlap = np.prod(np.clip(np.minimum(d_hi, s_hi) - np.maximum(d_lo, s_lo), 0, None), axis=1)
        lost[has] -= overlap
    return _Pair(g, owner_dev, owner_ptr, recv, recv_box, recv_own, item_recv, item_slice, item_local,
                 int(lost.sum()))


# ---------------------------------------------------------------- planning


class LostState(ValueError):
    """Some slices of the state are held by no available device (see `unowned`)."""

    def __init__(self, lost: dict[str, list[Box]]):
        self.lost = lost
        names = sorted(lost)
        super().__init__(f"{len(names)} tensors have slices held by no available device (e.g. {names[0]!r} "
                         f"{lost[names[0]][0]}): restore them from a checkpoint")


def unowned(moves: Sequence[TensorMove], unavailable: frozenset[int] | set[int]) -> dict[str, list[Box]]:
    """{tensor: its source boxes that no available device holds}: what only a checkpoint can restore
    after the `unavailable` devices are gone (empty when every slice has a surviving replica)."""
    gone = frozenset(unavailable)
    lost: dict[str, list[Box]] = {}
    for m in moves:
        for box, owners in m.src.owners().items():
            if all(d in gone for d in owners):
                lost.setdefault(m.name, []).append(box)
    return lost


def plan_switch(moves: Sequence[TensorMove], topology: Topology, algorithm: str = "greedy",
                unavailable: frozenset[int] | set[int] = frozenset()) -> SwitchPlan:
    """Plan moving every tensor of `moves` from its `src` layout to its `dst` layout (see module doc).

    `unavailable`: source devices that are gone (a failure, a scale-in that already happened); their
    slices come from other owners, and `LostState` is raised when some slice has none left.
    """
    t0 = time.perf_counter()
    unavailable = frozenset(int(d) for d in unavailable)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown switch algorithm {algorithm!r}; use one of {ALGORITHMS}")
    if not isinstance(topology, Topology):
        raise ValueError(f"plan_switch needs a distconfig Topology, got {type(topology).__name__}")
    moves = list(moves)
    for m in moves:
        if not isinstance(m, TensorMove):
            raise ValueError(f"plan_switch takes TensorMoves, got {type(m).__name__}")
    if unavailable:
        lost = unowned(moves, unavailable)
        if lost:
            raise LostState(lost)
    names = [m.name for m in moves]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"tensor names must be unique within a switch, got duplicates {dup}")
    pairs: dict[tuple[Layout, Layout], _Pair] = {}
    for m in moves:
        for side in ("src", "dst"):
            layout = getattr(m, side)
            if layout.is_partial:
                raise ValueError(
                    f"reduce partial values before planning a switch; tensor {m.name!r} has a Partial "
                    f"{side} layout {list(layout.placements)}: all-reduce or reduce-scatter it first"
                )
            if max(layout.mesh.devices) >= topology.num_devices:
                raise ValueError(
                    f"tensor {m.name!r}: {side} layout uses device {max(layout.mesh.devices)} but the topology "
                    f"has {topology.num_devices} devices; use a Topology that covers every mesh device"
                )
        gone = unavailable.intersection(m.dst.mesh.devices)
        if gone:
            raise ValueError(f"tensor {m.name!r}: the destination layout places it on unavailable devices "
                             f"{sorted(gone)}; build the destination on the available devices only")
        key = (m.src, m.dst)
        if key not in pairs:
            pairs[key] = _pair(m.src, m.dst, unavailable)
    return _Planner(moves, [pairs[(m.src, m.dst)] for m in moves], topology, algorithm).run(t0)


def lower_bound_seconds(moves: Sequence[TensorMove], topology: Topology) -> float:
    """`plan_switch(moves, topology).lower_bound_seconds` without making the plan: no senders chosen,
    no transfer records. For searches that price many config pairs (`hotswitch.search`); the moves are
    trusted to be valid (`plan_switch` checks them)."""
    moves = list(moves)
    pairs: dict[tuple[Layout, Layout], _Pair] = {}
    for m in moves:
        if (m.src, m.dst) not in pairs:
            pairs[(m.src, m.dst)] = _pair(m.src, m.dst)
    planner = _Planner(moves, [pairs[(m.src, m.dst)] for m in moves], topology, "fcfs")
    items, moved = planner.items, ~planner.items["local"]
    return planner._lower_bound_seconds(items["box"][moved], items["recv"][moved], items["nbytes"][moved],
                                        items["key"][moved])


class _Planner:
    """Flattens every tensor's work items into global arrays, assigns senders, and prices the plan."""

    def __init__(self, moves: list[TensorMove], pairs: list[_Pair], topology: Topology, algorithm: str):
        self.moves, self.topology, self.algorithm = moves, topology, algorithm
        self.ndim = max([len(m.shape) for m in moves] + [1])
        # Global source boxes: one block per distinct pair (tensors sharing a pair share owners).
        unique: dict[int, int] = {}
        box_base, pair_list = [], []
        n_boxes = 0
        for p in pairs:
            if id(p) not in unique:
                unique[id(p)] = len(pair_list)
                pair_list.append(p)
                box_base.append(n_boxes)
                n_boxes += len(p.geometry.src_lo)
        self.pair_of = np.array([unique[id(p)] for p in pairs], dtype=np.int64)
        self.box_base = np.array(box_base, dtype=np.int64)
        self.pairs = pair_list
        counts = np.array([len(p.owner_dev) for p in pair_list], dtype=np.int64)
        self.owner_dev = np.concatenate([p.owner_dev for p in pair_list] or [np.zeros(0, np.int64)])
        owner_base = np.cumsum(counts) - counts
        self.owner_ptr = np.concatenate(
            [p.owner_ptr[:-1] + b for p, b in zip(pair_list, owner_base)] + [np.array([counts.sum()])]
        ).astype(np.int64)
        self.num_boxes = n_boxes
        self.items = self._items(pairs)

    def _pad(self, a: np.ndarray, fill: int) -> np.ndarray:
        if a.shape[1] == self.ndim:
            return a
        return np.concatenate([a, np.full((len(a), self.ndim - a.shape[1]), fill, np.int64)], axis=1)

    def _items(self, pairs: list[_Pair]) -> dict[str, np.ndarray]:
        """Every (tensor, receiver, slice) work item, in (tensor, receiver, slice) order."""
        names = ("tensor", "recv", "box", "lo", "hi", "nbytes", "local", "key")
        cols: dict[str, list[np.ndarray]] = {k: [] for k in names}
        slice_base = 0
        for t, (m, p) in enumerate(zip(self.moves, pairs)):
            g, n = p.geometry, len(p.item_slice)
            if n == 0:
                continue
            cols["tensor"].append(np.full(n, t, np.int32))
            cols["recv"].append(p.item_recv)
            cols["box"].append(g.slice_src[p.item_slice] + self.box_base[self.pair_of[t]])
            cols["lo"].append(self._pad(g.slice_lo[p.item_slice], 0))
            cols["hi"].append(self._pad(g.slice_hi[p.item_slice], 1))
            cols["nbytes"].append(g.slice_vol[p.item_slice] * m.itemsize)
            cols["local"].append(p.item_local)
            cols["key"].append(p.item_slice + slice_base)  # (tensor, slice) id, for round_robin
            slice_base += len(g.slice_vol)
        empty = {"tensor": np.int32, "local": bool}
        out = {}
        for k, v in cols.items():
            if v:
                out[k] = np.concatenate(v)
            elif k in ("lo", "hi"):
                out[k] = np.zeros((0, self.ndim), np.int64)
            else:
                out[k] = np.zeros(0, empty.get(k, np.int64))
        return out

    # -- senders

    def _candidates(self, box: np.ndarray, recv: np.ndarray):
        """Per item: the owner range to choose from ([lo, hi) into owner_dev) and the link class.

        Owners on the receiver's node if any (class 0, intra), else all owners (class 1, inter).
        Owners are sorted by device id, hence by node, so the on-node owners are a contiguous range.
        """
        dpn, nodes = self.topology.devices_per_node, self.topology.num_nodes
        key = np.repeat(np.arange(self.num_boxes, dtype=np.int64), np.diff(self.owner_ptr)) * nodes
        key += self.owner_dev // dpn
        q = box * nodes + recv // dpn
        a = np.searchsorted(key, q, side="left")
        z = np.searchsorted(key, q, side="right")
        inter = z == a
        lo = np.where(inter, self.owner_ptr[box], a)
        hi = np.where(inter, self.owner_ptr[box + 1], z)
        return lo, hi, inter.astype(np.int8)

    def _greedy(self, box, recv, nbytes) -> np.ndarray:
        lo, hi, cls = self._candidates(box, recv)
        n = self.topology.num_devices
        sender = self.owner_dev[lo].copy()
        forced = hi - lo == 1
        loads = [
            np.bincount(sender[forced & (cls == c)], weights=nbytes[forced & (cls == c)], minlength=n)
            .round().astype(np.int64).tolist()
            for c in (0, 1)
        ]
        owners = self.owner_dev.tolist()
        free = np.flatnonzero(~forced)
        chosen = []
        for a, z, c, nb in zip(lo[free].tolist(), hi[free].tolist(), cls[free].tolist(), nbytes[free].tolist()):
            load = loads[c]
            best = owners[a]
            best_load = load[best]
            for k in range(a + 1, z):
                d = owners[k]
                if load[d] < best_load:
                    best, best_load = d, load[d]
            load[best] = best_load + nb
            chosen.append(best)
        sender[free] = chosen
        return sender

    def _fcfs(self, box) -> np.ndarray:
        return self.owner_dev[self.owner_ptr[box]]

    def _round_robin(self, box, key) -> np.ndarray:
        order = np.argsort(key, kind="stable")  # items of one (tensor, slice), by receiver
        k = key[order]
        first = np.searchsorted(k, k, side="left")
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order)) - first
        n_owners = self.owner_ptr[box + 1] - self.owner_ptr[box]
        return self.owner_dev[self.owner_ptr[box] + rank % n_owners]

    def _gather_items(self) -> dict[str, np.ndarray]:
        """Whole source boxes to every receiver that lacks them (the `gather` baseline)."""
        cols: dict[str, list[np.ndarray]] = {k: [] for k in ("tensor", "recv", "src", "lo", "hi", "nbytes")}
        for t, m in enumerate(self.moves):
            pi = self.pair_of[t]
            p = self.pairs[pi]
            g = p.geometry
            k = len(g.src_lo)
            if k == 0 or len(p.recv) == 0:
                continue
            recv = np.repeat(p.recv, k)
            box = np.tile(np.arange(k), len(p.recv))
            keep = box != np.repeat(p.recv_own, k)
            recv, box = recv[keep], box[keep]
            cols["tensor"].append(np.full(len(box), t, np.int32))
            cols["recv"].append(recv)
            cols["src"].append(self.owner_dev[self.owner_ptr[box + self.box_base[pi]]])
            cols["lo"].append(self._pad(g.src_lo[box], 0))
            cols["hi"].append(self._pad(g.src_hi[box], 1))
            cols["nbytes"].append(np.prod(g.src_hi[box] - g.src_lo[box], axis=1) * m.itemsize)
        if not cols["tensor"]:
            return {"tensor": np.zeros(0, np.int32), "recv": np.zeros(0, np.int64), "src": np.zeros(0, np.int64),
                    "lo": np.zeros((0, self.ndim), np.int64), "hi": np.zeros((0, self.ndim), np.int64),
                    "nbytes": np.zeros(0, np.int64)}
        return {k: np.concatenate(v) for k, v in cols.items()}

    # -- assembly

    def run(self, t0: float) -> SwitchPlan:
        it = self.items
        moved = ~it["local"]
        no_relay = np.full(int(moved.sum()), -1, np.int64)
        bounds = self._bounds()
        if self.algorithm != "greedy":
            return self._assemble(no_relay, bounds, t0)
        relay = self._relays(it["box"][moved], it["recv"][moved], it["nbytes"][moved], it["key"][moved])
        if not np.any(relay >= 0):
            return self._assemble(no_relay, bounds, t0)
        # a relay saves node-link bytes but adds a stage: kept only where the plan is faster with it
        plain, relayed = self._assemble(no_relay, bounds, t0), self._assemble(relay, bounds, t0)
        return relayed if relayed.estimated_seconds < plain.estimated_seconds else plain

    def _bounds(self) -> dict:
        """The algorithm-independent lower bounds of the module doc, as SwitchPlan fields."""
        it = self.items
        moved = ~it["local"]
        box, recv, nbytes, key = it["box"][moved], it["recv"][moved], it["nbytes"][moved], it["key"][moved]
        _, _, cls = self._candidates(box, recv)
        inter = cls == 1
        _, first = np.unique(key[inter] * self.topology.num_nodes + recv[inter] // self.topology.devices_per_node,
                             return_index=True)
        return dict(
            lower_bound_bytes=int(sum(p.lower_bound_elems * m.itemsize
                                      for m, p in zip(self.moves, (self.pairs[i] for i in self.pair_of)))),
            inter_node_lower_bound_bytes=int(nbytes[inter][first].sum()),
            lower_bound_seconds=self._lower_bound_seconds(box, recv, nbytes, key),
        )

    def _assemble(self, relay: np.ndarray, bounds: dict, t0: float) -> SwitchPlan:
        """The plan with the moved items of `relay` >= 0 forwarded from that receiver (stage 1)."""
        it = self.items
        local = it["local"]
        moved = ~local
        box, recv, nbytes, key = it["box"][moved], it["recv"][moved], it["nbytes"][moved], it["key"][moved]
        direct = relay < 0
        if self.algorithm == "greedy":  # only items that do not arrive by relay choose a sender
            sender = self._greedy(box[direct], recv[direct], nbytes[direct])
        elif self.algorithm == "fcfs":
            sender = self._fcfs(box)
        elif self.algorithm == "round_robin":
            sender = self._round_robin(box, key)
        tensor, lo, hi = it["tensor"][moved], it["lo"][moved], it["hi"][moved]
        if self.algorithm == "gather":
            g = self._gather_items()
            tr = (g["tensor"], g["src"], g["recv"], g["nbytes"], g["lo"], g["hi"])
        else:
            assert not np.any(sender == recv[direct]), "a sender was chosen for a slice its receiver holds"
            tr = (tensor[direct], sender, recv[direct], nbytes[direct], lo[direct], hi[direct])
        fw = ~direct
        rl = (tensor[fw], relay[fw], recv[fw], nbytes[fw], lo[fw], hi[fw])
        lc = (it["tensor"][local], it["recv"][local], it["recv"][local], it["nbytes"][local],
              it["lo"][local], it["hi"][local])
        transfers = self._records(tr, primary="src")
        relays = self._records(rl, primary="src")
        local_copies = self._records(lc, primary="dst")

        topo, n = self.topology, self.topology.num_devices
        dpn = topo.devices_per_node
        bi, be = topo.intra_node_bandwidth, topo.inter_node_bandwidth
        loads, seconds = [], 0.0
        for stage in (transfers, relays):
            s, d, nb = stage["src"], stage["dst"], stage["nbytes"]
            intra = s // dpn == d // dpn

            def per_device(devices, mask):
                return np.bincount(devices[mask], weights=nb[mask], minlength=n).round().astype(np.int64)

            stage_loads = (per_device(s, intra), per_device(s, ~intra), per_device(d, intra), per_device(d, ~intra))
            loads.append(stage_loads)
            seconds += float(np.maximum.reduce([stage_loads[0] / bi, stage_loads[1] / be,
                                                stage_loads[2] / bi, stage_loads[3] / be]).max(initial=0.0))
        send_intra, send_inter, recv_intra, recv_inter = (a + b for a, b in zip(*loads))
        return SwitchPlan(
            algorithm=self.algorithm,
            topology=topo,
            tensor_names=tuple(m.name for m in self.moves),
            tensor_ndims=tuple(len(m.shape) for m in self.moves),
            transfer_array=transfers,
            local_copy_array=local_copies,
            relay_array=relays,
            bytes_moved=int(send_intra.sum() + send_inter.sum()),
            inter_node_bytes=int(send_inter.sum()),
            intra_node_bytes=int(send_intra.sum()),
            send_bytes_intra=send_intra,
            send_bytes_inter=send_inter,
            recv_bytes_intra=recv_intra,
            recv_bytes_inter=recv_inter,
            **bounds,
            estimated_seconds=seconds,
            planning_seconds=time.perf_counter() - t0,
        )

    def _relays(self, box, recv, nbytes, key) -> np.ndarray:
        """Per moved item, the receiver that forwards it (-1: it comes from an owner): see `greedy`'s
        relay in the module doc."""
        relay = np.full(len(box), -1, np.int64)
        _, _, cls = self._candidates(box, recv)
        idx = np.flatnonzero(cls == 1)
        if len(idx) == 0:
            return relay
        dpn, n = self.topology.devices_per_node, self.topology.num_devices
        group = key[idx] * self.topology.num_nodes + recv[idx] // dpn  # (tensor, slice, receiving node)
        order = np.argsort(group, kind="stable")  # a group's items stay in item order (receivers ascending)
        members, g = idx[order], group[order]
        starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
        sizes = np.diff(np.r_[starts, len(g)])
        alone = members[starts[sizes == 1]]
        load = np.bincount(recv[alone], weights=nbytes[alone], minlength=n).round().astype(np.int64).tolist()
        shared = np.flatnonzero(sizes > 1)
        shared = shared[np.argsort(members[starts[shared]], kind="stable")]  # by their first item
        receivers, sizes_of = recv.tolist(), nbytes.tolist()
        for a, z in zip(starts[shared].tolist(), (starts[shared] + sizes[shared]).tolist()):
            items = members[a:z].tolist()
            best = min(items, key=lambda i: (load[receivers[i]], receivers[i]))
            load[receivers[best]] += sizes_of[best]
            others = [i for i in items if i != best]
            relay[others] = receivers[best]
        return relay

    def _records(self, cols, primary: str) -> np.ndarray:
        tensor, src, dst, nbytes, lo, hi = cols
        keys = [lo[:, j] for j in range(self.ndim - 1, -1, -1)] + [tensor]
        keys += [src, dst] if primary == "dst" else [dst, src]
        order = np.lexsort(keys) if len(tensor) else np.zeros(0, np.int64)
        rec = np.empty(len(tensor), dtype=_record_dtype(self.ndim))
        rec["tensor"], rec["src"], rec["dst"], rec["nbytes"] = tensor[order], src[order], dst[order], nbytes[order]
        rec["lo"], rec["hi"] = lo[order], hi[order]
        rec.setflags(write=False)
        return rec

    def _lower_bound_seconds(self, box, recv, nbytes, key) -> float:
        """Max of the per-receiver, per-node and per-owner-set bounds of the module doc, over missing slices."""
        if len(box) == 0:
            return 0.0
        topo = self.topology
        bi, be, dpn = topo.intra_node_bandwidth, topo.inter_node_bandwidth, topo.devices_per_node
        lo, hi, cls = self._candidates(box, recv)
        n_owners = self.owner_ptr[box + 1] - self.owner_ptr[box]
        must_intra = (cls == 0) & (hi - lo == n_owners)
        must_inter = cls == 1
        flexible = ~(must_intra | must_inter)

        def sums(group: np.ndarray, rows: np.ndarray | slice = slice(None)):
            k = int(group.max()) + 1
            g, w = group[rows], nbytes[rows]
            return [np.bincount(g[m[rows]], weights=w[m[rows]], minlength=k)
                    for m in (must_intra, must_inter, flexible)]

        i, e, f = sums(recv)
        per_receiver = float(np.maximum(i / bi, (i + e + f) / (bi + be)).max())
        # each (slice, node) once: the first of its items (the class depends on the node, not the receiver)
        node = recv // dpn
        _, once = np.unique(key * topo.num_nodes + node, return_index=True)
        per_node = float((sums(node, once)[1] / (dpn * be)).max())
        # owner sets: boxes whose owners are the same devices share one id
        sets: dict[tuple[int, ...], int] = {}
        owners = self.owner_dev.tolist()
        ptr = self.owner_ptr.tolist()
        set_of_box = np.array(
            [sets.setdefault(tuple(owners[ptr[b]:ptr[b + 1]]), len(sets)) for b in range(self.num_boxes)],
            dtype=np.int64,
        )
        set_size = np.zeros(len(sets))
        set_size[set_of_box] = np.diff(self.owner_ptr)
        group = set_of_box[box]
        i, e, f = sums(group, once)
        size = set_size[: int(group.max()) + 1]
        per_owner_set = float((np.maximum.reduce([i / bi, e / be, (i + e + f) / (bi + be)]) / size).max())
        return max(per_receiver, per_node, per_owner_set)


# ---------------------------------------------------------------- cache


class PlanCache:
    """Plans keyed by (source key, destination key, algorithm, topology).

    Planning is pure, so a plan made once for a (source, destination) pair serves every later switch
    between them. The keys are the caller's (e.g. config names, or (config, devices) after an
    elastic change); `moves` may be a callable so the TensorMoves are only built on a miss.
    """

    def __init__(self) -> None:
        self._plans: dict[Hashable, SwitchPlan] = {}

    def get(
        self,
        src_key: Hashable,
        dst_key: Hashable,
        moves: Sequence[TensorMove] | Callable[[], Sequence[TensorMove]],
        topology: Topology,
        algorithm: str = "greedy",
    ) -> SwitchPlan:
        key = (src_key, dst_key, algorithm, topology)
        plan = self._plans.get(key)
        if plan is None:
            plan = plan_switch(moves() if callable(moves) else moves, topology, algorithm)
            self._plans[key] = plan
        return plan

    def __contains__(self, key: tuple) -> bool:
        return key in self._plans

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        self._plans.clear()
