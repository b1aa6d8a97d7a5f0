"""Float8Tensor ops that DTensor's redistribution runs (f8dist/parallel/tp/wire.py), on one process.

The collectives themselves run in tests/distributed/tp_llama.py (counted bytes, 2 and 4 ranks).
"""

import pytest
import torch


from f8dist.core.cast import cast_to_float8
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
    assert back._block == fp8._block


def test_axiswise_pieces_along_the_scaled_over_dim_share_the_row_scales():
    # [Note: one scale layout]: per-row scales are whole along the scaled-over dim, so pieces
    # along it keep all of them, and only pieces with one shared scale cat back
    fp8 = cast_to_float8(torch.randn(4, 32), CastSpec(dtype=E4M3, granularity=ScalingGranularity.AXISWISE))
    left, right = torch.chunk(fp8, 2, dim=1)
    assert left._scale is fp8._scale and left._block == (1, None)
    assert torch.equal(torch.cat([left, right], dim=1).to_original_precision(), fp8.to_original_precision())
    other = cast_to_float8(torch.randn(4, 16) * 10, CastSpec(dtype=E4M3, granularity=ScalingGranularity.AXISWISE))
    with pytest.raises(ValueError, match="one shared scale"):
        torch.cat([left, other], dim=1)


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
    assert v._block == (None, 1) and v._scale is fp8._scale


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


@pytest.mark.parametrize("recipe", ["mxfp8", "blockwise"])
def test_token_block_companion_gathered_equals_one_device_cast(recipe):
    """[Note: two casts of one tensor]: a [B, S, K] sequence shard cast in row blocks carries its
    cast in token blocks; reassembled as the all-gather does (chunk, cat along the tokens) and
    viewed [B * S, K] as the linear does, each gemm's cast finds the bytes and scales one device
    casts from the whole high-precision tensor, and the linear keeps only the token-block copy."""
    from f8dist.core.cast import cast_with_companion, companion_for
    from f8dist.config import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    fwd, gw = config.cast_spec("output", "input"), config.cast_spec("grad_weight", "input")
    x = torch.randn(2, 256, 64) * torch.logspace(-3, 3, 64)  # [B, S, K]
    shards = [cast_with_companion(p, fwd, gw) for p in torch.chunk(x, 2, dim=1)]
    assert shards[0]._companion._scale.shape == (2, 128 // gw.block_size[1], 64)
    gathered = torch.cat(torch.chunk(torch.cat(shards, dim=0), 2, dim=0), dim=1).reshape(512, 64)
    for spec in (fwd, gw):
        ref, got = cast_to_float8(x.reshape(512, 64), spec), cast_to_float8(gathered, spec)
        assert got._block == ref._block
        assert torch.equal(_bytes(got), _bytes(ref)) and torch.equal(got._scale, ref._scale)
    assert companion_for(gathered, gw)._block == gw.block_shape(2)
    assert companion_for(gathered, fwd) is None
    assert gathered.detach()._companion is not None  # moves and views keep it
    assert gathered.t()._companion is None  # other ops drop it


def test_token_blocks_reshape_only_when_sequences_hold_whole_blocks():
    from f8dist.config import Float8LinearConfig

    gw = Float8LinearConfig.from_recipe_name("mxfp8").cast_spec("grad_weight", "input")
    fp8 = cast_to_float8(torch.randn(2, 48, 64), gw)  # 48 tokens: a block of 32 and a short one
    with pytest.raises(NotImplementedError, match="token blocks"):
        fp8.reshape(96, 64)
    x = torch.randn(1, 48, 64)  # one sequence: the [48, 64] view's blocks
    flat, ref = cast_to_float8(x, gw).reshape(48, 64), cast_to_float8(x.reshape(48, 64), gw)
    assert torch.equal(_bytes(flat), _bytes(ref)) and torch.equal(flat._scale, ref._scale)


def test_block_pieces_must_start_on_block_boundaries():
    from f8dist.config import Float8LinearConfig

    spec = Float8LinearConfig.from_recipe_name("blockwise").cast_spec("output", "weight")  # 128x128
    w = cast_to_float8(torch.randn(256, 128), spec)
    top, bottom = torch.chunk(w, 2)  # 128 rows each: whole blocks
    assert torch.equal(torch.cat([top, bottom])._scale, w._scale)
    with pytest.raises(NotImplementedError, match="split its 128-wide blocks"):
        torch.chunk(w, 4)


def test_a_slice_of_the_whole_dim_keeps_the_float8_tensor():
    # [Note: a slice of the whole dim]: DTensor's all-gather narrows 512-token sequences to 512
    fp8 = cast_to_float8(torch.randn(2, 512, 32), CastSpec(dtype=E4M3))
    whole = fp8.narrow(1, 0, 512)
    assert type(whole).__name__ == "Float8Tensor" and torch.equal(_bytes(whole), _bytes(fp8))
    with pytest.raises(NotImplementedError, match="whole dim only"):
        fp8.narrow(1, 0, 256)


@pytest.mark.parametrize("recipe", ["mxfp8", "blockwise"])
def test_linear_keeps_only_the_companion_and_gives_one_devices_weight_gradient(recipe):
    """[Note: what the matmul keeps for backward]: an input that arrives in float8 carrying the
    grad_weight gemm's cast keeps that cast only (1 byte per element, no row-block copy), and
    the weight gradient is that of the high-precision input, bit for bit."""
    import torch.nn as nn

    from f8dist import Float8Linear, Float8LinearConfig
    from f8dist.core.cast import cast_with_companion

    config = Float8LinearConfig.from_recipe_name(recipe)
    torch.manual_seed(0)
    ref = Float8Linear.from_float(nn.Linear(128, 128, bias=False), config)
    lin = Float8Linear.from_float(nn.Linear(128, 128, bias=False), config)
    lin.weight.data.copy_(ref.weight.data)
    x, grad = torch.randn(2, 128, 128), torch.randn(2, 128, 128)
    ref(x).backward(grad)
    fwd, gw = lin.specs["output", "input"], lin.specs["grad_weight", "input"]
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = lin(cast_with_companion(x, fwd, gw))
    out.backward(grad)
    float8 = [t for t in kept if type(t).__name__ == "Float8Tensor"]
    assert [t._block for t in float8] == [gw.block_shape(2)], float8
    assert float8[0]._companion is None
    assert torch.equal(lin.weight.grad, ref.weight.grad)


def test_token_blocks_regroup_across_sequence_shards():
    # DTensor gathers [1, S / tp, K] shards along dim 0 and views [tp, S / tp, K] as [1, S, K]:
    # token blocks that every sequence holds whole stay those of the [tokens, K] view
    from f8dist.config import Float8LinearConfig

    gw = Float8LinearConfig.from_recipe_name("mxfp8").cast_spec("grad_weight", "input")
    x = torch.randn(1, 128, 64)
    pieces = cast_to_float8(x.reshape(2, 64, 64), gw).reshape(1, 128, 64)
    ref = cast_to_float8(x, gw)
    assert torch.equal(_bytes(pieces), _bytes(ref)) and torch.equal(pieces._scale, ref._scale)
    with pytest.raises(NotImplementedError, match="token blocks"):  # 16-token sequences
        cast_to_float8(x.reshape(2, 64, 64), gw).reshape(8, 16, 64)


def test_a_float8_input_without_the_grad_weight_operand_raises_unless_recast_is_asked():
    """[Note: the grad_weight operand of a gathered tensor]: an input cast (for a shared input,
    with another linear's config) without the token-block cast this linear's exact config asks
    for raises, naming the fix; with sp_grad_weight="recast" the gemm re-casts it."""
    import torch.nn as nn

    from f8dist import Float8Linear, Float8LinearConfig
    from f8dist.core.cast import ToFloat8

    x = torch.randn(2, 64, 64, requires_grad=True)
    for mode in ("forward_gather", "recast"):
        config = Float8LinearConfig.from_recipe_name("mxfp8").replace(sp_grad_weight=mode)
        lin = Float8Linear.from_float(nn.Linear(64, 64, bias=False), config, fqn="wk")
        x8 = ToFloat8.apply(x, lin.specs["output", "input"], None)  # row blocks only
        if mode == "recast":
            lin(x8).sum().backward()
            assert lin.weight.grad is not None
            continue
        with pytest.raises(ValueError, match="Float8Linear wk: .*token-block cast.*one Float8LinearConfig"):
            lin(x8)
        with torch.no_grad():
            lin(x8)  # no grad_weight gemm: nothing is missing
