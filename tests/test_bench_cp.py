"""`hotswitch bench cp` end to end on 4 gloo processes, small: every layout equal to one device,
document-aware CP fetching no more than static zigzag, the table and the chart written."""
import json

import pytest

from hotswitch.bench import cp
from hotswitch.cli import main

pytestmark = pytest.mark.slow  # spawns 4 processes


def test_bench_cp_compares_three_layouts_exactly(tmp_path, capsys):
    out, png = tmp_path / "cp.json", tmp_path / "cp.png"
    code = main(["bench", "cp", "--row-lengths", "128", "--rows", "1,2", "--dim", "32", "--heads", "4",
                 "--kv-heads", "4", "--repeats", "1", "--json", str(out), "--plot", str(png)])
    assert code == 0
    result = json.loads(out.read_text())
    assert [(b["rows"], b["row_length"]) for b in result["batches"]] == [(1, 128), (2, 128)]
    for batch in result["batches"]:
        layouts = batch["layouts"]
        assert set(layouts) == set(cp.LAYOUTS)
        assert all(m["max_error"] <= 1e-5 and m["seconds"] > 0 for m in layouts.values()), layouts
        assert layouts["document CP"]["bytes_per_rank"] <= layouts["zigzag CP"]["bytes_per_rank"]
        assert layouts["document CP"]["imbalance"] <= 1.1 + 1e-9
        # TP+SP moves the layer's input and output both ways: 4 x 3/4 of the tokens x dim x 4 bytes
        assert layouts["TP+SP"]["bytes_per_rank"] == 4 * 3 * (batch["rows"] * 128 // 4) * 32 * 4
    assert png.stat().st_size > 0
    table = capsys.readouterr().out
    assert "document CP" in table and "x zigzag" in table


def test_bench_cp_refuses_heads_that_do_not_split(capsys):
    assert main(["bench", "cp", "--heads", "6", "--kv-heads", "3"]) == 2
    assert "must both divide over 4 ranks" in capsys.readouterr().err
