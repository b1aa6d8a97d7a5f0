"""FSDP2 float8 all-gather on 2 and 3 ranks against one device (program: fsdp_float8.py)."""

from tests.distributed.harness import launch, result

N_FLOAT8_WEIGHTS = 3  # fc1, fc2, head in fsdp_float8.Net
STEPS = 3


TWO_RANKS = launch("fsdp_float8", 2, "--scenarios", "parity,bytes")
THREE_RANKS = launch(
    "fsdp_float8", 3, "--scenarios", "parity,dcp", "--ckpt-dir", "TMP")


def _check_precompute_counts(r):
    # the first forward (no precompute yet) reduces each float8 weight's amax; after precompute
    # the forward does none, and precompute itself is one all-reduce of 3 float32 amaxes
    assert r["fp8_ag_forward_all_reduces"] == [N_FLOAT8_WEIGHTS] + [0] * (STEPS - 1)
    assert r["hp_ag_forward_all_reduces"] == [0] * STEPS
    for step in range(STEPS):
        assert r[f"precompute_step{step}"] == {
            "all_reduce": {"calls": 1, "input_bytes": 4 * N_FLOAT8_WEIGHTS,
                           "output_bytes": 4 * N_FLOAT8_WEIGHTS}
        }


def test_fsdp_float8_two_ranks_parity_and_bytes():
    # parity: bit-identical outputs and grads (asserted in the program), float8 and bf16 all-gather
    r = result(TWO_RANKS)
    assert r["world"] == 2
    _check_precompute_counts(r)
    b = r["bytes"]
    assert b["fp8_all_gather_output_bytes"] > 0 and b["bf16_all_gather_output_bytes"] > 0
    assert b["fp8_all_gather_output_bytes"] <= 0.55 * b["bf16_all_gather_output_bytes"], b
    # the float8 weights are cast from fp32 shards rather than bf16 copies: close, not equal
    assert b["sqnr_fp8_vs_bf16_all_gather_db"] > 25, b


def test_fsdp_float8_three_ranks_uneven_and_dcp():
    r = result(THREE_RANKS)
    assert r["world"] == 3
    assert r["fc1_shard_rows"] == [43, 43, 42]
    assert r["head_shard_rows"] == [2, 2, 0]  # rank 2 holds an empty shard
    _check_precompute_counts(r)
    assert r["dcp_dtypes"] == ["torch.float32"]  # weights stay in high precision
    assert "fc1.weight" in r["dcp_keys"] and "head.weight" in r["dcp_keys"]
