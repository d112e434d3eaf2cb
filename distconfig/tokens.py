"""Where each token of a packed batch lives under context parallelism (cp), and which keys and
values each rank fetches for attention: pure functions of the documents' lengths.

A packed row holds several documents; attention is causal inside a document and never crosses one
(`hotswitch.models.document_causal_mask`). Two placements over `cp` ranks:

- `zigzag_placement` is static CP with causal load balance (Megatron, torch's `context_parallel`):
  every row is cut into 2*cp equal chunks and rank i holds chunks i and 2cp-1-i. It does not see
  documents, so a rank fetches every key/value of the row that precedes one of its queries.
- `document_placement` is DCP's idea, per batch: documents stay whole where the balance allows
  (longest first, onto the least loaded rank), so most need no exchange at all; only documents too
  long for that are cut zigzag, into as few pieces as the balance needs. A rank fetches only keys
  and values of its own documents that precede its own queries.

Work is counted in attended (query, key) pairs under the document-causal mask: L(L+1)/2 for a
document of L tokens, split exactly between the ranks that hold its queries. Balance bound of
`document_placement` (the list-scheduling bound, checked by tests/test_tokens.py): the busiest rank
does at most (1 + balance) x the mean work, plus 2L pairs per cut document of L tokens (zigzag
chunks of unequal size when they do not divide L), plus one pair (a one-token document is never cut).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["CPPlacement", "Documents", "Segment", "document_fetch", "document_placement", "segments_of",
           "zigzag_placement"]


def _rows(array) -> list[list]:
    """A [rows, row_length] tensor, array or nested lists as lists."""
    return array.tolist() if hasattr(array, "tolist") else [list(r) for r in array]


def _pairs(start: int, stop: int) -> int:
    """Attended pairs of the queries at positions start..stop-1 of a causal document."""
    return (stop * (stop + 1) - start * (start + 1)) // 2


@dataclass(frozen=True, order=True)
class Segment:
    """Tokens `start:stop` (positions inside the document) of document `doc`."""

    doc: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def work(self) -> int:
        """Attended pairs of this segment's queries."""
        return _pairs(self.start, self.stop)


@dataclass(frozen=True)
class Documents:
    """The documents of a packed batch of `rows` x `row_length` tokens, in batch order: document d
    has `lengths[d]` tokens, lies in row `rows_of[d]` and starts at flat token `offsets[d]`
    (row-major). Padding tokens are documents of one token, as the document-causal mask sees them."""

    row_length: int
    lengths: tuple[int, ...]
    rows_of: tuple[int, ...]
    offsets: tuple[int, ...]

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[int]], row_length: int | None = None) -> Documents:
        """From each row's document lengths; a row shorter than `row_length` is padded."""
        sums = [sum(r) for r in rows]
        row_length = max(sums, default=0) if row_length is None else row_length
        if not rows or row_length <= 0:
            raise ValueError("a packed batch needs at least one row of at least one token")
        lengths, rows_of, offsets = [], [], []
        for i, row in enumerate(rows):
            if any(n <= 0 for n in row):
                raise ValueError(f"row {i} has a document of {min(row)} tokens; lengths must be positive")
            if sums[i] > row_length:
                raise ValueError(f"row {i} holds {sums[i]} tokens, more than the row length {row_length}")
            at = i * row_length
            for n in [*row, *[1] * (row_length - sums[i])]:
                lengths.append(n)
                rows_of.append(i)
                offsets.append(at)
                at += n
        return cls(row_length, tuple(lengths), tuple(rows_of), tuple(offsets))

    @classmethod
    def from_positions(cls, position_ids) -> Documents:
        """From a [rows, row_length] array of positions that restart at 0 at every document (the
        Trainer's packed rows; a tensor, an array or nested lists)."""
        rows = _rows(position_ids)
        for i, row in enumerate(rows):
            if row and row[0] != 0:
                raise ValueError(f"row {i} starts at position {row[0]}; positions restart at 0 per document")
        return cls._from_starts(rows, lambda row, t: row[t] == 0)

    @classmethod
    def from_ids(cls, document_ids) -> Documents:
        """From a [rows, row_length] array of document ids (`models.document_ids_of`): a document is
        a run of one id."""
        return cls._from_starts(_rows(document_ids), lambda row, t: t == 0 or row[t] != row[t - 1])

    @classmethod
    def _from_starts(cls, rows: list[list], starts_at) -> Documents:
        lengths = []
        for row in rows:
            starts = [t for t in range(len(row)) if starts_at(row, t)]
            lengths.append([b - a for a, b in zip(starts, [*starts[1:], len(row)])])
        return cls.from_rows(lengths, len(rows[0]) if rows else 0)

    def positions(self) -> list[list[int]]:
        """[rows][row_length] position of every token inside its document (what `from_positions` reads)."""
        rows = [[] for _ in range(self.num_rows)]
        for row, n in zip(self.rows_of, self.lengths):
            rows[row].extend(range(n))
        return rows

    @property
    def num_rows(self) -> int:
        return max(self.rows_of) + 1

    @property
    def tokens(self) -> int:
        return self.num_rows * self.row_length

    @property
    def work(self) -> int:
        return sum(_pairs(0, n) for n in self.lengths)


@dataclass(frozen=True)
class CPPlacement:
    """Tokens and key/value fetches of a packed batch over `cp` ranks.

    `segments[r]` are the tokens rank r holds, in the order of its local sequence; `fetch[r][s]` are
    the key/value segments rank r receives from rank s (empty for s == r)."""

    kind: str
    cp: int
    documents: Documents
    segments: tuple[tuple[Segment, ...], ...]
    fetch: tuple[tuple[tuple[Segment, ...], ...], ...]

    def tokens(self, rank: int) -> int:
        return sum(len(s) for s in self.segments[rank])

    def work(self, rank: int) -> int:
        """Attended (query, key) pairs rank `rank` computes."""
        return sum(s.work for s in self.segments[rank])

    def fetched_tokens(self, rank: int) -> int:
        """Key/value tokens rank `rank` receives (the forward; the backward returns as many gradients)."""
        return sum(len(s) for row in self.fetch[rank] for s in row)

    @property
    def imbalance(self) -> float:
        """The busiest rank's work over the mean."""
        works = [self.work(r) for r in range(self.cp)]
        return max(works) * self.cp / max(1, sum(works))

    def flat_index(self, segment: Segment) -> range:
        """The segment's tokens as flat indices into the [rows x row_length] batch."""
        at = self.documents.offsets[segment.doc]
        return range(at + segment.start, at + segment.stop)


def segments_of(documents: Sequence[int], positions: Sequence[int]) -> tuple[Segment, ...]:
    """A rank's tokens (document id and position each, in its local order) as segments: runs of
    one document at consecutive positions."""
    out: list[Segment] = []
    for doc, pos in zip(documents, positions):
        if out and out[-1].doc == doc and out[-1].stop == pos:
            out[-1] = Segment(doc, out[-1].start, pos + 1)
        else:
            out.append(Segment(doc, pos, pos + 1))
    return tuple(out)


def _zigzag_cuts(length: int, cp: int) -> list[tuple[int, int]]:
    """Rank i's chunks i and 2cp-1-i of `length` tokens cut into 2cp near-equal chunks."""
    bounds = [length * j // (2 * cp) for j in range(2 * cp + 1)]
    return [(bounds[i], bounds[i + 1], bounds[2 * cp - 1 - i], bounds[2 * cp - i]) for i in range(cp)]


def _check_cp(cp: int) -> None:
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be a positive int, got {cp!r}")


def zigzag_placement(documents: Documents, cp: int) -> CPPlacement:
    """Static causal-balanced CP: each row in 2*cp chunks, rank i holds chunks i and 2cp-1-i; a rank
    fetches the row's keys/values before its last query in that row (documents unseen)."""
    _check_cp(cp)
    if documents.row_length % (2 * cp):
        raise ValueError(f"rows of {documents.row_length} tokens cannot be cut into 2*cp = {2 * cp} equal chunks; "
                         f"pad rows to a multiple of {2 * cp} tokens")
    per_rank: list[list[Segment]] = [[] for _ in range(cp)]
    row_end = [[0] * documents.num_rows for _ in range(cp)]  # rank -> row -> last held row offset + 1
    for r, (a, b, c, d) in enumerate(_zigzag_cuts(documents.row_length, cp)):
        for lo, hi in ((a, b), (c, d)):
            for doc, (row, at, n) in enumerate(zip(documents.rows_of, documents.offsets, documents.lengths)):
                start, stop = max(lo, at - row * documents.row_length), min(hi, at - row * documents.row_length + n)
                if start < stop:
                    begin = row * documents.row_length
                    per_rank[r].append(Segment(doc, start - (at - begin), stop - (at - begin)))
                    row_end[r][row] = max(row_end[r][row], stop)
    segments = tuple(tuple(sorted(s)) for s in per_rank)

    def needed(r: int, seg: Segment) -> Segment | None:
        row = documents.rows_of[seg.doc]
        limit = row_end[r][row] - (documents.offsets[seg.doc] - row * documents.row_length)
        return Segment(seg.doc, seg.start, min(seg.stop, limit)) if seg.start < limit else None

    return CPPlacement("zigzag", cp, documents, segments, _fetches(segments, needed))


def document_placement(documents: Documents, cp: int, balance: float = 0.1, equal_tokens: bool = False
                       ) -> CPPlacement:
    """DCP-style placement: as few documents cut as keep the busiest rank within (1 + `balance`) x
    the mean work. Documents are placed longest first onto the rank with the least work (then fewest
    tokens); a document above a threshold is cut zigzag into just enough pieces to stay under it, over
    all ranks at most. Thresholds are tried from "cut nothing" down to `balance` x a rank's share,
    where the list-scheduling bound holds (module docstring). A rank fetches only the keys/values its
    own queries attend to.

    `equal_tokens`: every rank holds exactly tokens / cp (a compiled program's shard has one shape):
    documents go only where they fit whole, and a rank left over its share hands the tail of its
    last segments to the ranks with room (cutting a document there). The balance bound is then not
    guaranteed, only sought."""
    _check_cp(cp)
    if not balance > 0:
        raise ValueError(f"balance must be positive, got {balance!r}")
    capacity = None
    if equal_tokens:
        if documents.tokens % cp:
            raise ValueError(f"{documents.tokens} tokens do not split into {cp} equal shares; pad the rows to a "
                             f"multiple of {cp} tokens")
        capacity = documents.tokens // cp
    share = documents.work / cp
    for threshold in (*(t for t in _CUT_THRESHOLDS if t > balance), balance):
        per_rank = _place_pieces(documents, cp, threshold * share, capacity)
        works = [sum(s.work for s in segs) for segs in per_rank]
        if max(works) <= (1 + balance) * share or threshold == balance:
            break
    segments = tuple(tuple(sorted(s)) for s in per_rank)
    return CPPlacement("document", cp, documents, segments, document_fetch(segments))


def document_fetch(segments: Sequence[Sequence[Segment]]) -> tuple[tuple[tuple[Segment, ...], ...], ...]:
    """fetch[r][s] when every rank fetches only what its own queries attend to: of each other rank's
    segments, the part of a document rank r holds queries of, up to r's last query in it. Holds for
    any layout of the tokens (the runtime uses it for whatever order shard_inputs chose)."""
    query_end = [{} for _ in segments]  # rank -> doc -> last query position + 1
    for r, segs in enumerate(segments):
        for s in segs:
            query_end[r][s.doc] = max(query_end[r].get(s.doc, 0), s.stop)

    def needed(r: int, seg: Segment) -> Segment | None:
        limit = query_end[r].get(seg.doc, 0)
        return Segment(seg.doc, seg.start, min(seg.stop, limit)) if seg.start < limit else None

    return _fetches(segments, needed)


# Cut thresholds tried, in shares of a rank's work, before `balance` itself: from "cut nothing" down,
# so the first placement within the balance cuts as few documents into as few pieces as it can
_CUT_THRESHOLDS = (math.inf, *(2 ** (-e / 2) for e in range(-2, 12)))


def _place_pieces(documents: Documents, cp: int, cut_above: float, capacity: int | None = None
                  ) -> list[list[Segment]]:
    """Documents with more than `cut_above` pairs cut into k = ceil(work / cut_above) zigzag pieces
    (k = cp: one piece per rank, placed first); then every whole document and piece, largest first,
    onto the least loaded rank (pieces of one document may meet on a rank: less to fetch)."""
    per_rank: list[list[Segment]] = [[] for _ in range(cp)]
    load = [[0, 0] for _ in range(cp)]  # work, tokens
    items = []  # (work, tokens, doc, [(start, stop), ...])
    for doc, n in enumerate(documents.lengths):
        work = _pairs(0, n)
        k = 1 if work <= cut_above else min(cp, n, math.ceil(work / cut_above))
        pieces = [[(lo, hi) for lo, hi in ((a, b), (c, d)) if lo < hi] for a, b, c, d in _zigzag_cuts(n, k)]
        for r, piece in enumerate(pieces):
            if k == cp > 1:  # spread over every rank
                for lo, hi in piece:
                    per_rank[r].append(Segment(doc, lo, hi))
                    load[r][0] += _pairs(lo, hi)
                    load[r][1] += hi - lo
            else:
                items.append((sum(_pairs(lo, hi) for lo, hi in piece), sum(hi - lo for lo, hi in piece), doc, piece))
    items.sort(key=lambda it: (-it[0], it[2], it[3]))
    if capacity is None:
        heap = [(w, t, r) for r, (w, t) in enumerate(load)]
        heapq.heapify(heap)
        for work, tokens, doc, piece in items:
            w, t, r = heapq.heappop(heap)
            per_rank[r].extend(Segment(doc, lo, hi) for lo, hi in piece)
            heapq.heappush(heap, (w + work, t + tokens, r))
        return per_rank
    for work, tokens, doc, piece in items:  # least work among the ranks it fits, else the emptiest
        fits = [r for r in range(cp) if load[r][1] + tokens <= capacity]
        r = min(fits, key=lambda r: (load[r][0], load[r][1], r)) if fits else min(range(cp), key=lambda r: load[r][1])
        per_rank[r].extend(Segment(doc, lo, hi) for lo, hi in piece)
        load[r][0] += work
        load[r][1] += tokens
    return _fit(per_rank, capacity)


def _fit(per_rank: list[list[Segment]], capacity: int) -> list[list[Segment]]:
    """Move the tail tokens of ranks over `capacity` to ranks under it, cutting segments."""
    held = [sum(len(s) for s in segs) for segs in per_rank]
    for r in range(len(per_rank)):
        while held[r] > capacity:
            seg = per_rank[r].pop()
            dest = min(range(len(per_rank)), key=lambda d: (held[d], d))
            move = min(len(seg), held[r] - capacity, capacity - held[dest])
            if move < len(seg):
                per_rank[r].append(Segment(seg.doc, seg.start, seg.stop - move))
            per_rank[dest].append(Segment(seg.doc, seg.stop - move, seg.stop))
            held[r] -= move
            held[dest] += move
    return per_rank


def _fetches(segments, needed) -> tuple[tuple[tuple[Segment, ...], ...], ...]:
    """fetch[r][s]: the parts of rank s's segments that rank r needs (`needed(r, segment)`)."""
    cp = len(segments)
    return tuple(
        tuple(() if s == r else tuple(p for p in (needed(r, seg) for seg in segments[s]) if p is not None)
              for s in range(cp))
        for r in range(cp)
    )
