"""A compiled model's programs on this rank: each (config, local input shapes) lowered once, and
sequence lengths fitted instead of lowered where the programs allow (`compiler.lengths`).

`Programs.get` is the one way a CompiledModel obtains a program: from its config's table, written
from a length fit, sampled at a second length and fitted, or lowered (or loaded from the compile
cache) by `compiler.program.lower_program`. What it keeps per config lives on the config's
`ConfigState` (`programs`, `lengths`, `decisions`, seconds spent).
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from hotswitch.compiler.garbage import collector_paused
from hotswitch.compiler.lengths import CannotFit, LengthFit
from hotswitch.compiler.program import (
    StageProgram,
    completed,
    fit_key,
    fit_programs,
    load_fit,
    lower_program,
    program_at,
    store_fit,
)
from hotswitch.compiler.stages import StageSplit
from hotswitch.compiler.trace import LogicGraph
from hotswitch.runtime.config_state import ConfigState, LengthFamily
from hotswitch.runtime.shared import SharedCache

# second lengths a config's rows sample before every length is lowered (`LengthFamily.unfit`)
_SECOND_LENGTHS = 3


class Programs:
    """This rank's programs of every config of one model, lowered on first use (see the module
    docstring). `buffers`: the model's buffers as the programs take them (read at each lowering);
    `split(pp)`: the LogicGraph cut into pp pipeline stages."""

    def __init__(self, logic: LogicGraph, cache: SharedCache, *, buffers: Callable[[], list[torch.Tensor]],
                 input_dtypes: list[torch.dtype], sequence_inputs: tuple[bool, ...], split: Callable[[int], StageSplit],
                 strict: bool, dynamic: bool | None, bucket_bytes: int, report: Callable[[str], None]):
        self.logic, self._cache, self._buffers, self._input_dtypes = logic, cache, buffers, input_dtypes
        self._sequence_inputs, self._split, self.strict, self.dynamic = sequence_inputs, split, strict, dynamic
        self.grad_bucket_bytes, self._report = bucket_bytes, report
        # config -> DTensor propagation results shared by that config's lowerings. Not across configs:
        # two configs' meshes can compare equal (same ranks) yet own different process groups, and a
        # result carries its mesh, so the collectives it leads to would name the other config's group
        self._propagation_memo: dict[str, dict] = {}

    @collector_paused()  # a lowering, or loading one from the cache (see compiler.garbage)
    def get(self, st: ConfigState, local_shapes: tuple, *, train: bool, reduce: bool,
            cp_length: int | None = None) -> StageProgram:
        """This rank's lowered programs for local (micro-)batches of `local_shapes`, lowered on first
        use and cached: the whole model with the DP reduction inside (`reduce`, pp = 1) or this rank's
        stage with the reduction deferred (micro-batches, pp > 1). See hotswitch.compiler.program.
        `cp_length`: the global sequence length where cp cuts it unevenly (`ConfigState.cp_length`):
        part of the key, as the local lengths no longer say it; such lengths are lowered, not fitted."""
        key = (tuple(tuple(s) for s in local_shapes), train, reduce, *([cp_length] if cp_length else []))
        if key not in st.programs:
            what = f"{st.config.name} for local {'micro-batches' if not reduce else 'inputs'} {list(key[0][0])}" + (
                "" if train else " (forward only)") + (f", stage {st.stage}" if st.full_mesh is not None else "")
            program = self._fitted(st, key)
            if program is None:
                program = self._second_length(st, key, what)
            if program is not None and program.fitted is not None:
                how = f"fitted from lengths {program.fitted[0]} and {program.fitted[1]}"
            elif program is not None:  # (why not fitted: said as it was refused)
                how = f"{program.replayed} placements replayed; no fit in the length"
            else:
                self._report(f"lowering {what}")
                program = self.lower(st, key)
                if program.loaded:
                    how = "loaded: the compile cache or another dp rank had it"
                else:
                    how = f"{program.replayed} placements replayed" if program.replayed else "placements searched"
                    how += f" in {program.propagate_seconds:.1f} s"
                self._learn_length(st, key, program)
            self._report(f"lowered {what} in {program.seconds:.1f} s ({how})")
            st.programs[key] = program
            st.compile_seconds[key] = program.seconds
            if self.dynamic:
                self._fit_now(st, key)
        return st.programs[key]

    def lower(self, st: ConfigState, key: tuple, sample: bool = False) -> StageProgram:
        """Lower (or load) the program of `key` (see `_program`); `sample`: one only read as a graph,
        for a length fit (`compiler.program.lower_program`)."""
        (local_shapes, train, reduce, *cp_length), graph = key, (key[1], st.stage)
        stage = self._split(st.config.pp).stages[st.stage] if st.full_mesh is not None else None
        program = lower_program(self.logic, stage, st.where, self._buffers(), local_shapes,
                                self._input_dtypes, train=train, reduce=reduce,
                                strict=self.strict, memo=self._propagation_memo.setdefault(st.config.name, {}),
                                decided=st.decisions.get(graph), cache=self._cache, sample=sample,
                                bucket_bytes=self.grad_bucket_bytes, cp_length=cp_length[0] if cp_length else None)
        st.decisions.setdefault(graph, program.decisions)
        return program

    def _by_length(self, key: tuple) -> tuple[tuple, int] | None:
        """(the program key with the sequence length left out, the length), or None when the inputs
        do not share one length, or cp cuts it unevenly (a key that names the global length)."""
        if len(key) != 3:
            return None
        shapes, train, reduce = key
        lengths = {s[1] for s, along_seq in zip(shapes, self._sequence_inputs) if along_seq}
        if len(lengths) != 1:
            return None
        family = tuple((s[0], None, *s[2:]) if along_seq else s for s, along_seq in zip(shapes, self._sequence_inputs))
        return (family, train, reduce), lengths.pop()

    def _learn_length(self, st: ConfigState, key: tuple, program: StageProgram) -> None:
        """After lowering a program (the whole model's, or this rank's stage's): the first at its shapes
        but the length is kept, for `_second_length` to sample the next and fit the two (and a second,
        where that sample did not lower, for `_fitted` to fit when a third length comes)."""
        found = self._by_length(key)
        if found is not None:
            family = st.lengths.setdefault(found[0], LengthFamily())
            if len(family.lowered) < 2:
                family.lowered.append((found[1], program))

    def _fitted(self, st: ConfigState, key: tuple) -> StageProgram | None:
        """The program for `key` written from the fit of two earlier lengths (`compiler.lengths`); None:
        fewer than two lowered yet, they do not fit, the fit does not hold at this length, or
        `dynamic=False`."""
        found = self._by_length(key)
        family = st.lengths.get(found[0]) if found is not None else None
        if self.dynamic is False or family is None or family.refused is not None or \
                (family.fit is None and len(family.lowered) < 2):
            return None
        try:
            return program_at(self._length_fit(st, family), family.lowered[0][1], found[1], key[0])
        except CannotFit as e:
            if family.refused is not None:
                self._report(f"{st.config.name}: every sequence length is lowered ({e})")
            else:
                self._report(f"{st.config.name}: length {found[1]} is lowered ({e})")
            return None

    def _second_length(self, st: ConfigState, key: tuple, what: str) -> StageProgram | None:
        """The program for `key` at a second sequence length of its rows, as the fit of the first and
        this one: this length is lowered as a sample (its decisions replayed, its graph only, as
        `dynamic=True` lowers half the first length), fitted with the first, and its program written
        from the fit like every later length's, so that neither this length nor the next writes,
        compiles or files a program of its own. Where they do not fit, the sample is completed into this
        length's program, and the next new length is sampled in its place (an uneven length does not
        fit; an even one after it may), `_SECOND_LENGTHS` in all. Ranks that differ only in their dp
        coordinate and ran one first program between them (its decisions say so) sample and fit once:
        the first to get here does, the others wait for its fit ("shared length fit"). None: not a
        second length (or `dynamic=False`), or the sample did not lower (the full lowering says why)."""
        found = self._by_length(key)
        family = st.lengths.get(found[0]) if found is not None else None
        if self.dynamic is False or family is None or len(family.lowered) != 1 or family.fit is not None or \
                family.refused is not None:
            return None
        t0, fit_seconds = time.perf_counter(), st.fit_seconds
        first_length, first = family.lowered[0]
        shared = first.decisions is not None and first.decisions.dp_shared
        kind = "shared length fit" if shared else "length fit"
        filed = fit_key(self._cache, first, first_length, found[1], kind)
        sample = None
        if not self._cached_fit(st, family, filed, kind):  # (a shared fit's: ours to make, put or fail)
            self._report(f"lowering {what}")
            try:
                sample = self.lower(st, key, sample=True)
            except Exception:  # noqa: BLE001 - lowered again in full, which raises what is wrong
                if shared and filed is not None:
                    self._cache.failed(filed)  # the other dp ranks lower it themselves (and raise the same)
                return None
            if shared and filed is not None and not sample.decisions.dp_shared:
                # this length's program reads the dp coordinate (uneven rows, say): so does its fit
                self._cache.failed(filed)
                filed = None
            family.lowered.append((found[1], sample))
            try:
                self._length_fit(st, family, (filed, kind))
            except CannotFit as e:  # this length is its sample's program
                self._report(f"{st.config.name}: every sequence length is lowered ({e})" if family.refused else
                             f"{st.config.name}: length {found[1]} is lowered ({e}); the next is tried")
        st.fit_seconds = fit_seconds  # (all of it this length's: its program's seconds)
        program = self._fitted(st, key)
        if program is None and sample is not None:  # refused: its own program, from its sample
            program = completed(sample)
        return None if program is None else replace(program, seconds=time.perf_counter() - t0)

    def _length_fit(self, st: ConfigState, family: LengthFamily,
                    filed: tuple[str | None, str] | None = None) -> LengthFit:
        """The fit of `family`'s two lowered programs, computed once, or loaded where an earlier
        process filed it in the compile cache. `filed`: (key, kind) where the cache has been looked in
        already (`_second_length`), to file it there. CannotFit: the second is dropped, and the next
        new length is sampled in its place; after `_SECOND_LENGTHS` of them every length is lowered
        (`family.refused`)."""
        if family.fit is None:
            (length_a, first), (length_b, second) = family.lowered
            key, kind = filed or (fit_key(self._cache, first, length_a, length_b), "length fit")
            if filed is None and self._cached_fit(st, family, key):
                return family.fit
            claimed = key is not None and kind == "shared length fit"  # other dp ranks wait for it
            t0 = time.perf_counter()
            try:
                family.fit = fit_programs(self.logic, first, length_a, second, length_b)
            except BaseException as e:
                if isinstance(e, CannotFit):
                    family.lowered.pop()  # (its own program already: a sample completed, or lowered in full)
                    family.unfit.append((length_b, str(e)))
                    if len(family.unfit) >= _SECOND_LENGTHS:
                        family.refused = str(e)
                if claimed:
                    self._cache.failed(key)  # they fit for themselves (and are refused alike)
                raise
            finally:
                st.fit_seconds += time.perf_counter() - t0
            if key is not None and not store_fit(self._cache, key, family.fit, st.where, kind) and claimed:
                self._cache.failed(key)
            family.lowered[1] = (length_b, None)  # about 21,000 objects at 8 layers, for the collector to walk
        return family.fit

    def _cached_fit(self, st: ConfigState, family: LengthFamily, key: str | None, kind: str = "length fit") -> bool:
        """Did the compile cache hold, under `key` (`fit_key`; None: nowhere to look), the fit of
        `family`'s first program? (It is then `family.fit`.)"""
        if key is None:
            return False
        t0 = time.perf_counter()
        family.fit = load_fit(self._cache, key, family.lowered[0][1], st.where, kind)
        st.fit_seconds += time.perf_counter() - t0
        family.fit_loaded = family.fit is not None
        return family.fit_loaded

    def _fit_now(self, st: ConfigState, key: tuple) -> None:
        """`dynamic=True`: after the first program at some rows (`key`), the program at half its
        length (its decisions replayed) and the fit of the two, so that no later length at these rows
        is lowered. Where that fails the lengths are lowered one by one, as with `dynamic=False`."""
        found = self._by_length(key)
        family = st.lengths.get(found[0]) if found is not None else None
        if family is None or len(family.lowered) != 1 or family.fit is not None or family.refused is not None:
            return  # not a program in the length, or its rows are fitted (or being fitted) already
        length = found[1]
        if length % 2:
            family.refused = f"the first length, {length}, is odd: no second length to fit with was chosen"
        elif self._cached_fit(st, family, fit_key(self._cache, family.lowered[0][1], length, length // 2)):
            self._report(f"{st.config.name}: fitted in the sequence length from lengths {length // 2} and {length} "
                         "(loaded: the compile cache had the fit)")
            return
        else:
            half = tuple((s[0], length // 2, *s[2:]) if along_seq else s
                         for s, along_seq in zip(key[0], self._sequence_inputs))
            try:
                # read as a graph only, and not kept: a step at this length runs a program written from the fit
                sample = self.lower(st, (half, key[1], key[2]), sample=True)
                st.fit_seconds += sample.seconds
                family.lowered.append((length // 2, sample))
                self._length_fit(st, family)
            except Exception as e:  # noqa: BLE001 - a half the sharding does not divide, say: no fit, no harm
                family.refused = family.refused or f"{type(e).__name__}: {e}"
        if family.refused is None:
            self._report(f"{st.config.name}: fitted in the sequence length from lengths {length // 2} and {length}")
            return
        # asked for and not given: said where it is seen without a progress callback too, by one rank
        # where every rank refuses alike (an odd example length), by each that refused otherwise
        message = f"{st.config.name}: dynamic=True, but every sequence length is lowered ({family.refused})"
        self._report(message)
        if not length % 2 or not dist.is_initialized() or dist.get_rank() == 0:
            warnings.warn(f"hotswitch: {message}", stacklevel=2)
