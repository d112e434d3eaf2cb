"""Executing a SwitchPlan on this rank: the only place besides ExecGraphs that communicates.

HotSPa's execution, with an atomic commit:
1. new storage for every tensor in the destination layout (the old tensors stay untouched);
2. local copies; one packed send buffer per (peer, dtype), built by `kernels.pack` (identical
   buffers are built once and sent to every peer that needs them); one receive buffer per peer;
3. all ranks agree that preparation succeeded (one tiny all-reduce), then one `batch_isend_irecv`;
4. received buffers are unpacked straight into the new storage (`kernels.unpack`);
   a plan with relays then runs its second stage the same way: slices that crossed the node link
   once are packed from the new storage of the rank that got them and sent to the others of its node;
5. all ranks agree again, and only then does the caller commit. A failure anywhere before the
   second agreement raises `SwitchAborted` on every rank, and the old state is still the state.
"""
from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hotswitch.distconfig import Layout
from hotswitch.distributed.device import comm_tensor, runtime_device
from hotswitch.kernels import pack, unpack
from hotswitch.switch.planner import SwitchPlan, Transfer
from hotswitch.switch.state import split_key


class SwitchAborted(RuntimeError):
    """A switch failed on some rank before it committed; every rank still holds the old state."""


@dataclass(frozen=True)
class SwitchStats:
    source: str
    destination: str
    algorithm: str
    seconds: float  # exposed: what the switch call itself took
    bytes_sent: int
    bytes_received: int
    overlapped_seconds: float = 0.0  # moved in the background (a prefetch) while the source config computed
    handed_off_bytes: int = 0  # of bytes_sent: gradients sent during the backward that made them final


class BackgroundMove:
    """`execute_plan` in a thread of its own, on a process group of its own (so it never interleaves
    with the collectives of the ExecGraphs running meanwhile): a prefetch of the next config's weights.
    `result()` waits for it and returns (new, sent, received), or raises what the move raised."""

    def __init__(self, destination: str, plan: SwitchPlan, old: dict[str, torch.Tensor], src: dict[str, Layout],
                 dst: dict[str, Layout], rank: int, group, dtypes: dict[str, torch.dtype] | None = None,
                 device: torch.device | None = None):
        self.destination = destination
        self.seconds = 0.0
        self._out = None
        self._error: BaseException | None = None

        def run():
            t0 = time.perf_counter()
            try:
                self._out = execute_plan(plan, old, src, dst, rank, group=group, dtypes=dtypes, device=device)
            except BaseException as e:  # noqa: BLE001 - handed to the caller of result()
                self._error = e
            self.seconds = time.perf_counter() - t0

        self._thread = threading.Thread(target=run, name=f"hotswitch-prefetch-{destination}", daemon=True)
        self._thread.start()

    def result(self) -> tuple[dict[str, torch.Tensor], int, int]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._out


class GradientHandoff:
    """The gradients' part of a switch, started during the backward that makes them final.

    Armed before a config's last forward_backward of a step with the plan moving gradients (only)
    into the next config. That call's ExecGraph says where each reduction bucket's gradients are final
    (`compiler.handoff`); the caller adds them to the accumulated ones (`accumulated()` returns those)
    and calls `final(names)`, which, once every gradient of a send group is final on this rank, packs
    the group's slices and sends them with `isend`, one message per (peer, group, dtype). Groups are
    runs of parameters in reverse order (the backward's) of about `group_bytes` (global sizes: the
    same groups on every rank), sent in that order (a group final early waits for the ones before
    it), so that every pair of ranks sends and receives its messages in one order, as NCCL requires.
    All receives are posted when armed, on two process groups of their own (`process_groups`):
    messages to a higher rank on the first, to a lower one on the second. NCCL runs a communicator's operations in
    order on one stream, so a rank's posted receives would otherwise hold up its sends, and two
    ranks waiting for each other would wait forever. `finish()` sends what no hook sent (a graph without hooks,
    Inductor's), waits, unpacks, copies this rank's local pieces, and agrees as `execute_plan` does: a
    failure on any rank raises SwitchAborted everywhere, with the accumulated gradients untouched in
    the source layout. A rank that fails to pack still sends (zeros) so that no peer waits forever.
    Plans with a relay stage, or with nothing to send, are not handed off (`supports`)."""

    def __init__(self, destination: str, plan: SwitchPlan, param_names: list[str], keys: dict[str, str],
                 src: dict[str, Layout], dst: dict[str, Layout], rank: int, process_groups: tuple,
                 dtypes: dict[str, torch.dtype], accumulated, device: torch.device | None = None,
                 group_bytes: int = 4 * 2**20):
        if not self.supports(plan):
            raise ValueError("this plan cannot be handed off during the backward: it relays, moves whole source "
                             "boxes (gather) or sends nothing (see GradientHandoff.supports)")
        self.destination, self.plan, self.rank = destination, plan, rank
        self.process_groups = process_groups
        self.keys, self.src, self.dst, self.dtypes = keys, src, dst, dtypes  # param -> plan tensor name
        self._accumulated = accumulated
        self.device = device if device is not None else runtime_device(process_groups[0])
        self.error: BaseException | None = None
        self.ran = False  # the armed forward_backward has run (its gradients are what moves)
        self.sent_during_backward = 0  # groups sent by the ExecGraph's hooks, before finish()
        self.bytes_during_backward = 0
        self.groups: list[list[str]] = []  # plan tensor names per send group
        size = 0
        for n in reversed(param_names):
            key = keys[n]
            if not self.groups or size >= group_bytes:
                self.groups.append([])
                size = 0
            self.groups[-1].append(key)
            size += math.prod(src[key].global_shape) * dtypes[key].itemsize
        self.group_of = {key: g for g, keys_ in enumerate(self.groups) for key in keys_}
        self._waiting = [set(keys_) for keys_ in self.groups]  # not final yet, per group
        self._next = 0  # the first group not sent yet
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.bytes_sent = self.bytes_received = 0
        self._recvs: list[tuple[dist.Work, torch.Tensor, list[Transfer]]] = []
        for peer, transfers in plan.receives(rank).items():
            for tag, dtype, part in self._messages(transfers):
                buf = torch.empty(sum(_volume(t) for t in part), dtype=dtype, device=self.device)
                self._recvs.append((dist.irecv(buf, peer, group=self._towards(peer, rank), tag=tag), buf, part))
                self.bytes_received += buf.numel() * buf.element_size()

    def _towards(self, sender: int, receiver: int):
        """The process group of messages from `sender` to `receiver` (see the class doc)."""
        return self.process_groups[0 if receiver > sender else 1]

    @staticmethod
    def supports(plan: SwitchPlan) -> bool:
        """Plans it can run: one stage, pieces kept whole, and something to send (a switch that only
        slices local pieces gains nothing from starting early)."""
        return plan.stages == 1 and plan.algorithm != "gather" and len(plan.transfer_array) > 0

    def _messages(self, transfers: list[Transfer]) -> list[tuple[int, torch.dtype, list[Transfer]]]:
        """One peer's transfers as messages, (tag, dtype, transfers) per (group, dtype), listed alike
        by the sender and the receiver."""
        kinds = sorted({str(d) for d in self.dtypes.values()})
        parts: dict[int, list[Transfer]] = {}
        for t in transfers:
            tag = self.group_of[t.tensor] * len(kinds) + kinds.index(str(self.dtypes[t.tensor]))
            parts.setdefault(tag, []).append(t)
        return [(tag, self.dtypes[part[0].tensor], part) for tag, part in sorted(parts.items())]

    def final(self, names: list[str]) -> None:
        """The accumulated gradients of parameters `names` are final (the ExecGraph's hook, once the
        caller has added that call's gradients): send each group that is now complete."""
        for n in names:
            key = self.keys[n]
            self._waiting[self.group_of[key]].discard(key)
        before = self.bytes_sent
        while self._next < len(self.groups) and not self._waiting[self._next]:
            self._send(self._next)
            self.sent_during_backward += 1
        self.bytes_during_backward += self.bytes_sent - before

    def _send(self, g: int) -> None:
        self._next = g + 1
        grads = None
        for peer, transfers in self.plan.by_peer(self.rank).items():
            mine = [t for t in transfers if self.group_of[t.tensor] == g]
            for tag, dtype, part in self._messages(mine):
                buf = None
                if self.error is None:
                    try:
                        grads = self._accumulated() if grads is None else grads
                        pieces = []
                        for t in part:
                            grad = grads[_param(t.tensor)]
                            if grad.dtype != dtype:
                                raise TypeError(f"{t.tensor} is accumulated in {grad.dtype}, planned as {dtype}")
                            pieces.append((grad, t.src_local(self.src[t.tensor])))
                        _maybe_fail("pack", self.rank)
                        buf = pack(pieces)
                    except Exception as e:  # noqa: BLE001 - reported by finish() on every rank
                        self.error = e
                if buf is None:  # the peer still gets its message: it must not wait forever
                    buf = torch.zeros(sum(_volume(t) for t in part), dtype=dtype, device=self.device)
                self._sends.append((dist.isend(buf, peer, group=self._towards(self.rank, peer), tag=tag), buf))
                self.bytes_sent += buf.numel() * buf.element_size()

    def finish(self) -> tuple[dict[str, torch.Tensor], int, int]:
        """(new gradients by parameter name in the destination layout, bytes sent, bytes received);
        raises SwitchAborted on every rank if any rank failed."""
        while self._next < len(self.groups):
            self._send(self._next)
        for work, _ in self._sends:
            work.wait()
        for work, _, _ in self._recvs:
            work.wait()
        new: dict[str, torch.Tensor] = {}
        try:
            if self.error is not None:
                raise self.error
            grads = self._accumulated()
            old = {key: grads[_param(key)] for key in self.dst if _param(key) in grads}
            written = {t.tensor for _, _, part in self._recvs for t in part}
            new = _destination(self.plan, old, self.src, self.dst, self.rank, written, self.dtypes, self.device)
            for _, buf, part in self._recvs:
                unpack(buf, [(new[t.tensor], t.dst_local(self.dst[t.tensor])) for t in part])
            _maybe_fail("unpack", self.rank)
        except Exception as e:  # noqa: BLE001
            self.error = e
        if not _agree(self.error is None, self.process_groups[0]):
            raise SwitchAborted(f"switch aborted: the gradients handed off during the backward did not arrive "
                                f"whole (rank {self.rank}: {self.error!r}); the previous config is still active"
                                ) from self.error
        return {_param(k): v for k, v in new.items()}, self.bytes_sent, self.bytes_received


def _param(key: str) -> str:
    return split_key(key)[1]


_FAULTS: dict[str, set[int] | None] = {}


@contextlib.contextmanager
def inject_fault(stage: str, ranks: set[int] | None = None) -> Iterator[None]:
    """Testing hook: raise inside the executor at `stage` ('pack', 'unpack') on `ranks` (all if None)."""
    _FAULTS[stage] = ranks
    try:
        yield
    finally:
        _FAULTS.pop(stage, None)


def _maybe_fail(stage: str, rank: int) -> None:
    if stage in _FAULTS and (_FAULTS[stage] is None or rank in _FAULTS[stage]):
        raise RuntimeError(f"injected fault at {stage!r} on rank {rank}")


def _agree(ok: bool, group) -> bool:
    flag = comm_tensor([1 if ok else 0], torch.int32, group)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _volume(t: Transfer) -> int:
    n = 1
    for a, b in t.box:
        n *= b - a
    return n


def execute_plan(plan: SwitchPlan, old: dict[str, torch.Tensor], src: dict[str, Layout], dst: dict[str, Layout],
                 rank: int, group=None, backend: str = "auto",
                 dtypes: dict[str, torch.dtype] | None = None,
                 device: torch.device | None = None) -> tuple[dict[str, torch.Tensor], int, int]:
    """Move `old` (this rank's source shards) into new destination shards; returns (new, sent, received).

    `new` has an entry for every tensor whose destination layout includes this rank (and none for
    the others: under pipeline parallelism a rank holds only its stage's parameters). `dtypes` gives
    the dtype of tensors this rank does not hold yet (default: float32); `device` where new shards and
    receive buffers go (default: the process group's device).
    """
    device = device if device is not None else runtime_device(group)
    new: dict[str, torch.Tensor] = {}
    error: BaseException | None = None
    sends: list[tuple[int, torch.Tensor]] = []
    recvs: list[tuple[int, torch.Tensor, list[Transfer]]] = []
    incoming = plan.receives(rank)
    written = {t.tensor for transfers in incoming.values() for t in transfers}
    try:
        new = _destination(plan, old, src, dst, rank, written, dtypes, device)
        sends = _packed(plan.by_peer(rank), old, src, backend)
        _maybe_fail("pack", rank)
        recvs = _receive_buffers(incoming, new, device)
    except Exception as e:  # noqa: BLE001 - reported to every rank below, then re-raised
        error = e
    moves_data = len(plan.transfer_array) > 0  # same on every rank: the plan is global
    if moves_data and not _agree(error is None, group):  # a failed rank must not leave peers waiting in P2P
        raise SwitchAborted(f"switch aborted before any transfer (rank {rank}: {error!r})") from error
    _exchange(sends, recvs, group)
    relay_sends: list[tuple[int, torch.Tensor]] = []
    relay_recvs: list[tuple[int, torch.Tensor, list[Transfer]]] = []
    try:
        for peer, buf, transfers in recvs:
            if plan.algorithm == "gather":  # whole source boxes arrive; keep the part inside our box
                offset = 0
                for t in transfers:
                    piece = buf[offset: offset + _volume(t)].view(t.shape)
                    new[t.tensor][t.dst_local(dst[t.tensor])] = piece[t.piece_local(dst[t.tensor])]
                    offset += _volume(t)
            else:
                unpack(buf, [(new[t.tensor], t.dst_local(dst[t.tensor])) for t in transfers], backend=backend)
        if plan.stages > 1:  # the relay stage: forward from the new storage what crossed the node link once
            relay_sends = _packed(plan.by_peer(rank, stage=1), new, dst, backend)
            relay_recvs = _receive_buffers(plan.receives(rank, stage=1), new, device)
    except Exception as e:  # noqa: BLE001
        error = e
    if plan.stages > 1:
        if not _agree(error is None, group):
            raise SwitchAborted(f"switch aborted before its relay stage (rank {rank}: {error!r}); "
                                "the previous config is still active") from error
        _exchange(relay_sends, relay_recvs, group)
    try:
        for peer, buf, transfers in relay_recvs:
            unpack(buf, [(new[t.tensor], t.dst_local(dst[t.tensor])) for t in transfers], backend=backend)
        _maybe_fail("unpack", rank)
    except Exception as e:  # noqa: BLE001
        error = e
    if not _agree(error is None, group):
        raise SwitchAborted(f"switch aborted after the transfers, before commit (rank {rank}: {error!r}); "
                            "the previous config is still active") from error
    sent = sum(b.numel() * b.element_size() for _, b in sends + relay_sends)
    received = sum(b.numel() * b.element_size() for _, b, _ in recvs + relay_recvs)
    return new, sent, received


def _destination(plan: SwitchPlan, old: dict[str, torch.Tensor], src: dict[str, Layout], dst: dict[str, Layout],
                 rank: int, written: set[str], dtypes: dict[str, torch.dtype] | None,
                 device) -> dict[str, torch.Tensor]:
    """This rank's new destination shards, with its local copies made: new storage, except where
    the same piece stays here and nothing arrives into it (then `old`'s tensor, never written)."""
    new: dict[str, torch.Tensor] = {}
    for name, layout in dst.items():
        if not layout.mesh.contains(rank):
            continue
        if name in old and name not in written and src[name].mesh.contains(rank) \
                and src[name].box(rank) == layout.box(rank):
            new[name] = old[name]
        else:
            dtype = old[name].dtype if name in old else (dtypes or {}).get(name, torch.float32)
            new[name] = torch.empty(layout.local_shape(rank), dtype=dtype, device=device)
    for t in plan.local_copies_of(rank):
        if new[t.tensor] is old.get(t.tensor):
            continue
        piece = old[t.tensor][t.src_local(src[t.tensor])]
        new[t.tensor][t.dst_local(dst[t.tensor])] = piece[t.piece_local(dst[t.tensor])]
    return new


def _packed(by_peer: dict[int, list[Transfer]], tensors: dict[str, torch.Tensor], layouts: dict[str, Layout],
            backend: str) -> list[tuple[int, torch.Tensor]]:
    """One packed send buffer per (peer, dtype), read from `tensors` laid out as `layouts`; identical
    buffers (replicas of a tensor send the same bytes to several peers) are built once."""
    built: dict[tuple, torch.Tensor] = {}
    sends = []
    for peer, transfers in by_peer.items():
        for dtype, group_t in _by_dtype(transfers, tensors).items():
            key = (dtype, tuple((t.tensor, t.box) for t in group_t))
            if key not in built:
                built[key] = pack([(tensors[t.tensor], t.src_local(layouts[t.tensor])) for t in group_t],
                                  backend=backend)
            sends.append((peer, built[key]))
    return sends


def _receive_buffers(receives: dict[int, list[Transfer]], new: dict[str, torch.Tensor],
                     device) -> list[tuple[int, torch.Tensor, list[Transfer]]]:
    """One receive buffer per (peer, dtype), in the sender's packing order."""
    return [(peer, torch.empty(sum(_volume(t) for t in group_t), dtype=dtype, device=device), group_t)
            for peer, transfers in receives.items() for dtype, group_t in _by_dtype(transfers, new).items()]


def _exchange(sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor, list]], group) -> None:
    """Every send and receive of one stage in one `batch_isend_irecv`, waited for."""
    ops = [dist.P2POp(dist.isend, buf, peer, group) for peer, buf in sends]
    ops += [dist.P2POp(dist.irecv, buf, peer, group) for peer, buf, _ in recvs]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def _by_dtype(transfers: list[Transfer], tensors: dict[str, torch.Tensor]) -> dict[torch.dtype, list[Transfer]]:
    out: dict[torch.dtype, list[Transfer]] = {}
    for t in transfers:
        out.setdefault(tensors[t.tensor].dtype, []).append(t)
    return out
