"""Float8Tensor ops that DTensor's redistribution runs (f8dist/tp/wire.py), on one process.

The collectives themselves run in tests/distributed/tp_llama.py (counted bytes, 2 and 4 ranks).
"""

import pytest
import torch


from f8dist.cast import cast_to_float8
from f8dist.config import E4M3, CastSpec, ScalingGranularity


def _bytes(t):
    return t._data.view(torch.uint8)


# block-scaled Float8Tensors take no split or cat: tensor parallel with block scales raises
# (tests/tp/test_style.py, tests/test_tensor.py)
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
