"""Expert parallelism against one device on 2 gloo ranks, the torchrun smoke of expert
parallelism and its float8 all-to-all; the checks run inside tests/distributed/moe_ep.py (dynamic
and block recipes), the figures are re-checked here. 4 ranks and delayed experts run simulated:
tests/sim/parallel/ep/test_moe_ep.py."""

import pytest

from tests.distributed.harness import launch, result

DIM = 256  # of the tokens whose dispatch bytes are counted


TWO_RANKS = launch("moe_ep", 2, "--case", "blockwise_128=blockwise:128:128")


@pytest.fixture(scope="module")
def two_ranks():
    """The default recipes and DeepSeek's 1 x 128 blocks (dim 128) in one launch of 2 ranks."""
    return result(TWO_RANKS)


def test_expert_parallel_matches_one_device_bit_for_bit_with_float8_dispatch(two_ranks):
    r = two_ranks
    assert r["world"] == 2 and r["empty_groups_on_a_rank"] and r["experts_without_tokens"] > 0
    b = r["dispatch_bytes"]
    assert b["bf16"] == 64 * DIM * 2
    assert b["float8"] == 64 * (DIM + 4)  # 1 byte per element + a float32 scale per token
    assert b["float8"] / b["bf16"] <= 0.53
    # 1 byte per element + a scale per token's block: 1 x 32 e8m0, 1 x 128 float32
    assert b["mxfp8"] == b["blockwise"] == 64 * (DIM + DIM // 32)


def test_expert_parallel_with_128_blocks_matches_one_device_bit_for_bit(two_ranks):
    """DeepSeek's 1 x 128 token blocks dispatched in float8 ([Note: float8 dispatch])."""
    assert two_ranks["world"] == 2 and two_ranks["blockwise_128"]["empty_groups_on_a_rank"], two_ranks
