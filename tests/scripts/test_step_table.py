"""scripts/step_table.py's smallest config on simulated ranks: the exact bytes of one training step
per collective kind (deterministic: the model's shapes fix them), bf16 and one float8 variant per
layout, the float8 step moving no more bytes than bf16's, and the collectives that stay high
precision where docs/performance.md ("Whole step on the wire") says they do."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import step_table  # noqa: E402

# layout -> (float8 variant, {kind: (calls, buffer bytes)} of bf16, and of the float8 variant)
EXPECTED = {
    "fsdp": (("tensorwise", ("fp8-ag", "precompute", "fp8-rs")),
             {"all_gather": (5, 492672), "reduce_scatter": (3, 558336)},
             {"all_gather": (5, 279680), "all_reduce": (1, 56), "all_to_all": (3, 141784)}),
    "hsdp": (("tensorwise", ("fp8-ag", "precompute", "fp8-rs")),
             {"all_gather": (5, 492672), "reduce_scatter": (3, 558336),
              "all_reduce": (3, 279168)},
             {"all_gather": (8, 421464), "all_reduce": (1, 56), "all_to_all": (3, 141784)}),
    "tp": (("tensorwise", ()),
           {"all_gather": (11, 57344), "reduce_scatter": (10, 40960), "all_reduce": (5, 640)},
           {"all_gather": (11, 40960), "reduce_scatter": (10, 40960), "all_reduce": (41, 784)}),
    "cp": (("tensorwise", ("grad_spec",)),
           {"all_gather": (9, 509056), "reduce_scatter": (7, 574720)},
           {"all_gather": (13, 502912), "reduce_scatter": (3, 558336), "all_to_all": (8, 10240)}),
    "pp": (("tensorwise", ()),
           {"send": (2, 4096), "recv": (2, 4096)},
           {"send": (2, 2176), "recv": (2, 2176)}),
    "ep": (("rowwise", ("combine+bwd",)),
           {"all_gather": (9, 1084544), "reduce_scatter": (5, 1150208), "all_to_all": (10, 64832)},
           {"all_gather": (9, 1084544), "reduce_scatter": (5, 1150208),
            "all_to_all": (18, 34472)}),
    "3d": (("tensorwise", ("fp8-ag", "precompute", "fp8-rs")),
           {"all_gather": (16, 304256), "reduce_scatter": (13, 320768), "all_reduce": (8, 140544)},
           {"all_gather": (19, 252440), "reduce_scatter": (10, 40960), "all_reduce": (28, 784),
            "all_to_all": (3, 71064)}),
}
# (layout, kind, mesh dims, dtype): high-precision wires the float8 variant keeps, bytes as bf16's
HIGH_PRECISION = [
    ("tp", "reduce_scatter", "tp", "bfloat16"),  # row-parallel partial sums
    ("cp", "reduce_scatter", "cp", "float32"),  # FSDP2's gradients over cp
    ("3d", "reduce_scatter", "tp", "bfloat16"),
]


@pytest.fixture(scope="module")
def counts():
    args = step_table.smoke_args()
    return {layout: [step_table.measure(layout, step_table.Variant(*v), args)
                     for v in ((), variant)]
            for layout, (variant, _, _) in EXPECTED.items()}


@pytest.mark.parametrize("layout", list(EXPECTED))
def test_exact_bytes_per_collective_kind(counts, layout):
    _, bf16, float8 = EXPECTED[layout]
    got = [{kind: (calls, nbytes) for kind, (calls, nbytes, _) in c.items()}
           for c in counts[layout]]
    assert got == [bf16, float8]


@pytest.mark.parametrize("layout", list(EXPECTED))
def test_float8_step_moves_no_more_bytes_than_bf16(counts, layout):
    bf16, float8 = counts[layout]
    rows = step_table.rows_of(layout, step_table.Variant(*EXPECTED[layout][0]), float8, bf16)
    total = next(r for r in rows if r["kind"] == "total")
    assert total["bytes_vs_bf16"] < 1, total


@pytest.mark.parametrize("layout,kind,dims,dtype", HIGH_PRECISION)
def test_collectives_that_stay_high_precision(counts, layout, kind, dims, dtype):
    bf16, float8 = (c[kind][2] for c in counts[layout])
    assert float8[dims, dtype] == bf16[dims, dtype] > 0


@pytest.mark.parametrize("layout", ["hsdp", "3d"])  # 3d: under TP's DTensor parameters too
def test_hsdp_gradients_cross_dp_replicate_in_float8(counts, layout):
    bf16, float8 = counts[layout]
    assert float8["all_gather"][2]["dp_replicate", "uint8"] <= 0.55 * bf16["all_reduce"][1]
    assert ("dp_replicate", "float32") not in float8["all_reduce"][2]


def test_tp_sp_float8_operands_gather_half_of_bf16s_bytes_with_tensorwise(counts):
    bf16, float8 = counts["tp"]
    (row,) = step_table.sp_rows({"bf16": bf16, "tensorwise": float8})
    assert row["float8_vs_bf16"] == 0.5 and row["high_precision_bytes"] > 0, row


def test_tp_derive_gathers_one_float8_cast_where_token_blocks_split():
    # smoke: 8-token sequence shards split mxfp8's 32-token grad_weight blocks, so the default
    # gathers bf16; sp_grad_weight="derive" re-casts them after the gather: the 8 float8 inputs
    # and output gradients cross as e4m3 with an e8m0 byte per 32 (16384 elements, 16896 bytes)
    counts = step_table.measure("tp", step_table.Variant("mxfp8", ("derive",)),
                                step_table.smoke_args())
    assert {k: (c, b) for k, (c, b, _) in counts.items()} == {
        "all_gather": (19, 41472), "reduce_scatter": (10, 40960), "all_reduce": (5, 640)}
    assert counts["all_gather"][2] == {("tp", "uint8"): 16896, ("tp", "bfloat16"): 24576}
