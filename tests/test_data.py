"""Length buckets, packing and datasets (pure, no process group)."""
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hotswitch.models import document_causal_mask
from hotswitch.train import data as D


def _seqs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 50, (n,), generator=g) for n in lengths]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=60), st.integers(1, 4), st.integers(1, 5))
def test_every_sequence_lands_in_exactly_one_row_and_micro_batch(lengths, num_buckets, rows_per_mb):
    seqs = _seqs(lengths)
    bounds = D.choose_boundaries(lengths, num_buckets)
    assert len(bounds) <= num_buckets and bounds[-1] >= max(lengths)
    buckets = D.make_buckets(lengths, bounds)
    seen = sorted(i for b in buckets for i in b.sequences)
    assert seen == list(range(len(lengths)))  # nothing dropped, nothing twice
    for b in buckets:
        assert all(b.low < lengths[i] <= b.high for i in b.sequences)
        assert all(sum(lengths[i] for i in row) <= b.high for row in b.rows)
        mbs = D.micro_batches(seqs, b, rows_per_mb)
        assert all(mb.input_ids.shape == (rows_per_mb, b.high) for mb in mbs)
        assert sum(mb.sequences for mb in mbs) == len(b.sequences)
        assert sum(mb.tokens for mb in mbs) == sum(lengths[i] for i in b.sequences)
        assert sum(mb.target_tokens for mb in mbs) == sum(lengths[i] - 1 for i in b.sequences)
        assert sum(int((mb.labels != D.IGNORE).sum()) for mb in mbs) == sum(lengths[i] - 1 for i in b.sequences)


def test_packed_row_restarts_positions_and_labels_stay_inside_each_sequence():
    seqs = _seqs([5, 3, 2])
    bucket = D.make_buckets([5, 3, 2], (12,))[0]
    assert bucket.rows == ((0, 1, 2),)  # first-fit decreasing: all three fit one row of 12
    (mb,) = D.micro_batches(seqs, bucket, 2)
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 0, 0]
    assert mb.input_ids[0, :5].tolist() == seqs[0].tolist()
    expect = seqs[0][1:].tolist() + [-100] + seqs[1][1:].tolist() + [-100] + seqs[2][1:].tolist() + [-100] * 3
    assert mb.labels[0].tolist() == expect
    assert (mb.labels[1] == -100).all() and (mb.position_ids[1] == 0).all()  # the filler row adds nothing
    mask = document_causal_mask(mb.position_ids)[0, 0]
    assert mask[6, 5] and not mask[5, 4] and not mask[6, 4]  # second sequence never sees the first
    assert mask.diagonal().all()  # padding tokens attend to themselves: no all-masked row
    assert not mask[0, 1]  # causal


def test_boundaries_follow_the_token_mass_and_round_to_the_multiple():
    lengths = [10] * 90 + [1000] * 10  # 900 tokens short, 10000 long
    bounds = D.choose_boundaries(lengths, 2, multiple=16)
    assert bounds == (16, 1008)
    assert D.choose_boundaries([7, 7, 7], 3) == (16,)  # duplicates merge
    with pytest.raises(ValueError, match="longer than the last bucket bound"):
        D.make_buckets([40], (16, 32))
    with pytest.raises(ValueError, match="increasing"):
        D.make_buckets([4], (32, 16))


def test_validate_batch_names_the_bad_sequence():
    with pytest.raises(ValueError, match="sequence 1 .* 1-D integer"):
        D.validate_batch([torch.tensor([1, 2]), torch.zeros(2, 2, dtype=torch.long)])
    with pytest.raises(ValueError, match="sequence 0 of the global batch is empty"):
        D.validate_batch([torch.tensor([], dtype=torch.long)])
    with pytest.raises(ValueError, match=r"outside the model's vocabulary \[0, 10\)"):
        D.validate_batch([torch.tensor([1, 12])], vocab_size=10)
    with pytest.raises(ValueError, match="list of 1-D LongTensors"):
        D.validate_batch(torch.ones(2, 3, dtype=torch.long))


def test_synthetic_skewed_is_seeded_and_long_tailed():
    a = D.synthetic_skewed(400, 1000, 512, seed=3)
    b = D.synthetic_skewed(400, 1000, 512, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    lengths = np.array([len(x) for x in a])
    assert lengths.max() <= 512 and lengths.min() >= 8
    assert np.median(lengths) < lengths.mean() < lengths.max() / 3  # most short, a long tail
    assert all(int(x.min()) >= 1 and int(x.max()) < 1000 for x in a)


def test_load_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps([1, 2, 3]) + "\n\n" + json.dumps({"input_ids": [4, 5]}) + "\n")
    assert [x.tolist() for x in D.load_jsonl(path)] == [[1, 2, 3], [4, 5]]
    path.write_text("[1, 2]\n{oops\n")
    with pytest.raises(ValueError, match=r"d.jsonl:2: not valid JSON"):
        D.load_jsonl(path)
    path.write_text("[1, 99]\n")
    with pytest.raises(ValueError, match=r":1: token ids must lie in \[0, 50\)"):
        D.load_jsonl(path, vocab_size=50)
    with pytest.raises(ValueError, match="is not a file"):
        D.load_jsonl(tmp_path / "missing.jsonl")


def test_sample_order_is_independent_of_how_it_is_consumed():
    order = D.SampleOrder(num_samples=10, batch_size=4, seed=1)
    first_epoch = order.batch(0) + order.batch(1) + order.batch(2)[:2]
    assert sorted(first_epoch) == list(range(10))  # one epoch: every sample once
    assert order.batch(1) == D.SampleOrder(10, 4, seed=1).batch(1)  # a pure function of (seed, step)
    assert order.batch(0) != D.SampleOrder(10, 4, seed=2).batch(0)
