import pytest
import torch

from f8dist.core.numerics import sqnr
from f8dist.core.cast import cast_to_float8
from f8dist.config import CastSpec, ScalingGranularity
from f8dist.core.tensor import Float8Tensor

E4M3 = torch.float8_e4m3fn


def _tensorwise(x):
    return cast_to_float8(x, CastSpec(dtype=E4M3))


def _rowwise(x):
    return cast_to_float8(x, CastSpec(dtype=E4M3, granularity=ScalingGranularity.AXISWISE, axis=-1))


def test_looks_like_its_original_tensor():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    t = _tensorwise(x)
    assert isinstance(t, Float8Tensor)
    assert t.dtype == torch.bfloat16 and t.shape == x.shape and t._data.dtype == E4M3
    assert t._data.element_size() == 1
    assert sqnr(x, t.to_original_precision()) > 25


def test_tensorwise_views_keep_the_scale():
    t = _tensorwise(torch.randn(2, 8, 16))
    for v in (t.view(16, 16), t.reshape(16, 16), t.view(16, 16).t(), t.detach()):
        assert isinstance(v, Float8Tensor) and v._scale is t._scale
    assert torch.equal(t.view(16, 16).t().to_original_precision(),
                       t.to_original_precision().view(16, 16).t())


def test_axiswise_transpose_and_reshape_move_the_scales():
    x = torch.randn(2, 8, 16)
    t = _rowwise(x)
    assert t._scale.shape == (2, 8, 1)
    flat = t.view(16, 16)
    assert flat._scale.shape == (16, 1) and flat._block == (1, None)
    tt = flat.t()
    assert tt._scale.shape == (1, 16) and tt._block == (None, 1)
    assert torch.equal(tt.to_original_precision(), flat.to_original_precision().t())
    with pytest.raises(NotImplementedError, match="must stay last"):
        t.view(2, 128)


def test_undefined_ops_raise_instead_of_computing_garbage():
    t = _tensorwise(torch.randn(4, 16))
    with pytest.raises(NotImplementedError, match="not defined on Float8Tensor"):
        t + 1
    with pytest.raises(TypeError, match="both operands in float8"):
        torch.mm(t, torch.randn(16, 16))


def test_differentiable_cast_and_dequantize_pass_gradients_through():
    from f8dist.core.cast import ToFloat8

    x = torch.randn(4, 16, requires_grad=True)
    t = ToFloat8.apply(x, CastSpec(dtype=E4M3), None)
    assert isinstance(t, Float8Tensor)
    (t.to_original_precision() * 3).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


def test_autocast_dtype_cast_keeps_bytes_and_scale():
    # [Note: autocast] in f8dist/nn/linear.py: the float8 operands autocast casts
    t = _rowwise(torch.randn(8, 16))
    b = t.to(torch.bfloat16)
    assert isinstance(b, Float8Tensor) and b.dtype == torch.bfloat16
    assert b._data is t._data and b._scale is t._scale and b._block == t._block
    assert torch.equal(b.to_original_precision(), t.to_original_precision().bfloat16())
    for bad in (torch.float8_e5m2, torch.int32):
        with pytest.raises(NotImplementedError, match="high-precision dtype only"):
            t.to(bad)


def test_block_scaled_tensor_ops():
    """A block-scaled Float8Tensor transposes with its grid of scales and dequantizes per block;
    the layouts its ops cannot keep (a reshape of column blocks or of the last dim, a split
    inside a block, as_strided other than to a leading part) raise instead of treating the scales
    as tensorwise."""
    spec = CastSpec(dtype=E4M3, granularity=ScalingGranularity.BLOCKWISE, axis=-1,
                    block_size=(1, 32), scale_dtype=torch.float8_e8m0fnu)
    x = torch.randn(4, 64) * torch.tensor([1e-3, 1e3]).repeat_interleave(32)
    t = cast_to_float8(x, spec)
    assert t._block == (1, 32) and t._scale.shape == (4, 2) and t._scale.dtype == torch.float8_e8m0fnu
    assert sqnr(x, t.to_original_precision()) > 28
    tt = t.t()
    assert tt._block == (32, 1) and tt._scale.shape == (2, 4)
    assert torch.equal(tt.to_original_precision(), t.to_original_precision().t())
    assert "block=(1, 32) (torch.float8_e8m0fnu scales)" in repr(t)
    rows = t.as_strided((3, 64), (64, 1))  # FSDP2 dropping padding rows: the grid's rows follow
    assert rows._scale.shape == (3, 2) and torch.equal(rows.to_original_precision(),
                                                       t.to_original_precision()[:3])
    cols = t.as_strided((4, 32), (64, 1))  # a leading part of every dim: the grid's leading blocks
    assert cols._scale.shape == (4, 1) and torch.equal(cols.to_original_precision(),
                                                       t.to_original_precision()[:, :32])
    for op in (lambda: t.reshape(2, 128), lambda: tt.reshape(32, 8), lambda: torch.split(t, 16, 1),
               lambda: torch.split(tt, 16), lambda: t.as_strided((4, 32), (64, 1), 32)):
        with pytest.raises(NotImplementedError, match="block"):
            op()


def _per_expert(x: torch.Tensor) -> Float8Tensor:
    """x [E, N, K] cast tensorwise per expert (a grouped weight cast: scales [E, 1, 1])."""
    scale = torch.finfo(E4M3).max / x.abs().amax(dim=(1, 2), keepdim=True)
    return Float8Tensor((x * scale).to(E4M3), scale, x.dtype, block=(1, None, None))


@pytest.mark.parametrize("kind", ["tensorwise", "rowwise", "e8m0 blocks", "float32 blocks",
                                  "per expert"])
def test_pieces_on_the_wire_put_back_together_are_the_whole_cast(kind):
    """[Note: the wire]: the uint8 wire tensors of the pieces of a cast, put together along the
    dim (as an all-gather or cat does), view back as the whole cast: the same bytes and scales;
    a scale travels exactly when the pieces' scales differ."""
    torch.manual_seed(0)
    x = torch.randn(4, 64, 64) if kind == "per expert" else torch.randn(64, 64)
    if kind == "per expert":
        whole = _per_expert(x)
    else:
        spec = {"tensorwise": CastSpec(dtype=E4M3),
                "rowwise": CastSpec(dtype=E4M3, granularity=ScalingGranularity.AXISWISE, axis=-1),
                "e8m0 blocks": CastSpec(dtype=E4M3, granularity=ScalingGranularity.BLOCKWISE, axis=-1,
                                        block_size=(1, 32), scale_dtype=torch.float8_e8m0fnu),
                "float32 blocks": CastSpec(dtype=E4M3, granularity=ScalingGranularity.BLOCKWISE,
                                           block_size=(32, 32))}[kind]
        whole = cast_to_float8(x, spec)
    pieces = torch.chunk(whole, 2, 0)
    wires = [p.to_wire(0) for p in pieces]
    travels = kind != "tensorwise"
    assert all(len(w) == 1 + travels and all(t.dtype == torch.uint8 for t in w) for w, _ in wires)
    assert (wires[0][1].scale is None) == travels
    gathered = [torch.cat(ts) for ts in zip(*[w for w, _ in wires])]
    for out in (Float8Tensor.from_wire(wires[0][1], gathered), torch.cat(pieces)):
        assert torch.equal(out._data.view(torch.uint8), whole._data.view(torch.uint8))
        assert torch.equal(out._scale.view(torch.uint8) if out._scale.dim() else out._scale,
                           whole._scale.view(torch.uint8) if whole._scale.dim() else whole._scale)
        assert out._block == whole._block
    if kind == "per expert":  # along the reduced dims the per-expert scales are shared
        (data,), meta = whole.to_wire(1)
        assert data.shape == (4, 64, 64) and meta.scale is whole._scale


def test_grouped_gemm_is_in_the_op_table():
    # torch._grouped_mm on two Float8Tensors is the float8 grouped gemm (f8dist/core/gemm.py);
    # a 3-D weight transposes with its scales
    offsets = torch.tensor([5, 5, 12, 16], dtype=torch.int32)  # expert 1 gets no token
    x8, w8 = _rowwise(torch.randn(16, 32)), _rowwise(torch.randn(4, 16, 32))  # [M, K], [E, N, K]
    wt = w8.transpose(-2, -1)  # [E, K, N]
    assert wt._scale.shape == (4, 1, 16) and wt._block == (1, None, 1)
    assert torch.equal(wt.to_original_precision(), w8.to_original_precision().transpose(-2, -1))
    out = torch._grouped_mm(x8, wt, offs=offsets)
    ref = torch._grouped_mm(x8.to_original_precision(), wt.to_original_precision(), offs=offsets)
    assert out.dtype == torch.float32 and sqnr(ref, out) > 40
    with pytest.raises(TypeError, match="both operands in float8"):
        torch._grouped_mm(x8, wt.to_original_precision(), offs=offsets)
    with pytest.raises(NotImplementedError, match="token groups"):
        torch._grouped_mm(x8, wt)


_MX = dict(granularity=ScalingGranularity.BLOCKWISE, scale_dtype=torch.float8_e8m0fnu)


@pytest.mark.parametrize("shape, spec, block, grid", [
    ((64, 128), CastSpec(dtype=E4M3), (None, None), ()),  # tensorwise
    ((64, 128), CastSpec(dtype=E4M3, granularity=ScalingGranularity.AXISWISE, axis=-1), (1, None), (64, 1)),
    ((64, 128), CastSpec(dtype=E4M3, granularity=ScalingGranularity.AXISWISE, axis=0), (None, 1), (1, 128)),
    ((64, 128), CastSpec(dtype=E4M3, axis=-1, block_size=(1, 32), **_MX), (1, 32), (64, 4)),  # MXFP8
    ((64, 128), CastSpec(dtype=E4M3, granularity=ScalingGranularity.BLOCKWISE, block_size=(32, 32)),
     (32, 32), (2, 4)),
    ((2, 64, 128), CastSpec(dtype=E4M3, axis=0, block_size=(1, 32), **_MX), (1, 32, 1), (2, 2, 128)),  # tokens
    ((4, 64, 128), CastSpec(dtype=E4M3, grouped=True), (1, None, None), (4, 1, 1)),  # per expert
    ((4, 64, 128), CastSpec(dtype=E4M3, grouped=True, block_size=(32, 32), **_MX), (1, 32, 32), (4, 2, 4)),
])
def test_every_granularity_is_a_grid_over_one_block_shape(shape, spec, block, grid):
    """[Note: one scale layout]: each granularity's scale is a grid over a block with one entry
    per dim (None: the whole dim), and every op follows from that block: transposes swap its
    entries, pieces along a dim cut the grid where they cut the data (or leave it whole), a
    leading part keeps the leading blocks; all of them dequantize as the whole cast does."""
    torch.manual_seed(0)
    x = torch.randn(shape)
    t = cast_to_float8(x, spec)
    assert t._block == block and tuple(t._scale.shape) == grid
    whole = t.to_original_precision()
    tt = t.transpose(-2, -1)
    assert tt._block == block[:-2] + block[-2:][::-1]
    assert torch.equal(tt.to_original_precision(), whole.transpose(-2, -1))
    for dim in range(t.dim()):
        pieces = torch.chunk(t, 2, dim)
        for piece, ref in zip(pieces, torch.chunk(whole, 2, dim)):
            assert piece._block == block and torch.equal(piece.to_original_precision(), ref)
        assert torch.equal(torch.cat(pieces, dim).to_original_precision(), whole)
    lead = t.as_strided((shape[0] // 2, *shape[1:]), t.stride())  # FSDP2 dropping padding rows
    assert torch.equal(lead.to_original_precision(), whole[: shape[0] // 2])


def test_a_gathered_whole_dim_is_still_whole():
    """Per-column scales are computed over the whole (logical) dim 0 ([Note: amax] in
    f8dist/core/placement.py), so pieces along it share them: the scale stays home on the wire, and
    the pieces' wire tensors put together are the whole cast."""
    t = cast_to_float8(torch.randn(64, 32), CastSpec(dtype=E4M3, granularity=ScalingGranularity.AXISWISE,
                                                     axis=0))
    pieces = torch.chunk(t, 2, 0)
    wires = [p.to_wire(0) for p in pieces]
    assert all(len(w) == 1 and meta.scale is t._scale for w, meta in wires)
    back = Float8Tensor.from_wire(wires[0][1], [torch.cat([w[0] for w, _ in wires])])
    assert back._block == (None, 1) and torch.equal(back.to_original_precision(), t.to_original_precision())


def test_casts_expose_their_numbers_without_inner_fields():
    """What tools outside the tensor read of a cast (f8dist.core.cast's reuse check, f8dist.debug):
    its layout and its float8 values with the scale per element, whose quotient is its value."""
    spec = CastSpec(dtype=E4M3, axis=-1, block_size=(1, 32), **_MX)
    t = cast_to_float8(torch.randn(4, 64), spec)
    assert t.float8_layout == (E4M3, (1, 32), torch.float8_e8m0fnu)
    values, scale = t.float8_values()
    assert values.dtype == scale.dtype == torch.float32 and scale.shape == (4, 64)
    assert torch.equal(values / scale, t.to_original_precision())


def test_as_strided_of_a_gathered_whole_dim_takes_the_grid_that_stayed_home():
    """FSDP2 gathers experts sharded on dim 1 into a [dp * E, N / dp, K] buffer and views it as
    [E, N, K]: their per-expert scales stayed home ([Note: the wire]) and are the view's grid.
    A view that would move elements to other rows of a per-row grid raises."""
    w = _per_expert(torch.randn(2, 64, 32))
    shards = torch.chunk(w, 2, 1)  # two ranks' [2, 32, 32] shards, one [2, 1, 1] grid
    wires = [s.to_wire(1) for s in shards]
    assert all(meta.scale is w._scale for _, meta in wires)
    buffer = Float8Tensor.from_wire(wires[0][1], [torch.cat([wire[0] for wire, _ in wires])])
    view = buffer.as_strided((2, 64, 32), (2048, 32, 1))  # FSDP2's copy-out of the shards aside
    assert view._scale is w._scale and view._block == (1, None, None)
    rows = _rowwise(torch.randn(8, 64))
    with pytest.raises(NotImplementedError, match="leading part"):
        rows.as_strided((8, 32), (32, 1))


def test_nvfp4_clones_and_crosses_the_wire_under_deterministic_algorithms():
    """torch has no copy or fill kernels for float4_e2m1fn_x2, and under
    ``torch.use_deterministic_algorithms`` (torchtitan's deterministic runs) every new tensor is
    filled: a clone and the wire copy NVFP4 bytes as uint8 (``_as_bytes``)."""
    from f8dist.config.cells import E2M1

    spec = CastSpec(dtype=E2M1, granularity=ScalingGranularity.BLOCKWISE, axis=-1,
                    block_size=(1, 16), scale_dtype=E4M3)
    t = cast_to_float8(torch.randn(32, 64, generator=torch.Generator().manual_seed(0)), spec)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        copy = t.t().clone()
        wire, meta = t.t().to_wire(0)
    finally:
        torch.use_deterministic_algorithms(was)
    assert copy._data.dtype == E2M1 and torch.equal(copy.to_original_precision(),
                                                     t.to_original_precision().t())
    assert torch.equal(Float8Tensor.from_wire(meta, wire).to_original_precision(),
                       t.to_original_precision().t())


def test_nvfp4_packs_two_values_a_byte_and_its_ops_keep_the_logical_shape():
    """[Note: two-level scales]: NVFP4 data is float4_e2m1fn_x2, half a byte an element along its
    packed dim; the tensor keeps the logical shape, a transpose moves the packed dim with the
    bytes, and split, cat, reshape, as_strided and the wire act on the logical shape: each piece
    is the slice of the whole cast's values, put back together the same bytes."""
    from f8dist.config.cells import E2M1

    spec = CastSpec(dtype=E2M1, granularity=ScalingGranularity.BLOCKWISE, axis=-1,
                    block_size=(16, 16), scale_dtype=E4M3)
    t = cast_to_float8(torch.randn(32, 64, generator=torch.Generator().manual_seed(0)), spec)
    whole = t.to_original_precision()  # [32, 64]
    assert t.shape == (32, 64) and t._data.dtype == E2M1 and t._data.shape == (32, 32)
    tt = t.t()
    assert tt.shape == (64, 32) and tt._packed_dim == 0
    assert torch.equal(tt.to_original_precision(), whole.t())
    for x, ref in ((t, whole), (tt, whole.t())):
        for dim in (0, 1):
            pieces = torch.split(x, 16, dim)
            for i, p in enumerate(pieces):
                assert torch.equal(p.to_original_precision(), ref.narrow(dim, 16 * i, 16))
            assert torch.equal(torch.cat(pieces, dim)._data.view(torch.uint8),
                               x._data.view(torch.uint8))
        with pytest.raises(NotImplementedError, match="blocks"):
            torch.split(x, 8, 1)
    rows = t.as_strided((16, 64), t.stride())  # FSDP2 dropping padding rows
    assert torch.equal(rows.to_original_precision(), whole[:16])
    (data, scale), meta = t.to_wire(0)
    assert data.dtype == torch.uint8 and data.numel() == t.numel() // 2
    assert torch.equal(Float8Tensor.from_wire(meta, [data, scale]).to_original_precision(), whole)
    a = cast_to_float8(torch.randn(2, 16, 64), CastSpec(  # [B, S, K] in 1x16 blocks
        dtype=E2M1, granularity=ScalingGranularity.BLOCKWISE, axis=-1, block_size=(1, 16),
        scale_dtype=E4M3))
    assert torch.equal(a.reshape(32, 64).to_original_precision(),
                       a.to_original_precision().reshape(32, 64))
