"""Float8Tensor ops that DTensor's redistribution runs (f8dist/tp/wire.py), on one process.

The collectives themselves run in tests/distributed/tp_llama.py (counted bytes, 2 and 4 ranks).
"""

import pytest
import torch


from f8dist.cast import cast_to_float8
from f8dist.config import E4M3, CastSpec, ScalingGranularity


def _bytes(t):
    return t._data.view(torch.uint8)


@pytest.mark.parametrize("granularity", [ScalingGranularity.TENSORWISE, ScalingGranularity.AXISWISE])
def test_chunk_then_cat_along_tokens_is_identity(granularity):
    # what all_gather_single does for gather_dim=1: chunk the dim-0 gathered buffer, cat on dim 1
    x = torch.randn(4, 8, 32)  # [B, S, D]
    fp8 = cast_to_float8(x, CastSpec(dtype=E4M3, granularity=granularity))
    pieces = torch.chunk(fp8, 2, dim=1)
    assert all(type(p).__name__ == "Float8Tensor" for p in pieces)
    back = torch.cat(pieces, dim=1)
    assert torch.equal(_bytes(back), _bytes(fp8))
    assert torch.equal(back._scale.expand_as(x), fp8._scale.expand_as(x))
    assert back._axiswise_dim == fp8._axiswise_dim


def test_axiswise_cannot_split_or_cat_along_its_scaled_dim():
    fp8 = cast_to_float8(torch.randn(4, 32), CastSpec(dtype=E4M3, granularity=ScalingGranularity.AXISWISE))
    with pytest.raises(NotImplementedError, match="scaled-over dim"):
        torch.chunk(fp8, 2, dim=1)
    a = cast_to_float8(torch.randn(4, 16), CastSpec(dtype=E4M3, granularity=ScalingGranularity.AXISWISE))
    with pytest.raises(NotImplementedError, match="scaled-over dim"):
        torch.cat([a, a], dim=1)


def test_cat_of_tensorwise_pieces_needs_one_scale():
    a = cast_to_float8(torch.randn(4, 16), CastSpec(dtype=E4M3))
    b = cast_to_float8(torch.randn(4, 16) * 10, CastSpec(dtype=E4M3))
    with pytest.raises(ValueError, match="one shared scale"):
        torch.cat([a, b])


def test_same_shape_view_keeps_axiswise_scales():
    # DTensor.from_local(view_as) on a tensor scaled over dim 0 (the grad_weight gemm's operands)
    fp8 = cast_to_float8(torch.randn(8, 32), CastSpec(dtype=E4M3, granularity=ScalingGranularity.AXISWISE,
                                                      axis=0))
    v = fp8.view_as(fp8)
    assert v._axiswise_dim == 0 and v._scale is fp8._scale


@pytest.mark.parametrize("recipe", ["mxfp8", "blockwise"])
def test_row_blocks_cast_before_gather_equal_cast_after(recipe):
    """[Note: row blocks of N-D activations]: a [B, S, K] activation cast per sequence shard and
    reassembled as the all-gather does (cat along the tokens) has the bytes and block scales of
    the whole activation's cast, and its [B * S, K] view those of the 2-D cast."""
    from f8dist.config import Float8LinearConfig

    spec = Float8LinearConfig.from_recipe_name(recipe).cast_spec("output", "input")
    x = torch.randn(2, 8, 256) * torch.logspace(-3, 3, 256)  # [B, S, K], blocks of varied range
    whole = cast_to_float8(x, spec)
    assert whole._scale.shape == (2, 8, 256 // spec.block_size[1])
    shards = [cast_to_float8(piece, spec) for piece in torch.chunk(x, 2, dim=1)]
    gathered = torch.cat(shards, dim=1)  # [B, S, K]
    assert torch.equal(_bytes(gathered), _bytes(whole))
    assert torch.equal(gathered._scale.view(torch.uint8), whole._scale.view(torch.uint8))
    flat = whole.reshape(16, 256)  # what the linear's gemm takes
    ref = cast_to_float8(x.reshape(16, 256), spec)
    assert torch.equal(_bytes(flat), _bytes(ref)) and torch.equal(flat._scale, ref._scale)
    assert [p._scale.shape for p in torch.chunk(whole, 2, dim=1)] == [s._scale.shape for s in shards]


def test_block_pieces_must_start_on_block_boundaries():
    from f8dist.config import Float8LinearConfig

    spec = Float8LinearConfig.from_recipe_name("blockwise").cast_spec("output", "weight")  # 128x128
    w = cast_to_float8(torch.randn(256, 128), spec)
    top, bottom = torch.chunk(w, 2)  # 128 rows each: whole blocks
    assert torch.equal(torch.cat([top, bottom])._scale, w._scale)
    with pytest.raises(NotImplementedError, match="split its 128-wide blocks"):
        torch.chunk(w, 4)
