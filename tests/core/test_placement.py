"""The block rule of f8dist/core/placement.py ([Note: shards on block boundaries]) on its own."""

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from f8dist.core.placement import blocks_split_by_shards


def test_whole_blocks_per_shard():
    # 128x128 weight blocks of a [512, 256] weight: 4 ranks on rows (128 each), 2 on columns
    assert blocks_split_by_shards([512, 256], (128, 128), [4], [Shard(0)]) is None
    assert blocks_split_by_shards([512, 256], (128, 128), [2], [Shard(1)]) is None
    assert blocks_split_by_shards([512, 256], (128, 128), [2], [Replicate()]) is None
    why = blocks_split_by_shards([512, 256], (128, 128), [8], [Shard(0)])
    assert why == "8 ranks shard dim 0 of this [512, 256] tensor into 64 per rank, which splits its 128-wide blocks"


def test_row_blocks_of_an_activation():
    # [B, S, K] in 1x32 blocks ([Note: row blocks of N-D activations]): the tokens may be cut
    # anywhere, K only on block boundaries
    assert blocks_split_by_shards([2, 6, 64], (1, 32), [3], [Shard(1)]) is None
    assert blocks_split_by_shards([2, 6, 64], (1, 32), [2], [Shard(-1)]) is None
    assert "splits its 32-wide blocks" in blocks_split_by_shards([2, 6, 64], (1, 32), [4], [Shard(2)])


def test_token_blocks_of_an_activation():
    # [B, S, K] in the grad_weight gemm's 128-token blocks ([Note: token blocks of N-D
    # activations]): blocks of its [B * S, K] view, so every sequence and every sequence shard
    # must hold whole blocks; one sequence may end in a short block
    assert blocks_split_by_shards([2, 256, 64], (128, 1), [2], [Shard(1)]) is None
    assert blocks_split_by_shards([1, 200, 64], (128, 1), [], []) is None
    assert blocks_split_by_shards([2, 256, 64], (128, 1), [2], [Shard(-1)]) is None  # K: any cut
    why = blocks_split_by_shards([2, 16, 64], (128, 1), [2], [Shard(1)])
    assert why == "its 2 sequences of 16 tokens split the 128-token blocks of its [32, 64] view"
    why = blocks_split_by_shards([1, 256, 64], (128, 1), [4], [Shard(1)])
    assert why == "4 ranks shard dim 1 of this [1, 256, 64] tensor into 64 per rank, which splits its 128-wide blocks"


def test_a_dim_sharded_by_tp_then_fsdp():
    # 2-D FSDP x TP on a colwise weight: TP's Shard(0) over tp, FSDP2's _StridedShard(0) over dp
    placements = [_StridedShard(0, split_factor=2), Shard(0)]  # mesh (dp, tp)
    assert blocks_split_by_shards([256, 64], (32, 32), [2, 2], placements) is None  # 128, then 64
    why = blocks_split_by_shards([256, 64], (128, 128), [2, 2], placements)
    assert why == "2x2 ranks shard dim 0 of this [256, 64] tensor into 64 per rank, which splits its 128-wide blocks"
