"""Peak-memory estimate of a graph from its liveness (pure, no process group)."""
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from hotswitch.compiler.memory import estimate_peak_bytes


def _graph(fn, *args):
    return make_fx(fn)(*args)


def test_peak_counts_values_live_at_once():
    x = torch.ones(1000)  # 4000 bytes

    def f(x):
        a = x * 2  # a live
        b = a + 1  # a and b live: 8000
        c = b * 3  # a dead (last use was b): b and c live
        return c.sum()

    assert estimate_peak_bytes(_graph(f, x)) == 8000


def test_a_view_keeps_its_base_alive_and_outputs_live_to_the_end():
    x = torch.ones(1000)

    def f(x):
        a = x * 2
        v = a.view(10, 100)  # alias: no new bytes, but a lives as long as v
        b = x + 1  # a (through v), b: 8000
        c = v * b.view(10, 100)  # a, b, c: 12000
        return c, b  # both outputs stay

    assert estimate_peak_bytes(_graph(f, x)) == 12000


def test_grows_with_sequence_length_for_attention_scores():
    def attn(q):
        return torch.softmax(q @ q.transpose(-1, -2), -1) @ q

    short = estimate_peak_bytes(_graph(attn, torch.ones(2, 64, 8)))
    long = estimate_peak_bytes(_graph(attn, torch.ones(2, 256, 8)))
    assert long > 10 * short  # the T x T scores dominate
