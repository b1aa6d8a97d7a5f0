"""scripts/bench_reduce_scatter.py in its smoke mode: the table's rows and columns, and the byte
figures against the payload layout (never a measured SQNR beyond a sanity floor)."""

import csv
import os
import sys

import pytest

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "scripts")))

import bench_reduce_scatter  # noqa: E402


def test_bench_reduce_scatter_smoke(tmp_path, capsys):
    out = tmp_path / "rs.csv"
    rows = bench_reduce_scatter.main(["--smoke", "--blocks", "chunk", "256", "--csv", str(out)])
    printed = capsys.readouterr().out
    assert "| reduce | format | block |" in printed

    with open(out, newline="") as f:
        reader = csv.reader(f)
        assert next(reader) == bench_reduce_scatter.COLUMNS
        assert len(list(reader)) == len(rows) == 1 + 2 * 2  # bf16, then 2 formats x 2 blocks
    by = {(r["format"], r["block"]): r for r in rows}
    bf16 = by[("bf16", "-")]
    assert bf16["bytes/elem"] == 2 and bf16["vs_fp32"] == 0.5
    assert [r["note"] for r in rows].count("default") == 1
    assert by[("e4m3", "256")]["note"] == "default"
    for fmt in ("e4m3", "e5m2"):
        chunk, blocked = by[(fmt, "chunk")], by[(fmt, "256")]
        # 1 byte per element, plus 4 per scale: one per chunk, or one per 256 elements
        assert 1.0 < chunk["bytes/elem"] < blocked["bytes/elem"] < 1.0 + 4 / 256 + 1e-3
        assert blocked["vs_bf16"] == pytest.approx(blocked["bytes/elem"] / 2)
        for row in (chunk, blocked):
            assert row["sqnr_vs_fp32_db"] > 20 and row["worst_param_vs_fp32_db"] > 20
            assert 0 <= row["flushed_to_0_%"] < 1
    # the reason for e4m3: three mantissa bits beat two at every granularity
    assert by[("e4m3", "256")]["sqnr_vs_fp32_db"] > by[("e5m2", "256")]["sqnr_vs_fp32_db"] + 3
