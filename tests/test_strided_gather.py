"""Gathering a _StridedShard whose pieces are uneven (`compiler._dtensor.strided_runs`,
`strided_in_order`), single process: the layout is DTensor's own, and the pieces go back in order."""
import torch
from torch.distributed.tensor.placement_types import _StridedShard

from hotswitch.compiler._dtensor import strided_in_order, strided_runs


def test_runs_are_dtensors_layout():
    """Each rank's runs, read off the global tensor, are the piece DTensor's _StridedShard gives it,
    for every dim size up to 40 (uneven and empty pieces), split factor and rank count up to 5."""
    for size in range(40):
        t = torch.arange(size)
        for split_factor in range(1, 6):
            for ranks in range(1, 6):
                pieces, _ = _StridedShard(0, split_factor=split_factor)._split_tensor(t, ranks, with_padding=False)
                for r, runs in enumerate(strided_runs(size, split_factor, ranks)):
                    mine = [t[start:start + length] for start, _, length in runs]
                    assert torch.equal(torch.cat(mine) if mine else t[:0], pieces[r]), (size, split_factor, ranks, r)
                    assert [offset for _, offset, _ in runs] == [sum(x[2] for x in runs[:k]) for k in range(len(runs))]


def test_padded_pieces_gathered_in_rank_order_give_the_whole_dim():
    """What every rank's all-gather returns (each piece padded to the largest, in rank order) cut back
    into the tensor: 2 kv heads folded with a batch of 3 over 4 ranks, on a middle dim."""
    full = torch.randn(5, 6, 7)  # dim 1: [batch 3 x 2 heads], strided by the batch (split factor 3)
    for split_factor, ranks in ((3, 4), (2, 4), (1, 4), (3, 2)):
        runs = strided_runs(6, split_factor, ranks)
        pieces, _ = _StridedShard(1, split_factor=split_factor)._split_tensor(full, ranks, with_padding=False)
        widest = max(p.shape[1] for p in pieces)
        padded = [torch.nn.functional.pad(p, [0, 0, 0, widest - p.shape[1]]) for p in pieces]
        assert torch.equal(strided_in_order(torch.cat(padded, dim=1), runs, widest, 1), full)
