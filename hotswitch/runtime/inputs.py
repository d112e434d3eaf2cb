"""A compiled model's inputs: each rank's part of a global batch (`InputSharding.shard`), the global
shapes behind a rank's part, and the checks that a batch can be split as a config needs.

The data-parallel axis takes rows (torch.tensor_split sizes: uneven splits are exact for a loss
written as sum / count); the context-parallel axis takes each row's sequence, contiguous chunks or
tokens placed by document (`CP_LAYOUTS`).
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from hotswitch.compiler.program import StageProgram
from hotswitch.compiler.signature import ModelCall
from hotswitch.distconfig import chunk_span
from hotswitch.distributed.device import comm_tensor
from hotswitch.runtime.config_state import ConfigState


class InputSharding:
    """How a model's inputs are cut over a config's mesh: `call` (the model's input names),
    `sequence_inputs` (per input: is dim 1 the sequence), `split_loss` (is the loss a sum / count)."""

    def __init__(self, call: ModelCall, sequence_inputs: tuple[bool, ...], split_loss: bool, cp_layout: str,
                 world_size: int, rank: int):
        self.call, self._sequence_inputs, self._split_loss = call, sequence_inputs, split_loss
        self.world_size, self.rank = world_size, rank
        self.cp_layout = cp_layout
        self._global_shapes: dict[tuple, tuple] = {}  # (config, local shapes) -> the global batch's shapes
        self._warned_unsharded = False

    @property
    def cp_layout(self) -> str:
        """How `shard` lays the sequence out over cp ranks (see CP_LAYOUTS)."""
        return self._cp_layout

    @cp_layout.setter
    def cp_layout(self, layout: str) -> None:
        self._cp_layout = checked_cp_layout(layout)

    def shard(self, st: ConfigState, args: tuple, kwargs: dict):
        """This rank's part of a global batch: every tensor input's dim 0 split over the data-parallel
        axis (torch.tensor_split sizes) and, under context parallelism, the sequence dim (dim 1) of
        every input that has one over the cp axis, as `cp_layout` says (CP_LAYOUTS). Mirrors the call:
        positional inputs give a tuple (`cm.forward_backward(*cm.shard_inputs(*batch))`), keyword
        inputs a dict (`cm.forward_backward(**cm.shard_inputs(**batch))`); non-tensor inputs pass through."""
        if args and kwargs:
            raise ValueError("shard_inputs takes the inputs either positionally or by keyword, not both, so that it "
                             "can return them in the same form (a tuple or a dict)")
        global_inputs = self.call.flatten(args, kwargs, what="shard_inputs")
        dp = st.config.dp
        index = st.coordinate("dp")
        self.check_split(st, tuple(tuple(x.shape) for x in global_inputs))  # batch >= dp, cp divides lengths
        along_seq = dict(zip(map(id, global_inputs), self._sequence_inputs))
        cp, cp_index = st.config.cp, st.coordinate("cp")
        tokens = None  # this cp rank's tokens (flat indices into the dp shard's rows), for a placed layout
        if cp > 1 and self.cp_layout != "contiguous":
            names = dict(zip(map(id, global_inputs), self.call.tensor_names))
            ids = next((x for x in global_inputs if names[id(x)] == "document_ids"), None)
            if ids is None:
                raise ValueError(f"cp_layout={self.cp_layout!r} moves tokens, which is exact only when attention reads "
                                 "document ids and positions: give the model a `document_ids` input "
                                 "(hotswitch.models.PackedCausalLMLoss with document_ids_of(position_ids)), or use "
                                 "cp_layout='contiguous'")
            tokens = cp_tokens(self.cp_layout, ids.tensor_split(dp, dim=0)[index] if dp > 1 else ids, cp, cp_index)

        def split(x):
            if not isinstance(x, torch.Tensor):
                return x
            local = x.tensor_split(dp, dim=0)[index] if dp > 1 else x
            if cp > 1 and along_seq.get(id(x), False):
                if tokens is not None:
                    return local.flatten(0, 1)[tokens].view(local.shape[0], -1, *local.shape[2:])
                # torch.chunk's sizes, as the programs' Shard of the sequence (uneven lengths too)
                return local.narrow(1, *chunk_span(local.shape[1], cp, cp_index)).contiguous()  # the program views it
            return local

        local = tuple(split(x) for x in global_inputs)
        self._global_shapes[(st.config.name, tuple(tuple(x.shape) for x in local))] = tuple(
            tuple(x.shape) for x in global_inputs
        )
        return self.call.map_tensors(split, args, kwargs)

    def global_shapes(self, st: ConfigState, local_inputs) -> tuple:
        """The global batch's shapes behind this rank's `local_inputs` under `st` (learnt from the
        dp peers once per shape: a tiny all-gather, unless `shard` cut them)."""
        key = (st.config.name, tuple(tuple(x.shape) for x in local_inputs))
        if key not in self._global_shapes:
            # Inputs sharded by the caller: learn the global batch once per shape (a tiny all-gather),
            # and whether the data-parallel peers were all given the same rows.
            length = next((x.shape[1] for x, along_seq in zip(local_inputs, self._sequence_inputs) if along_seq), 0)
            mine = comm_tensor([float(local_inputs[0].shape[0]), digest(local_inputs), float(length)], torch.float64)
            gathered = [torch.zeros_like(mine) for _ in range(self.world_size)]
            dist.all_gather(gathered, mine)
            groups = st.groups("dp")
            dp_peers = next(g for g in groups if self.rank in g)
            batch = sum(int(gathered[r][0]) for r in dp_peers)
            # said by the first rank of a dp group whose ranks all got the same inputs (all ranks know which)
            alike = [g[0] for g in groups if len(g) > 1 and all(bool((gathered[r] == gathered[g[0]]).all()) for r in g)]
            if alike and min(alike) == self.rank:
                self._warn_unsharded(st, int(mine[0]))
            cp_peers = next(g for g in st.groups("cp") if self.rank in g)  # their lengths sum to the row's
            length = sum(int(gathered[r][2]) for r in cp_peers)
            self._global_shapes[key] = tuple(
                (batch, length, *x.shape[2:]) if st.config.cp > 1 and along_seq else (batch, *x.shape[1:])
                for x, along_seq in zip(local_inputs, self._sequence_inputs))
        return self._global_shapes[key]

    def _warn_unsharded(self, st: ConfigState, rows: int) -> None:
        """Every data-parallel peer got the same inputs: most likely the global batch, not this rank's
        part. Still exact (the mean over dp copies of a batch is its mean), but each rank computes the
        whole batch, and the graphs are lowered for a dp times larger one. Said once per model, by one rank."""
        if self._warned_unsharded:
            return
        self._warned_unsharded = True
        call = "**cm.shard_inputs(**batch)" if self.call.names and not self.call.names[0].startswith("args[") \
            else "*cm.shard_inputs(*batch)"
        warnings.warn(
            f"hotswitch: the {st.config.dp} data-parallel ranks of {st.config.name!r} were given the same inputs "
            f"({rows} rows each): that looks like the global batch, not each rank's part of it. Pass "
            f"cm.forward_backward({call}): shard_inputs splits the batch over the dp ranks. As given, every rank "
            f"computes all {rows} rows (a global batch of {rows * st.config.dp}, lowered again for that shape)",
            stacklevel=4)

    def check_split(self, st: ConfigState, shapes: tuple) -> None:
        """An uneven data-parallel split is exact only for a loss written as sum / count; context
        parallelism cuts the sequence into torch.chunk's pieces, or, in a layout that places tokens,
        into equal shares."""
        cp = st.config.cp
        for shape, along_seq in zip(shapes, self._sequence_inputs if cp > 1 else ()):
            if along_seq and shape[1] % cp and self.cp_layout != "contiguous":
                raise ValueError(
                    f"cp_layout={self.cp_layout!r} gives each of the cp={cp} ranks of {st.config.name!r} an equal "
                    f"share of every row, but the inputs have {shape[1]} positions: use a sequence length "
                    f"divisible by {cp} (pad the rows), or cp_layout='contiguous', which cuts any length"
                )
        batch, dp = shapes[0][0], st.config.dp
        if batch < dp:
            raise ValueError(
                f"a global batch of {batch} cannot be split over the dp={dp} ranks of {st.config.name!r}: use a "
                f"batch of at least {dp} rows (also for the example inputs), or a config with smaller dp"
            )
        if dp > 1 and batch % dp and not self._split_loss:
            raise ValueError(
                f"a global batch of {batch} does not split evenly over dp={dp}, and the model's loss is not "
                "a sum divided by a count, so an uneven split cannot be weighted exactly: use a batch "
                f"divisible by {dp}, or return loss_sum / num_tokens"
            )

    @staticmethod
    def checked_rows(st: ConfigState, program: StageProgram, uneven: str | None) -> StageProgram:
        """`program`, unless the dp ranks hold different numbers of rows (`uneven` says how) and it
        combines rows across them other than by a sum (`compiler.sharding.mixes_rows`): each rank lowered
        it for its own rows times dp, so its collectives would disagree in size (gloo aborts the
        process) or average wrongly. Every rank raises the same error, before any collective."""
        if uneven and program.mixes_rows:
            dp = st.config.dp
            more = f" (and {len(program.mixes_rows) - 1} more)" if len(program.mixes_rows) > 1 else ""
            raise ValueError(
                f"{st.config.name!r} combines rows of different data-parallel ranks other than by a sum, at "
                f"{program.mixes_rows[0]}{more}: a batch statistic, or the batch gathered. That is exact only when "
                f"the dp={dp} ranks hold equally many rows, and {uneven}. Use a batch divisible by {dp}, or a "
                "config without data parallelism")
        return program

    @staticmethod
    def uneven(st: ConfigState, shapes: tuple) -> str | None:
        batch, dp = shapes[0][0], st.config.dp
        return f"a global batch of {batch} does not split evenly" if dp > 1 and batch % dp else None


def digest(tensors) -> float:
    """A cheap fingerprint of input values, to tell whether ranks were given the same rows."""
    total = 0.0
    for x in tensors:
        flat = x.detach().reshape(-1).to(torch.float64)
        total += float((flat * (torch.arange(flat.numel(), dtype=torch.float64, device=flat.device) % 31 + 1)).sum())
    return total


CP_LAYOUTS = ("contiguous", "zigzag", "document")  # cp_layout: rank i holds the i-th chunk of every row; chunks
# i and 2cp-1-i (causal balance); or documents whole where the balance allows (DCP, `distconfig.tokens`)


def cp_tokens(layout: str, document_ids: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Flat indices (into the rows of `document_ids`, [rows, T]) of the tokens cp rank `rank` holds,
    T / cp per row's worth, in the order its shard lists them."""
    from hotswitch.distconfig.tokens import Documents, document_placement, zigzag_placement

    docs = Documents.from_ids(document_ids)
    placement = zigzag_placement(docs, cp) if layout == "zigzag" else document_placement(docs, cp, equal_tokens=True)
    tokens = [i for s in placement.segments[rank] for i in placement.flat_index(s)]
    return torch.tensor(sorted(tokens) if layout == "zigzag" else tokens)  # zigzag: row by row


def checked_cp_layout(layout: str) -> str:
    if layout not in CP_LAYOUTS:
        raise ValueError(f"unknown cp_layout {layout!r}; choose one of {', '.join(CP_LAYOUTS)}")
    return layout
