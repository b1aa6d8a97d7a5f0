import pytest
import torch

from f8dist.core.scaling import (
    MAX_SCALE,
    amax_to_scale,
    dequantize,
    fp8_max,
    in_memory,
    round_scale_down_to_power_of_2,
    saturated_cast,
    tensor_amax,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_fp8_max():
    assert fp8_max(E4M3) == 448.0 and fp8_max(E5M2) == 57344.0
    with pytest.raises(ValueError, match="float8"):
        fp8_max(torch.bfloat16)


def test_amax_tensorwise_and_axiswise():
    x = torch.tensor([[1.0, -3.0], [0.5, 2.0]])
    assert tensor_amax(x).item() == 3.0
    assert tensor_amax(x, -1).tolist() == [[3.0], [2.0]]
    assert tensor_amax(x, 0).tolist() == [[1.0, 3.0]]
    assert tensor_amax(x.bfloat16()).dtype == torch.float32


def test_zero_amax_gives_finite_scale_and_zero_cast():
    scale = amax_to_scale(torch.tensor(0.0), E4M3)
    assert torch.isfinite(scale) and scale.item() == MAX_SCALE
    data = saturated_cast(torch.zeros(4), scale, E4M3)
    assert torch.equal(data.float(), torch.zeros(4))
    for pow2 in (False, True):
        s = amax_to_scale(torch.zeros(3, 1), E5M2, round_to_power_of_2=pow2)
        assert torch.isfinite(s).all()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_saturation_clamps_to_format_max(dtype):
    limit = fp8_max(dtype)
    x = torch.tensor([limit * 4, -limit * 4, 1.0])
    data = saturated_cast(x, torch.tensor(1.0), dtype)
    assert data.float().tolist() == [limit, -limit, 1.0]


def test_power_of_2_rounding_rounds_down_exactly():
    s = torch.tensor([1.0, 3.0, 448.0, 0.7, 1e30, float("inf")])
    r = round_scale_down_to_power_of_2(s)
    assert r.tolist()[:5] == [1.0, 2.0, 256.0, 0.5, 2.0 ** 99]
    assert r[5] == float("inf")
    assert torch.isnan(round_scale_down_to_power_of_2(torch.tensor([float("nan")]))).all()
    scale = amax_to_scale(torch.tensor([[3.0], [5.0]]), E4M3, round_to_power_of_2=True)
    log2 = torch.log2(scale)
    assert torch.equal(log2, log2.round()) and (scale <= 448.0 / torch.tensor([[3.0], [5.0]])).all()


def test_nonfinite_amax_never_gives_a_finite_cast():
    x = torch.tensor([1.0, float("inf")])
    scale = amax_to_scale(tensor_amax(x), E4M3)
    assert scale.item() == 0.0
    data = saturated_cast(x, scale, E4M3)
    assert torch.isnan(data[1].float())  # inf * 0
    assert torch.isnan(dequantize(data, scale, torch.float32)).all()  # 0 / 0 and nan / 0
    y = torch.tensor([1.0, float("nan")])
    assert torch.isnan(amax_to_scale(tensor_amax(y), E4M3))


def test_roundtrip_sqnr():
    from f8dist.core.numerics import sqnr

    torch.manual_seed(0)
    x = torch.randn(256, 64)
    scale = amax_to_scale(tensor_amax(x), E4M3)
    assert sqnr(x, dequantize(saturated_cast(x, scale, E4M3), scale, torch.float32)) > 25


def test_compiled_scales_equal_eager():
    torch.manual_seed(0)
    x = torch.randn(32, 48) * 7

    def scales(x):
        return (
            amax_to_scale(tensor_amax(x), E4M3),
            amax_to_scale(tensor_amax(x, -1), E4M3, round_to_power_of_2=True),
            amax_to_scale(tensor_amax(x, 0), E5M2, round_to_power_of_2=True),
        )

    compiled = torch.compile(scales, fullgraph=True)
    for e, c in zip(scales(x), compiled(x)):
        assert torch.equal(e, c)


def test_in_memory_is_the_tensor_itself():
    """[Note: a cast that waits for its amax]: a view with the tensor's own size, strides and
    offset (the same storage), on the CPU; anything else comes back as it is."""
    base = torch.randn(6, 8)
    for x in (base, base.t(), base[2:, 1:5], torch.empty(0, 8)):
        v = in_memory(x)
        assert v is not x and v._base is not None
        assert (v.shape, v.stride(), v.storage_offset(), v.data_ptr()) == (
            x.shape, x.stride(), x.storage_offset(), x.data_ptr())
        assert torch.equal(v, x)
    p = torch.nn.Parameter(base)
    assert in_memory(p) is p
    meta = base.to("meta")  # off the CPU: inductor decides (the Note)
    assert in_memory(meta) is meta


def test_empty_tensor_has_amax_zero():
    # a rank's empty shard of an unevenly sharded weight
    assert tensor_amax(torch.empty(0, 16)).item() == 0.0
    # an empty batch, scaled per column over its (zero) tokens, or per (no) row
    assert torch.equal(tensor_amax(torch.empty(0, 16), 0), torch.zeros(1, 16))
    assert tensor_amax(torch.empty(0, 16), -1).shape == (0, 1)


TINY = [1e-20, 1e-30, 2.0 ** -126]  # 2**-126: the smallest normal float32


def _roundtrip(x, dtype, pow2):
    scale = amax_to_scale(tensor_amax(x), dtype, round_to_power_of_2=pow2)
    return dequantize(saturated_cast(x, scale, dtype), scale, torch.float32)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_tiny_magnitudes_keep_their_precision(dtype, pow2):
    # [Note: tiny magnitudes]: any normal float32 amax gets a usable, finite scale: the cast of a
    # tiny tensor is as accurate as that of a unit one
    from f8dist.core.numerics import sqnr

    torch.manual_seed(0)
    x = torch.randn(256, 64)
    floor = sqnr(x, _roundtrip(x, dtype, pow2)) - 1.0
    for amax in TINY:
        tiny = x * (amax / x.abs().max())
        scale = amax_to_scale(tensor_amax(tiny), dtype, round_to_power_of_2=pow2)
        assert torch.isfinite(scale) and scale.reciprocal() >= 2.0 ** -126  # a normal float32
        assert sqnr(tiny, _roundtrip(tiny, dtype, pow2)) > floor, amax
    for amax in (1e-40, 1e-45, 0.0):  # float32 subnormals and zero: the cap, finite
        scale = amax_to_scale(torch.tensor(amax), dtype, round_to_power_of_2=pow2)
        assert scale.item() == MAX_SCALE


def test_tiny_magnitudes_compiled():
    from f8dist.core.numerics import sqnr

    torch.manual_seed(0)
    x = torch.randn(32, 48) * 1e-30
    compiled = torch.compile(_roundtrip, fullgraph=True)
    assert sqnr(x, compiled(x, E4M3, True)) > 25
    assert torch.equal(compiled(x, E4M3, True), _roundtrip(x, E4M3, True))


# -- block scales ([Note: block scales], [Note: e8m0 rounding] in f8dist/config/cells.py) -------------

from f8dist.core.scaling import block_amax, block_scale, expand_blocks  # noqa: E402

E8M0 = torch.float8_e8m0fnu


def test_block_amax_zero_pads_partial_blocks():
    x = torch.arange(1.0, 5 * 40 + 1).reshape(5, 40)
    amax = block_amax(-x, (2, 32))  # [3, 2]: rows 0-1, 2-3, 4; cols 0-31, 32-39
    assert torch.equal(amax, torch.tensor([[72.0, 80], [152, 160], [192, 200]]))
    assert block_amax(torch.randn(0, 64), (1, 32)).shape == (0, 2)
    assert torch.equal(block_amax(torch.zeros(3, 0), (1, 32)), torch.zeros(3, 0))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_e8m0_rounding_rceil_never_saturates_floor_is_ocp(dtype):
    fmax, emax = fp8_max(dtype), {E4M3: 8, E5M2: 15}[dtype]
    amax = torch.tensor([fmax, fmax * 1.01, 1.0, 0.75, 500.0, 3e-30])
    rceil = block_scale(amax, dtype, scale_dtype=E8M0, rounding="rceil").float()
    floor = block_scale(amax, dtype, scale_dtype=E8M0, rounding="floor").float()
    # RCEIL: the largest power of 2 with amax * scale <= fmax; FLOOR: 2**(emax - floor(log2 amax))
    assert torch.all(amax * rceil <= fmax) and torch.all(amax * rceil * 2 > fmax)
    assert torch.equal(floor, 2.0 ** (emax - torch.floor(torch.log2(amax))))
    for s in (rceil, floor):
        assert torch.equal(torch.log2(s), torch.log2(s).round())


def test_block_scale_edge_cases():
    amax = torch.tensor([0.0, float("inf"), float("nan"), 1e-40, 3e38])
    e8 = block_scale(amax, E4M3, scale_dtype=E8M0)
    assert e8.dtype == torch.float32  # values e8m0 holds exactly
    assert torch.allclose(e8.to(E8M0).float(), e8, rtol=0, atol=0, equal_nan=True)
    assert e8[0] == 2.0 ** 127 and torch.isnan(e8[1:3]).all()  # zeros finite, inf/NaN NaN
    assert torch.isfinite(e8[3:]).all() and (e8[3:] > 0).all()
    f32 = block_scale(amax, E4M3)
    assert f32[0] == MAX_SCALE and torch.equal(f32[4:], 448.0 / amax[4:])


def test_block_cast_roundtrip_and_expand():
    torch.manual_seed(0)
    x = torch.randn(64, 96) * torch.logspace(-4, 4, 96)  # a range no tensorwise scale covers
    for block, sdtype in [((1, 32), E8M0), ((32, 32), E8M0), ((1, 128), torch.float32)]:
        scale = block_scale(block_amax(x, block), E4M3, scale_dtype=sdtype)
        per_element = expand_blocks(scale, block, x.shape)  # [64, 96]
        assert per_element.shape == x.shape
        y = dequantize(saturated_cast(x, per_element, E4M3), per_element, torch.float32)
        assert sqnr_db(x, y) > 28


def sqnr_db(a, b):
    from f8dist.core.numerics import sqnr
    return sqnr(a, b)


def test_block_casts_match_torchao_mx_bit_for_bit():
    """f8dist's MXFP8 cast against torchao 0.18's emulated ``to_mx`` on the same tensor: the same
    e4m3 bytes and the same power-of-2 scales (torchao keeps the dequantizing exponent, f8dist the
    quantizing scale), in both rounding modes."""
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    torch.manual_seed(0)
    x = torch.randn(64, 256) * torch.logspace(-3, 3, 256)
    for rounding in ("rceil", "floor"):
        exp, data = mx.to_mx(x, E4M3, 32, ScaleCalculationMode(rounding))
        scale = block_scale(block_amax(x, (1, 32)), E4M3, scale_dtype=E8M0, rounding=rounding)
        ours = saturated_cast(x, expand_blocks(scale, (1, 32), x.shape), E4M3)
        assert torch.equal(ours.view(torch.uint8), data.view(torch.uint8))
        assert torch.equal(1.0 / scale.float(), exp.float().reshape(64, 8))


def test_group_amax_per_column_of_each_token_group():
    from f8dist.core.scaling import group_amax, group_ids
    x = torch.randn(10, 3)
    offsets = torch.tensor([4, 4, 9], dtype=torch.int32)  # group 1 empty, row 9 in none
    assert group_ids(offsets, 10).tolist() == [0] * 4 + [2] * 5 + [3]
    amax = group_amax(x, offsets)
    assert amax.shape == (3, 3) and amax.dtype == torch.float32
    assert torch.equal(amax[0], x[:4].abs().amax(0)) and torch.equal(amax[1], torch.zeros(3))
    assert torch.equal(amax[2], x[4:9].abs().amax(0))


def test_round_to_e2m1_is_round_to_nearest_even():
    from f8dist.core.scaling import round_to_e2m1

    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.9, 0.3, -2.6, -0.0, 6.0])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.5, -3.0, -0.0, 6.0]
    assert round_to_e2m1(x).tolist() == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_cast_is_torchaos_to_the_bit(dtype):
    # [Note: NVFP4]: the two-level scale math of torchao's nvfp4_quantize, its bytes and scales
    nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    from f8dist.core.scaling import nvfp4_cast, nvfp4_dequantize

    torch.manual_seed(0)
    x = (torch.randn(32, 64) * torch.logspace(-3, 3, 64)).to(dtype)  # blocks of every magnitude
    amax = tensor_amax(x)
    data, block_scale, tensor_scale = nvfp4_cast(x, (1, 16), amax)
    ref_tensor_scale = nvfp4.per_tensor_amax_to_scale(amax)
    ref_scale, ref_data = nvfp4.nvfp4_quantize(x, 16, ref_tensor_scale)
    assert torch.equal(tensor_scale, ref_tensor_scale)
    assert torch.equal(block_scale.view(torch.uint8), ref_scale.view(torch.uint8).view(32, 4))
    # packed two a byte in torchao's nibble order ([Note: packed e2m1])
    assert data.dtype == torch.float4_e2m1fn_x2 and data.shape == (32, 32)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8).view(32, 32))
    ref = nvfp4.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=ref_tensor_scale).dequantize(dtype)
    assert torch.equal(nvfp4_dequantize(data, block_scale, (1, 16), tensor_scale, dtype), ref)


def test_nvfp4_cast_of_zeros_and_square_blocks():
    from f8dist.core.scaling import nvfp4_cast, nvfp4_dequantize

    data, _, tensor_scale = nvfp4_cast(torch.zeros(16, 32), (16, 16), torch.zeros(()))
    assert torch.equal(data.view(torch.uint8), torch.zeros(16, 16, dtype=torch.uint8))
    assert tensor_scale > 0
    x = torch.randn(32, 48)
    data, scale, ts = nvfp4_cast(x, (16, 16), tensor_amax(x))
    assert scale.shape == (2, 3) and scale.dtype == torch.float8_e4m3fn
    from f8dist.core.numerics import sqnr
    assert sqnr(x, nvfp4_dequantize(data, scale, (16, 16), ts, torch.float32)) > 15


def test_stochastic_round_to_e2m1_is_unbiased_and_picks_a_neighbour():
    # [Note: stochastic rounding]: the mean of n independent roundings is the value, within 5
    # standard deviations of that mean (each rounding's is at most half the spacing)
    from f8dist.core.scaling import counter_uniform, round_to_e2m1, stochastic_round_to_e2m1

    v = torch.cat([torch.linspace(-6, 6, 97), torch.tensor([0.1, 0.3, 2.2, 3.9, 4.5, -5.1])])
    mag = v.abs()
    spacing = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    n = 400
    positions = torch.arange(n * v.numel()).view(n, -1)  # [n, V]: n independent draws each
    out = stochastic_round_to_e2m1(v.expand(n, -1), counter_uniform(positions, key=7))  # [n, V]
    assert torch.equal(round_to_e2m1(out), out)  # e2m1 values
    assert ((out - v).abs() < spacing).all()  # one of the two neighbours
    assert ((out.mean(0) - v).abs() <= 5 * spacing / 2 / n**0.5).all()
    assert (out.std(0)[(v / spacing) % 1 != 0] > 0).all()  # not to nearest: both neighbours


def test_counter_uniform_is_splitmix64_of_the_position():
    # [Note: stochastic rounding]: SplitMix64's outputs (the reference in Python's integers),
    # so a draw depends on (key, position) alone
    from f8dist.core.scaling import counter_uniform

    def splitmix64(state):
        z = state % 2**64
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2**64
        return z ^ (z >> 31)

    positions = torch.tensor([0, 1, 2, 1000, 2**40 + 3])
    for key in [0, 12345, 2**64 - 1]:
        want = [(splitmix64(key + (p + 1) * 0x9E3779B97F4A7C15) >> 40) * 2.0**-24
                for p in positions.tolist()]
        assert counter_uniform(positions, key).tolist() == want
        assert torch.equal(counter_uniform(positions[3:], key), counter_uniform(positions, key)[3:])


def test_nvfp4_cast_rounds_stochastically_given_draws():
    from f8dist.core.scaling import counter_uniform, nvfp4_cast

    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    amax, positions = tensor_amax(x), torch.arange(x.numel()).view(x.shape)
    nearest = nvfp4_cast(x, (1, 16), amax)
    a, b, c = (nvfp4_cast(x, (1, 16), amax, counter_uniform(positions, k)) for k in (1, 1, 2))
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))  # deterministic
    assert not torch.equal(a[0].view(torch.uint8), c[0].view(torch.uint8))  # another key
    assert not torch.equal(a[0].view(torch.uint8), nearest[0].view(torch.uint8))
    assert torch.equal(a[1].view(torch.uint8), nearest[1].view(torch.uint8))  # the same scales
    assert torch.equal(a[2], nearest[2])


def test_random_hadamard_leaves_the_grad_weight_product_unchanged():
    # [Note: random Hadamard transform]: Q = H16 diag(signs) / 4 is orthogonal, so transforming
    # both operands' tokens leaves G^T X unchanged; on integers float64 is exact arithmetic here
    from f8dist.core.scaling import hadamard_signs, random_hadamard

    signs = hadamard_signs(5)
    assert set(signs.tolist()) == {-1.0, 1.0} and torch.equal(signs, hadamard_signs(5))
    q = random_hadamard(torch.eye(16, dtype=torch.float64), signs)  # [16, 16]: Q itself
    assert torch.equal(q.t() @ q, torch.eye(16, dtype=torch.float64))
    gen = torch.Generator().manual_seed(0)
    g = torch.randint(-8, 9, (2, 21, 24), generator=gen).double()  # [B, S, N]: a partial block
    x = torch.randint(-8, 9, (2, 21, 40), generator=gen).double()  # [B, S, K]
    gt, xt = random_hadamard(g, signs), random_hadamard(x, signs)
    assert not torch.equal(gt, g)
    plain = g.reshape(-1, 24).t() @ x.reshape(-1, 40)  # [N, K]
    assert torch.equal(gt.reshape(-1, 24).t() @ xt.reshape(-1, 40), plain)



def test_group_positions_are_each_groups_own():
    """[Note: positions in token groups]: a group's elements draw at the same positions whatever
    the other groups hold and wherever its rows are (one device, or a rank holding groups 2-3);
    every element's position is distinct."""
    from f8dist.core.scaling import group_positions

    whole = group_positions(torch.tensor([3, 3, 7, 8], dtype=torch.int32), 8, 16)  # [8, 16]
    part = group_positions(torch.tensor([4, 5], dtype=torch.int32), 5, 16, first_group=2)
    assert torch.equal(whole[3:], part)
    assert whole.unique().numel() == whole.numel()
