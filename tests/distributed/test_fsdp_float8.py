"""FSDP2 float8 all-gather on 2 gloo ranks against one device (program: fsdp_float8.py): the
torchrun smoke of FSDP2 and its float8 all-gather; 3 ranks (uneven, DCP) run simulated in
tests/sim/parallel/fsdp/test_float8.py."""

from tests.distributed.harness import launch, result
from tests.sim.parallel.fsdp.test_float8 import check_precompute_counts

TWO_RANKS = launch("fsdp_float8", 2, "--scenarios", "parity,bytes")


def test_fsdp_float8_two_ranks_parity_and_bytes():
    # parity: bit-identical outputs and grads (asserted in the program), float8 and bf16 all-gather
    r = result(TWO_RANKS)
    assert r["world"] == 2
    check_precompute_counts(r)
    b = r["bytes"]
    assert b["fp8_all_gather_output_bytes"] > 0 and b["bf16_all_gather_output_bytes"] > 0
    assert b["fp8_all_gather_output_bytes"] <= 0.55 * b["bf16_all_gather_output_bytes"], b
    # the float8 weights are cast from fp32 shards rather than bf16 copies: close, not equal
    assert b["sqnr_fp8_vs_bf16_all_gather_db"] > 25, b
