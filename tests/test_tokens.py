"""Token placements for context parallelism (`distconfig.tokens`): every token in exactly one place,
every key a query attends to local or fetched, document-aware work balanced within the stated
bound, and fewer key/value bytes than static zigzag on skewed packed batches. Pure, no processes."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hotswitch.distconfig.tokens import Documents, _pairs, document_placement, zigzag_placement


@st.composite
def packed_batches(draw):
    """Rows of 8..96 tokens (a multiple of 16, so zigzag cuts up to cp = 8), each holding documents
    of 1..row tokens, padded at the end."""
    row_length = 16 * draw(st.integers(1, 6))
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        room, docs = row_length, []
        while room and draw(st.booleans() if docs else st.just(True)):
            n = draw(st.integers(1, room))
            docs.append(n)
            room -= n
        rows.append(docs)
    return Documents.from_rows(rows, row_length)


def _tokens(placement, segments):
    return [i for s in segments for i in placement.flat_index(s)]


def _check_covers_and_fetches(placement):
    """Each token held once; each rank has every key its queries attend to, local or fetched, and
    fetches only tokens of other ranks."""
    docs = placement.documents
    held = sorted(i for r in range(placement.cp) for i in _tokens(placement, placement.segments[r]))
    assert held == list(range(docs.tokens))
    owner = {i: r for r in range(placement.cp) for i in _tokens(placement, placement.segments[r])}
    for r in range(placement.cp):
        available = set(_tokens(placement, placement.segments[r]))
        for s in range(placement.cp):
            fetched = _tokens(placement, placement.fetch[r][s])
            assert all(owner[i] == s for i in fetched) and (s != r or not fetched)
            available.update(fetched)
        for seg in placement.segments[r]:
            at = docs.offsets[seg.doc]
            assert set(range(at, at + seg.stop)) <= available, (r, seg)  # keys 0..last query of the document


@settings(max_examples=150, deadline=None)
@given(packed_batches(), st.sampled_from([1, 2, 3, 4, 8]), st.sampled_from([0.1, 0.25, 1.0]))
def test_document_placement_is_complete_minimal_and_balanced(docs, cp, balance):
    p = document_placement(docs, cp, balance)
    _check_covers_and_fetches(p)
    # minimal: a fetched key is attended by a query of the fetching rank (same document, not later)
    for r in range(cp):
        last_query = {}
        for seg in p.segments[r]:
            last_query[seg.doc] = max(last_query.get(seg.doc, 0), seg.stop)
        for seg in (x for row in p.fetch[r] for x in row):
            assert seg.stop <= last_query.get(seg.doc, 0)
    # the list-scheduling bound, with the zigzag chunks' rounding of split documents
    split = [d for d in range(len(docs.lengths)) if sum(s.doc == d for r in range(cp) for s in p.segments[r]) > 1]
    mean = docs.work / cp
    bound = (1 + balance) * mean + 2 * sum(docs.lengths[d] for d in split) + 1
    assert max(p.work(r) for r in range(cp)) <= bound
    # a document placed whole costs no exchange: only split documents are fetched
    assert {s.doc for r in range(cp) for row in p.fetch[r] for s in row} <= set(split)


@settings(max_examples=150, deadline=None)
@given(packed_batches(), st.sampled_from([1, 2, 4, 8]), st.sampled_from([0.1, 1.0]))
def test_equal_token_shares_for_a_compiled_shard(docs, cp, balance):
    """`equal_tokens`: every rank exactly tokens / cp (one shape for the compiled program), still
    complete, and fetching only what its queries attend to."""
    p = document_placement(docs, cp, balance, equal_tokens=True)
    _check_covers_and_fetches(p)
    assert [p.tokens(r) for r in range(cp)] == [docs.tokens // cp] * cp


@settings(max_examples=100, deadline=None)
@given(packed_batches(), st.sampled_from([1, 2, 4, 8]))
def test_zigzag_holds_chunks_i_and_mirror_and_fetches_the_causal_prefix(docs, cp):
    p = zigzag_placement(docs, cp)
    _check_covers_and_fetches(p)
    chunk = docs.row_length // (2 * cp)
    for r in range(cp):
        assert p.tokens(r) == 2 * chunk * docs.num_rows
        offsets = {i % docs.row_length // chunk for i in _tokens(p, p.segments[r])}
        assert offsets == {r, 2 * cp - 1 - r}


def test_short_documents_need_no_exchange_and_one_long_document_is_cut_zigzag():
    docs = Documents.from_rows([[8] * 8, [8] * 8])  # 16 equal documents over 4 ranks: 4 whole each
    p = document_placement(docs, 4)
    assert all(p.fetched_tokens(r) == 0 for r in range(4)) and p.imbalance == 1.0
    assert zigzag_placement(docs, 4).fetched_tokens(3) > 0  # the static layout still exchanges
    one = document_placement(Documents.from_rows([[64]]), 4)
    assert [[(s.start, s.stop) for s in one.segments[r]] for r in range(4)] == [
        [(0, 8), (56, 64)], [(8, 16), (48, 56)], [(16, 24), (40, 48)], [(24, 32), (32, 40)]]
    assert one.fetched_tokens(0) == 56 - 8  # rank 0's last query (63) sees the others' 48 earlier keys


def test_documents_from_positions_match_the_document_causal_mask():
    import torch

    from hotswitch.models import document_causal_mask, document_ids_of

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 2, 3, 4, 5, 6, 7]])
    docs = Documents.from_positions(positions)
    assert docs.lengths == (3, 2, 1, 1, 1, 8) and docs.rows_of == (0, 0, 0, 0, 0, 1)
    assert docs.work == int(document_causal_mask(positions).sum())
    assert docs.work == sum(_pairs(0, n) for n in docs.lengths)
    assert Documents.from_ids(document_ids_of(positions)) == docs  # the same documents from their ids


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="multiple of 8"):
        zigzag_placement(Documents.from_rows([[10]]), 4)
    with pytest.raises(ValueError, match="more than the row length 8"):
        Documents.from_rows([[5, 5]], 8)
    with pytest.raises(ValueError, match="restart at 0"):
        Documents.from_positions([[1, 2, 3]])
    with pytest.raises(ValueError, match="pad the rows to a multiple of 4"):
        document_placement(Documents.from_rows([[5]]), 4, equal_tokens=True)
    with pytest.raises(ValueError, match="cp must be a positive int"):
        document_placement(Documents.from_rows([[4]]), 0)


@pytest.mark.parametrize("row_length", [1024, 2048, 4096])
def test_document_placement_fetches_at_most_half_of_zigzag_on_skewed_batches(row_length):
    """The document placement's bound on the batches `hotswitch bench cp` measures, 10 seeds each. Four rows:
    at most half on every batch. One row: never more than zigzag (a row that is one document is cut
    exactly as zigzag cuts it) and at most half over the 10 batches together. The work stays within
    the default balance, 1.1 x the mean, on all of them."""
    from hotswitch.bench.cp import skewed_batch

    single = [0, 0]
    for seed in range(10):
        for rows in (1, 4):
            docs = skewed_batch(row_length, rows, seed)
            static, aware = zigzag_placement(docs, 4), document_placement(docs, 4)
            fetched = [sum(p.fetched_tokens(r) for r in range(4)) for p in (static, aware)]
            assert fetched[1] <= (0.5 if rows == 4 else 1.0) * fetched[0], (rows, seed, fetched)
            assert aware.imbalance <= 1.1, (rows, seed, aware.imbalance)
            if rows == 1:
                single = [single[0] + fetched[0], single[1] + fetched[1]]
    assert single[1] <= 0.5 * single[0], single
