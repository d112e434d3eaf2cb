"""Mixed-length data: length buckets, packed micro-batches that keep sequence boundaries, datasets.

A global batch is a list of 1-D token-id tensors of different lengths. Buckets are length ranges
(boundaries from the batch's own length distribution unless the user gives them); each bucket's
sequences are packed first-fit-decreasing into rows as long as the bucket's upper bound. Inside a
row, positions restart at every sequence and the label of a sequence's last token is -100, so the
attention mask derived from the positions (`models.document_causal_mask`) keeps every sequence to
itself and the loss counts exactly the next-token targets of each sequence. Rows are grouped into
micro-batches of a fixed shape per (bucket, config) so each ExecGraph is compiled once; the last
micro-batch is filled with empty rows (every label -100), which add nothing to the loss or the
gradients. No sequence is dropped or truncated. (HotSPa's released code attends across packed
boundaries, averages bucket losses without token weights and drops up to dp-1 rows per bucket;
none of that here.)
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

IGNORE = -100


@dataclass(frozen=True)
class Bucket:
    """Sequences with `low < length <= high`, packed into rows of `high` tokens.

    `rows` holds, per row, the indices (into the global batch) of the sequences packed in it.
    """

    index: int
    low: int
    high: int
    rows: tuple[tuple[int, ...], ...]

    @property
    def sequences(self) -> tuple[int, ...]:
        return tuple(i for row in self.rows for i in row)


@dataclass(frozen=True)
class MicroBatch:
    """One compiled-shape micro-batch: [rows, length] input ids, positions and labels."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    sequences: int
    tokens: int  # real (non-padding) tokens
    target_tokens: int  # labels that count in the loss

    @property
    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.input_ids, self.position_ids, self.labels


def validate_batch(global_batch, vocab_size: int | None = None) -> list[torch.Tensor]:
    """The global batch as a list of 1-D int64 tensors, or a ValueError naming the bad entry."""
    if isinstance(global_batch, torch.Tensor) or not hasattr(global_batch, "__len__"):
        raise ValueError("a global batch is a list of 1-D LongTensors of token ids (of different lengths), "
                         f"got {type(global_batch).__name__}")
    if len(global_batch) == 0:
        raise ValueError("the global batch is empty: give at least one sequence")
    out = []
    for i, seq in enumerate(global_batch):
        if not isinstance(seq, torch.Tensor) or seq.dim() != 1 or seq.is_floating_point() or seq.is_complex():
            shape = tuple(seq.shape) if isinstance(seq, torch.Tensor) else type(seq).__name__
            raise ValueError(f"sequence {i} of the global batch must be a 1-D integer tensor of token ids, got {shape}")
        if seq.numel() == 0:
            raise ValueError(f"sequence {i} of the global batch is empty; remove it")
        if vocab_size is not None and (int(seq.min()) < 0 or int(seq.max()) >= vocab_size):
            raise ValueError(f"sequence {i} has token ids in [{int(seq.min())}, {int(seq.max())}], outside the "
                             f"model's vocabulary [0, {vocab_size})")
        out.append(seq.to(torch.long))
    return out


def batch_digest(sequences: list[torch.Tensor]) -> tuple[int, int]:
    """A 128-bit digest of a global batch (order, lengths and token ids) as two int64s, equal on
    every process that holds the same batch: the Trainer compares it across ranks before any
    collective whose sizes depend on the batch."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray([s.numel() for s in sequences], dtype=np.int64).tobytes())
    for s in sequences:
        h.update(s.detach().to(torch.int64).contiguous().numpy().tobytes())
    digest = h.digest()
    return (int.from_bytes(digest[:8], "little", signed=True), int.from_bytes(digest[8:], "little", signed=True))


def choose_boundaries(lengths, num_buckets: int, multiple: int = 16) -> tuple[int, ...]:
    """Upper bounds of up to `num_buckets` length buckets from the length distribution.

    Candidates are powers of two (HotSPa's 2K/4K/8K... buckets), since a packed row of bound L
    costs attention work in L^2 whatever it holds: a bound far above its sequences wastes compute.
    Empty candidates are dropped; while there are too many, the two adjacent buckets whose union
    holds the fewest tokens merge. Bounds are rounded up to `multiple` (so sequence-parallel
    degrees divide them, and nearby batches reuse the same compiled shapes); the last bound is
    the longest sequence, rounded up.
    """
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be at least 1, got {num_buckets}")
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        raise ValueError("no lengths to choose bucket boundaries from")
    longest = round_up(int(lengths.max()), multiple)
    candidates = sorted({round_up(1 << k, multiple) for k in range(int(lengths.max()).bit_length() + 1)} | {longest})
    bounds = [b for b in candidates if b <= longest]
    tokens = np.bincount(np.searchsorted(bounds, lengths), weights=lengths, minlength=len(bounds))
    kept = [(b, t) for b, t in zip(bounds, tokens) if t > 0]
    while len(kept) > num_buckets:
        k = min(range(len(kept) - 1), key=lambda i: kept[i][1] + kept[i + 1][1])
        kept[k: k + 2] = [(kept[k + 1][0], kept[k][1] + kept[k + 1][1])]
    return tuple(int(b) for b, _ in kept)


def round_up(n: int, multiple: int) -> int:
    return max(multiple, math.ceil(n / multiple) * multiple)


def make_buckets(lengths, boundaries) -> list[Bucket]:
    """Assign every sequence to the first bucket whose bound holds it and pack each bucket's rows.

    Buckets that receive no sequence are left out. A sequence longer than the last bound is an
    error (the caller extends the boundaries first).
    """
    boundaries = tuple(int(b) for b in boundaries)
    if list(boundaries) != sorted(set(boundaries)) or boundaries[0] < 1:
        raise ValueError(f"bucket boundaries must be increasing positive lengths, got {boundaries}")
    lengths = [int(n) for n in lengths]
    longest = max(lengths)
    if longest > boundaries[-1]:
        raise ValueError(f"a sequence of {longest} tokens is longer than the last bucket bound {boundaries[-1]}; "
                         "add a larger bound")
    members: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        members.setdefault(int(np.searchsorted(boundaries, n)), []).append(i)
    buckets = []
    for b in sorted(members):
        low = boundaries[b - 1] if b else 0
        buckets.append(
            Bucket(b, low, boundaries[b], pack_rows([lengths[i] for i in members[b]], members[b], boundaries[b]))
        )
    return buckets


def pack_rows(lengths: list[int], indices: list[int], capacity: int) -> tuple[tuple[int, ...], ...]:
    """First-fit decreasing: longest first, each into the first row with room (ties by index, so
    every rank packs identically)."""
    order = sorted(range(len(lengths)), key=lambda k: (-lengths[k], indices[k]))
    rows: list[list[int]] = []
    room: list[int] = []
    for k in order:
        n = lengths[k]
        if n > capacity:
            raise ValueError(f"sequence {indices[k]} has {n} tokens, more than the row capacity {capacity}")
        for r, free in enumerate(room):
            if free >= n:
                rows[r].append(indices[k])
                room[r] -= n
                break
        else:
            rows.append([indices[k]])
            room.append(capacity - n)
    return tuple(tuple(r) for r in rows)


def micro_batches(sequences: list[torch.Tensor], bucket: Bucket, rows_per_micro_batch: int,
                  pad_id: int = 0) -> list[MicroBatch]:
    """The bucket's rows as micro-batches of exactly `rows_per_micro_batch` rows of `bucket.high` tokens."""
    if rows_per_micro_batch < 1:
        raise ValueError(f"rows_per_micro_batch must be at least 1, got {rows_per_micro_batch}")
    out = []
    length = bucket.high
    for start in range(0, len(bucket.rows), rows_per_micro_batch):
        rows = bucket.rows[start: start + rows_per_micro_batch]
        ids = torch.full((rows_per_micro_batch, length), pad_id, dtype=torch.long)
        pos = torch.zeros((rows_per_micro_batch, length), dtype=torch.long)  # padding: one-token "sequences"
        labels = torch.full((rows_per_micro_batch, length), IGNORE, dtype=torch.long)
        tokens = targets = count = 0
        for r, row in enumerate(rows):
            offset = 0
            for i in row:
                seq = sequences[i]
                n = seq.numel()
                ids[r, offset: offset + n] = seq
                pos[r, offset: offset + n] = torch.arange(n)
                labels[r, offset: offset + n - 1] = seq[1:]
                offset += n
                tokens += n
                targets += n - 1
                count += 1
        out.append(MicroBatch(ids, pos, labels, count, tokens, targets))
    return out


def rows_per_micro_batch(dp: int, length: int, micro_batch_tokens: int) -> int:
    """Rows of one micro-batch of `length`-token rows: `micro_batch_tokens` per data-parallel
    replica, at least one row each, so every replica gets the same number of rows."""
    return dp * max(1, micro_batch_tokens // length)


def target_tokens(lengths) -> int:
    """Next-token targets of a batch of sequences of these lengths: the loss's denominator."""
    return sum(max(int(n) - 1, 0) for n in lengths)


def weighted_micro_batches(sequences: list[torch.Tensor], bucket: Bucket, rows: int,
                           total_targets: int) -> list[tuple[MicroBatch, float]]:
    """The bucket's micro-batches that have targets, each with its weight in the step: its target
    tokens / the whole batch's. Each micro-batch's loss is its own mean over its targets, so
    `sum(weight * loss)` (and the same sum of gradients) is the batch's mean token loss whatever
    the buckets, rows, filler rows and micro-batch counts are."""
    return [(mb, mb.target_tokens / total_targets) for mb in micro_batches(sequences, bucket, rows)
            if mb.target_tokens > 0]  # only one-token sequences: nothing to predict, nothing to add


def full_length_micro_batch(rows: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A micro-batch (input ids, positions, labels) of `rows` full-length sequences (every token but
    the last is a target): what the Trainer traces with and profiles each config at each length."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 8, (rows, length), generator=g)
    pos = torch.arange(length).repeat(rows, 1)
    labels = torch.cat([ids[:, 1:], torch.full((rows, 1), IGNORE)], dim=1)
    return ids, pos, labels


# ------------------------------------------------------------------------------------- datasets
def synthetic_skewed(num_sequences: int, vocab_size: int, max_length: int, seed: int = 0,
                     median_length: int | None = None, min_length: int = 8) -> list[torch.Tensor]:
    """Seeded sequences with long-tailed (log-normal, sigma 1) lengths, as in chat/code corpora:
    most are short (median `max_length / 16` by default), a few reach `max_length`. Token ids are
    uniform in [1, vocab_size) (0 is padding)."""
    if not 2 <= min_length <= max_length:
        raise ValueError(f"need 2 <= min_length <= max_length, got min_length={min_length}, max_length={max_length}")
    rng = np.random.default_rng(seed)
    median = median_length or max(min_length, max_length // 16)
    lengths = np.clip(rng.lognormal(np.log(median), 1.0, size=num_sequences), min_length, max_length).astype(np.int64)
    return [torch.from_numpy(rng.integers(1, vocab_size, size=int(n))).to(torch.long) for n in lengths]


def load_jsonl(path: str | Path, vocab_size: int | None = None) -> list[torch.Tensor]:
    """Token-id sequences from a JSONL file: one per line, a list of ints or {"input_ids": [...]}."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"dataset {str(path)!r} is not a file; give a JSONL file of token ids or 'synthetic-skewed'")
    out = []
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
            ids = row.get("input_ids") if isinstance(row, dict) else row
            if (
                not isinstance(ids, list)
                or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
            ):
                raise ValueError(f"{path}:{line_no}: expected a non-empty list of token ids or "
                                 '{"input_ids": [...]}')
            if vocab_size is not None and not all(0 <= t < vocab_size for t in ids):
                raise ValueError(f"{path}:{line_no}: token ids must lie in [0, {vocab_size}) for this model")
            out.append(torch.tensor(ids, dtype=torch.long))
    if not out:
        raise ValueError(f"{path} holds no sequences")
    return out


@dataclass(frozen=True)
class SampleOrder:
    """A seeded global sample order cut into global batches (Tenplex's dataset state).

    Epoch e visits the samples in `permutation(seed, e)`; global batch k is the next
    `batch_size` samples. The order depends only on (seed, position), never on how many ranks
    consume it, so a change of data-parallel degree neither skips nor repeats a sample.
    """

    num_samples: int
    batch_size: int
    seed: int = 0

    def __post_init__(self):
        if self.num_samples < 1 or not 1 <= self.batch_size:
            raise ValueError(f"need num_samples >= 1 and batch_size >= 1, got {self.num_samples}, {self.batch_size}")

    def batch(self, step: int) -> list[int]:
        """Sample indices of global batch `step` (0-based); batches run across epoch ends."""
        start = step * self.batch_size
        out = []
        for position in range(start, start + self.batch_size):
            epoch, offset = divmod(position, self.num_samples)
            out.append(int(_permutation(self.num_samples, self.seed, epoch)[offset]))
        return out


@functools.lru_cache(maxsize=4)
def _permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_samples)
