"""Switching a compiled model between its configs: the plan per pair (pure, cached), the move of
weights, gradients and attached states by it (atomic: a failed switch changes nothing), weights
prefetched in the background, and gradients handed off during the backward that makes them final.

Plans come from `switch.planner` (who sends which slice to whom) and run on `switch.executor`;
this module decides what moves when, and keeps the moves under way between calls.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from hotswitch.compiler import _dtensor as dt
from hotswitch.distconfig import Layout, Mesh, Replicate
from hotswitch.distributed.device import synchronize
from hotswitch.switch.executor import BackgroundMove, GradientHandoff, SwitchAborted, SwitchStats, execute_plan
from hotswitch.switch.order import OrderPlan, plan_order
from hotswitch.switch.planner import PlanCache, SwitchPlan, TensorMove
from hotswitch.switch.state import StateKind, state_key


class Switcher:
    """The switching of one CompiledModel (`cm`), whose state it reads and replaces: its public
    methods are the model's `switch`, `prefetch`, `hand_off_grads`, `plan_switch` and `plan_order`."""

    def __init__(self, cm):
        self.cm = cm
        self._plans = PlanCache()
        self._prefetch: BackgroundMove | None = None  # the next config's weights, moving in the background
        self._prefetch_group = None  # its process group (made on first use): apart from the ExecGraphs'
        self.pending_hand_off: GradientHandoff | None = None  # gradients moving into the next config during a backward
        self._hand_off_groups = None  # its process groups (made on first use; see GradientHandoff)

    def switch(self, name: str, algorithm: str = "greedy", weights: dict[str, torch.Tensor] | None = None
               ) -> SwitchStats:
        """`CompiledModel.switch`: the weights (unless given or prefetched), gradients and attached states
        moved into `name`'s layout, all or nothing."""
        cm = self.cm
        st = cm._state(name)
        prefetched = self.take_prefetch(name)
        t0 = time.perf_counter()
        handed = self.take_hand_off(name)
        if name == cm._active:
            return SwitchStats(name, name, algorithm, 0.0, 0, 0)
        overlapped, sent, received, handed_off = 0.0, 0, 0, 0
        if weights is None and prefetched is not None:
            (weights, sent, received), overlapped = prefetched
        if weights is not None:
            self._check_weights(name, weights)
        kinds = cm._moving_kinds()
        new = {}
        if handed is not None:  # the gradients left during the last backward: what arrived is theirs
            grads, s, r, handed_off = handed
            new.update({state_key(StateKind.GRAD, n): g for n, g in grads.items()})
            sent, received = sent + s, received + r
            kinds = tuple(k for k in kinds if k != StateKind.GRAD)
        move_weights = weights is None
        if move_weights or kinds:
            plan = self.plan_switch(cm._active, name, algorithm=algorithm, with_grads=StateKind.GRAD in kinds,
                                    states=tuple(k for k in kinds if k != StateKind.GRAD), weights=move_weights)
            old = dict(cm._local) if move_weights else {}
            for kind in kinds:
                old.update({state_key(kind, n): t for n, t in cm._kind(kind).items()})
            src, dst = cm._layouts(cm._active, kinds, move_weights), cm._layouts(name, kinds, move_weights)
            moved, s, r = execute_plan(plan, old, src, dst, cm.rank, dtypes={m: cm._dtype(m) for m in dst},
                                       device=cm.device)
            new.update(moved)
            sent, received = sent + s, received + r
        if weights is not None:
            new.update(weights)
        # under pp > 1 a rank holds only its stage's parameters: the others are absent from `new`
        cm._local = {n: new[n] for n in cm.logic.param_names if n in new}
        if cm._grads is not None:
            cm._grads = {n: new[state_key(StateKind.GRAD, n)] for n in cm.logic.param_names
                         if state_key(StateKind.GRAD, n) in new}
        for kind in cm._param_states:
            cm._param_states[kind] = {n: new[state_key(kind, n)] for n in cm.logic.param_names
                                      if state_key(kind, n) in new}
        synchronize(cm.device)  # the received buffers are unpacked (CUDA queues the work) before the clock
        cm.last_switch = SwitchStats(
            cm._active, st.config.name, algorithm, time.perf_counter() - t0, sent, received, overlapped, handed_off
        )
        cm._active = name
        return cm.last_switch

    def prefetch(self, name: str, algorithm: str = "greedy") -> None:
        """`CompiledModel.prefetch`: the weights start moving into `name`'s layout on a thread."""
        cm = self.cm
        cm._state(name)
        self.take_prefetch(None)
        if name == cm._active:
            return
        if self._prefetch_group is None:  # a collective: every rank makes it at its first prefetch
            self._prefetch_group = dist.new_group(list(range(cm.world_size)))
        plan = self.plan_switch(cm._active, name, algorithm=algorithm)
        dst = cm._layouts(name)
        self._prefetch = BackgroundMove(name, plan, dict(cm._local), cm._layouts(cm._active), dst, cm.rank,
                                        self._prefetch_group, dtypes={m: cm._dtype(m) for m in dst},
                                        device=cm.device)

    def hand_off_grads(self, name: str, algorithm: str = "greedy") -> bool:
        """`CompiledModel.hand_off_grads`: arm the next backward to send its final gradients into `name`'s layout."""
        cm = self.cm
        cm._state(name)
        self.settle_hand_off()
        if name == cm._active or cm._states[cm._active].config.pp > 1 or dist.get_backend() != "gloo":
            return False
        plan = self.plan_switch(cm._active, name, algorithm=algorithm, with_grads=True, weights=False)
        if not GradientHandoff.supports(plan):
            return False
        if self._hand_off_groups is None:  # collectives: every rank makes them at its first hand-off
            self._hand_off_groups = tuple(dist.new_group(list(range(cm.world_size))) for _ in range(2))
        grads = (StateKind.GRAD,)
        src, dst = cm._layouts(cm._active, grads, False), cm._layouts(name, grads, False)
        self.pending_hand_off = GradientHandoff(
            name, plan, list(cm.logic.param_names), {n: state_key(StateKind.GRAD, n) for n in cm.logic.param_names},
            src, dst, cm.rank, self._hand_off_groups, dtypes={m: cm._dtype(m) for m in dst},
            accumulated=lambda: cm._grads or {}, device=cm.device,
            group_bytes=cm.grad_bucket_bytes // 4)
        return True

    def take_hand_off(self, name: str):
        """The gradients handed off into `name` during the last forward_backward as (grads, sent,
        received, sent during that backward), or None; a hand-off elsewhere (or not run yet) is
        completed and dropped."""
        pending = self.pending_hand_off
        if pending is None or pending.destination != name or not pending.ran:
            self.settle_hand_off()
            return None
        self.pending_hand_off = None
        return (*pending.finish(), pending.bytes_during_backward)

    def settle_hand_off(self) -> None:
        """Complete a pending hand-off and drop what it moved (every rank has its messages under way)."""
        pending, self.pending_hand_off = self.pending_hand_off, None
        if pending is not None:
            with contextlib.suppress(SwitchAborted):
                pending.finish()

    def take_prefetch(self, name: str | None):
        """The finished prefetch into `name` as ((weights, sent, received), seconds), or None; a
        prefetch into another config is waited for and dropped (its transfers are under way on
        every rank)."""
        pending, self._prefetch = self._prefetch, None
        if pending is None:
            return None
        out = pending.result()
        return (out, pending.seconds) if pending.destination == name else None

    def _check_weights(self, name: str, weights: dict[str, torch.Tensor]) -> None:
        cm = self.cm
        layouts = cm._layouts(name)
        for n in cm._held(cm._states[name]):
            want = tuple(layouts[n].local_shape(cm.rank))
            if n not in weights or tuple(weights[n].shape) != want:
                got = tuple(weights[n].shape) if n in weights else "nothing"
                raise ValueError(f"switch({name!r}, weights=...): {n} needs this rank's shard of shape {want}, "
                                 f"got {got}")

    def plan_switch(self, source: str, destination: str, algorithm: str = "greedy",
                    with_grads: bool = False, states: tuple[str, ...] = (), weights: bool = True) -> SwitchPlan:
        """`CompiledModel.plan_switch`: the cached plan of a move from `source`'s layout to `destination`'s (pure)."""
        cm = self.cm
        cm._state(source), cm._state(destination)
        kinds = ((StateKind.GRAD,) if with_grads else ()) + tuple(states)

        def moves():
            src, dst = cm._layouts(source, kinds, weights), cm._layouts(destination, kinds, weights)
            return [TensorMove(n, tuple(src[n].global_shape), cm._itemsize(n), src[n], dst[n]) for n in src]

        return self._plans.get((source, kinds, weights), (destination, kinds, weights), moves, cm.topology,
                               algorithm)

    def plan_order(self, names, base: str | None = None) -> OrderPlan:
        """`CompiledModel.plan_order`: the cheapest cycle through `names`, priced by the plans."""
        cm = self.cm
        for n in names:
            cm._state(n)
        return plan_order(
            list(names), lambda a, b, first: self.plan_switch(a, b, with_grads=not first).estimated_seconds, base=base
        )

    def full_tensors(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full tensors on every rank from this rank's shards (in the active layout) of every
        parameter, or of a per-parameter state (a collective: call on every rank)."""
        cm = self.cm
        st = cm._states[cm._active]
        if st.full_mesh is not None:
            return self._gather(local)
        out = {}
        for n in cm.logic.param_names:
            if all(p.is_replicate() for p in st.param_specs[n]):
                out[n] = local[n].clone()
            else:
                out[n] = dt.from_local(local[n], st.mesh, st.param_specs[n], cm.logic.param_shapes[n]).full_tensor()
        return out

    def _gather(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full tensors on every rank from pieces that live on pipeline stages' sub-meshes: a switch
        plan into a layout where every rank holds everything, run by the executor (one batched
        exchange). A collective: call on every rank."""
        cm = self.cm
        mine = {n: str(t.dtype).removeprefix("torch.") for n, t in local.items()}
        gathered = [None] * cm.world_size
        dist.all_gather_object(gathered, mine)  # ranks without a piece learn the dtype
        dtypes = {n: getattr(torch, d) for g in gathered for n, d in g.items()}
        src = cm._layouts(cm._active)
        everyone = Mesh(list(range(cm.world_size)), ("world",))
        dst = {n: Layout(tuple(cm.logic.param_shapes[n]), everyone, (Replicate(),)) for n in cm.logic.param_names}
        key = tuple(sorted((n, d.itemsize) for n, d in dtypes.items()))
        plan = self._plans.get(
            (cm._active, "pieces"),
            ("everyone", key),
            lambda: [
                TensorMove(n, tuple(cm.logic.param_shapes[n]), dtypes[n].itemsize, src[n], dst[n])
                for n in cm.logic.param_names
            ],
            cm.topology,
        )
        new, _, _ = execute_plan(plan, local, src, dst, cm.rank, dtypes=dtypes, device=cm.device)
        return {n: t.clone() if t is local.get(n) else t for n, t in new.items()}
