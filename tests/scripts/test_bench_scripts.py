"""Smoke runs of the benchmark scripts: the output format (table columns, CSV rows, parsable
ratios), never the timing. Each run is ``--smoke``: one tiny shape, one repetition."""

import csv
import importlib
import importlib.util
import math
import os
import sys

import pytest
import torch

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "..", "scripts")
sys.path.insert(0, os.path.abspath(SCRIPTS))

import bench_linear  # noqa: E402
import bench_matmul  # noqa: E402
from tests.distributed.harness import launch, result as launched  # noqa: E402
from tests.floors import NVFP4_FLOOR, NVFP4_GRAD_FLOOR  # noqa: E402

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


def _read_csv(path):
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        return header, [dict(zip(header, row)) for row in reader]


def _table_header(printed: str):
    """Column names of the first markdown table in the printed output."""
    for line in printed.splitlines():
        if line.startswith("| "):
            return [c.strip() for c in line.strip("|").split("|")]
    raise AssertionError(f"no table printed:\n{printed}")


def _positive(value: str) -> float:
    x = float(value)
    assert math.isfinite(x) and x > 0, value
    return x


def test_bench_matmul_smoke(tmp_path, capsys):
    out = tmp_path / "matmul.csv"
    bench_matmul.main(["--smoke", "--device", "cpu", "--csv", str(out)])
    printed = capsys.readouterr().out

    assert _table_header(printed) == bench_matmul.COLUMNS
    assert "device: CPU" in printed
    header, rows = _read_csv(out)
    assert header == bench_matmul.COLUMNS
    assert len(rows) == 1  # one smoke shape
    row = rows[0]
    # blockwise and mxfp8: f8dist's CPU block kernel
    kinds = ("tensorwise", "rowwise", "blockwise", "mxfp8")
    if torch.__version__ < "2.13":  # the CPU's _scaled_mm has no per-row scales before 2.13
        assert row["rowwise_tflops"] == row["rowwise_vs_bf16"] == "-"
        kinds = ("tensorwise", "blockwise", "mxfp8")
    for kind in kinds:
        ratio = _positive(row[f"{kind}_vs_bf16"])
        # the ratio is the two printed throughputs divided (to the printed precision)
        expected = float(row[f"{kind}_tflops"]) / float(row["bf16_tflops"])
        assert ratio == pytest.approx(expected, rel=1e-2)


def test_bench_linear_smoke(tmp_path, capsys):
    out = tmp_path / "linear.csv"
    bench_linear.main(["--smoke", "--device", "cpu", "--recipes", "tensorwise", "--csv", str(out)])
    printed = capsys.readouterr().out

    assert _table_header(printed) == bench_linear.COLUMNS
    header, rows = _read_csv(out)
    assert header == bench_linear.COLUMNS
    # one row per (mode, recipe) of the one smoke shape
    assert [(r["mode"], r["recipe"]) for r in rows] == [
        ("eager", "tensorwise"), ("compile", "tensorwise")
    ]
    for row in rows:
        _positive(row["bf16_ms"])
        speedup = _positive(row["f8dist_speedup"])
        assert speedup == pytest.approx(
            float(row["bf16_ms"]) / float(row["f8dist_ms"]), rel=1e-2
        )
        if HAS_TORCHAO:
            _positive(row["torchao_ms"])
            _positive(row["f8dist_vs_torchao"])
        else:
            assert row["torchao_ms"] == row["f8dist_vs_torchao"] == "-"
            assert "torchao not installed" in printed


def test_bench_linear_axiswise_recipes_no_torchao(tmp_path):
    # eager only: compiling every recipe would cost CI more than the format check is worth
    bench_linear.main(["--smoke", "--device", "cpu", "--recipes", "rowwise", "rowwise_with_gw_hp",
                       "--modes", "eager", "--no-torchao", "--csv", str(tmp_path / "l.csv")])
    _, rows = _read_csv(tmp_path / "l.csv")
    assert [r["recipe"] for r in rows] == ["rowwise", "rowwise_with_gw_hp"]
    for row in rows:
        assert row["torchao_ms"] == row["torchao_speedup"] == row["f8dist_vs_torchao"] == "-"
        _positive(row["f8dist_speedup"])


def test_bad_repeats_is_a_clear_error():
    with pytest.raises(SystemExit, match="--repeats must be >= 1"):
        bench_matmul.main(["--repeats", "0"])


@pytest.mark.parametrize("script", ["bench_matmul", "bench_linear", "bench_bytes", "memory_report"])
def test_cuda_device_without_cuda_ends_in_one_line_before_any_work(script, monkeypatch, capsys):
    # it ended in torch's "Torch not compiled with CUDA enabled" traceback from the first tensor
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also where a GPU is
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--device", "cuda"])
    module = importlib.import_module(script)
    with pytest.raises(SystemExit) as e:
        module.main()
    assert str(e.value).startswith(f"{script}.py: --device cuda needs CUDA and torch "), e.value
    assert str(e.value).endswith("; run with --device cpu") and "\n" not in str(e.value)
    assert capsys.readouterr().out == ""  # nothing ran


# in the 2-rank launch of the selected modules' programs ([Note: one launch, several programs])
COMM_SMOKE = launch("bench_comm_smoke", 2, "--smoke", "--scenarios", "fsdp mlp", "tp llama", "tp ffn",
                    "--csv", "TMP")


def test_bench_comm_smoke(tmp_path):
    import bench_comm

    result = launched(COMM_SMOKE)
    out = tmp_path / "comm.csv"
    out.write_text(result["csv"])  # what the program wrote, read back before its folder went
    header, rows = _read_csv(out)
    assert header == bench_comm.COLUMNS
    assert len(rows) == len(result["rows"])
    by = {(r["scenario"], r["variant"], r["kind"]): r for r in rows}

    for scenario in ("fsdp mlp", "tp llama"):
        assert float(by[(scenario, "bf16", "all_gather")]["bytes_vs_bf16"]) == 1.0
        assert int(by[(scenario, "bf16", "all_gather")]["step_calls"]) > 0
    # counted bytes, not timing: float8 TP+SP all-gathers its linears' inputs in float8
    assert float(by[("tp llama", "float8", "all_gather")]["bytes_vs_bf16"]) < 1.0
    # float8 without float8 all-gather moves the same weight bytes as bf16
    assert float(by[("fsdp mlp", "float8", "all_gather")]["bytes_vs_bf16"]) == 1.0
    fp8_ag = [r for r in rows if r["scenario"] == "fsdp mlp" and "fp8-ag" in r["variant"]]
    assert fp8_ag, "the float8 all-gather variants must be listed (measured or pending)"
    if bench_comm.HAS_FSDP_FLOAT8:
        ratio = float(by[("fsdp mlp", "float8+fp8-ag", "all_gather")]["bytes_vs_bf16"])
        assert ratio <= 0.51
        # float8 reduce-scatter: a uint8 all-to-all of ~1/4 of the fp32 gradient bytes replaces it
        assert ("fsdp mlp", bench_comm.FP8_RS, "reduce_scatter") not in by
        rs = by[("fsdp mlp", bench_comm.FP8_RS, "all_to_all")]
        assert rs["note"] == bench_comm.RS_NOTE and float(rs["bytes_vs_bf16"]) <= 0.26
    else:
        assert all(r["note"].startswith("pending") for r in fp8_ag)
    # block scales under TP+SP: every all-gather (the ffn's are all a float8 linear's activations
    # or gradients) moves two float8 casts, row blocks and the grad_weight gemm's token blocks,
    # each 1 byte per element plus an e8m0 byte per 32, and no amax all-reduce
    mx, bf16 = (int(by[("tp ffn", v, "all_gather")]["step_bytes"]) for v in ("mxfp8", "bf16"))
    assert mx == bf16 * (1 + 1 / 32), (mx, bf16)
    # the llama model's 8-token sequence shards split 32-token blocks: high precision, as bf16
    mx, bf16 = (int(by[("tp llama", v, "all_gather")]["step_bytes"]) for v in ("mxfp8", "bf16"))
    assert mx == bf16, (mx, bf16)
    assert ("tp ffn", "mxfp8", "all_reduce") not in by and ("tp ffn", "float8", "all_reduce") in by
    # 128x128 weight blocks do not fit the smoke model's 32-row shards: a row says so
    assert by[("tp ffn", "blockwise", "-")]["note"] == bench_comm.SPLIT


def test_sqnr_table_prints_every_recipe_above_the_floors(capsys, monkeypatch):
    import sqnr_table

    monkeypatch.setattr(sys, "argv", ["sqnr_table.py", "--batch", "1", "--seq", "32",
                                      "--in-features", "128", "--out-features", "128"])
    sqnr_table.main()
    rows = [line.strip("|").split("|") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and not line.startswith("| recipe")]
    assert {r[0].strip() for r in rows} == set(sqnr_table.RECIPES)
    for recipe, dtype, *sqnrs in rows:
        assert all(float(v) > 20 for v in sqnrs), (recipe, dtype, sqnrs)


def test_nvfp4_rounding_prints_every_variant_on_every_data(capsys, monkeypatch):
    import nvfp4_rounding

    monkeypatch.setattr(sys, "argv", ["nvfp4_rounding.py", "--tokens", "32", "--features", "32",
                                      "--draws", "2"])
    nvfp4_rounding.main()
    rows = [line.rsplit(None, 4) for line in capsys.readouterr().out.splitlines()[1:]]
    assert len(rows) == 3 * len(nvfp4_rounding.VARIANTS)
    for label, *sqnrs in rows:
        (config,) = [c for v, c in nvfp4_rounding.VARIANTS.items() if label.endswith(v)]
        gw, gw_mean = map(float, sqnrs[2:])
        if config.cast_config_grad_output.stochastic_rounding:
            assert gw_mean > gw, label  # two draws' errors average down
        else:
            assert gw_mean == gw, label  # round to nearest: every pass the same


def test_nvfp4_sqnr_table_against_mxfp8_tensorwise_and_torchao(capsys, monkeypatch):
    # docs/numerics.md (NVFP4): a gemm's two e2m1 casts add their noise, so a gemm's SQNR is
    # below one cast's; f8dist's cast is torchao's, bit for bit
    import nvfp4_sqnr_table

    monkeypatch.setattr(sys, "argv", ["nvfp4_sqnr_table.py", "--tokens", "64",
                                      "--in-features", "128", "--out-features", "64"])
    nvfp4_sqnr_table.main()
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and "recipe" not in line and "dB" not in line]
    gemms = {(r[0], r[1]): [float(v) for v in r[2:]] for r in rows if len(r) == 5}
    casts = {r[0]: (float(r[1]), r[2]) for r in rows if len(r) == 3}
    for recipe in ("nvfp4", "nvfp4_no_rht"):  # floors: tests/floors.py
        output, *grads = gemms["gaussian", recipe]
        assert output > NVFP4_FLOOR and min(grads) > NVFP4_GRAD_FLOOR, (recipe, gemms)
        # outliers at this size: a few of them carry the gradient gemms, whose SQNR one
        # stochastic draw decides (docs/numerics.md: 3 to 16 dB), so only the output has a floor
        assert gemms["outliers", recipe][0] > NVFP4_FLOOR, (recipe, gemms)
    for kind in ("gaussian", "outliers"):
        for recipe, floor in (("mxfp8", 25), ("tensorwise", 20)):
            assert min(gemms[kind, recipe]) > floor, (kind, recipe, gemms)
        assert min(gemms[kind, "torchao NVFP4 (emulated, 1x16 weight blocks)"]) > 15
        assert casts[kind][1] == "identical"
    assert max(gemms["gaussian", "nvfp4"]) < casts["gaussian"][0]
