"""`hotswitch bench switch`'s tables from a result (pure: no processes)."""
from hotswitch.bench.switch import format_table, summarize


def _row(a, b, method, ms, **extra):
    return {"from": a, "to": b, "method": method, "measured_seconds": ms / 1e3, **extra}


RESULT = {
    "model": "gpt2-23m", "parameters": 22.4e6, "world_size": 4, "devices_per_node": 2, "repeats": 5,
    "network": "loopback",
    "rows": [
        _row("tp4", "dp4", "greedy", 100.0, bytes_moved=2e8, inter_node_bytes=1e8, max_send_bytes=5e7,
             lower_bound_bytes=2e8, estimated_seconds=1e-3),
        _row("tp4", "dp4", "gather", 200.0),
        _row("tp4", "dp4", "greedy+grads", 300.0, overlapped_seconds=0.0, compute_seconds=0.9),
        _row("tp4", "dp4", "greedy+grads prefetched", 120.0, overlapped_seconds=0.15, compute_seconds=1.0),
        _row("dp4", "tp4", "greedy", 20.0),
        _row("dp4", "tp4", "gather", 20.0),
        _row("dp4", "tp4", "greedy+grads", 50.0, overlapped_seconds=0.0, compute_seconds=0.6),
        _row("dp4", "tp4", "greedy+grads prefetched", 40.0, overlapped_seconds=0.02, compute_seconds=0.6),
    ],
}


def test_switches_behind_compute_are_compared_with_plain_ones_not_with_weights_only_switches():
    summary = summarize(RESULT)
    assert set(summary) == {"greedy", "gather"}  # the step's switches are a comparison of their own
    assert abs(summary["gather"]["greedy_over_method_total"] - 120.0 / 220.0) < 1e-12
    table = format_table(RESULT)
    # exposed prefetched / plain per pair: 120/300 = 0.4 and 40/50 = 0.8, median 0.6
    assert "over 2 pairs: exposed with the weights prefetched and the gradients handed off / plain 0.60 " \
           "(median); 170.0 ms moved behind compute in all, against 350.0 ms of plain switches" in table
    assert table.splitlines()[5].split()[-2:] == ["120.00", "150.00"]  # exposed, and moved behind compute
