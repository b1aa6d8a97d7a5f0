import pytest
import torch

from f8dist.config import E4M3, ScaledMMConfig
from f8dist.core.gemm import (
    block_scaled_grouped_mm, cpu_block_scaled_grouped_mm, cpu_scaled_grouped_mm, pad_groups,
    scaled_grouped_mm,
)
from f8dist.core.numerics import sqnr
from tests.floors import exact_gemm_db, on_cpu

EMULATE = ScaledMMConfig(emulate=True)
# uneven groups, one empty, none a multiple of 16
OFFSETS = torch.tensor([5, 5, 21, 40], dtype=torch.int32)


def _fp8(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 40).to(E4M3)


def _scale(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return 2.0 ** torch.randint(-3, 4, shape, generator=g).float()


def test_pad_groups_rounds_each_group_up_to_16_rows():
    padded, rows, m_padded = pad_groups(OFFSETS, 40)
    assert padded.tolist() == [16, 16, 32, 64] and padded.dtype == torch.int32
    assert rows[:5].tolist() == list(range(5)) and rows[5:21].tolist() == list(range(16, 32))
    assert rows[21:].tolist() == list(range(32, 51)) and m_padded == 48 + 64


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_2d_3d_matches_a_loop_over_experts(out_dtype):
    a, b = _fp8((40, 32), 0), _fp8((4, 32, 48), 1)  # [M, K], [E, K, N]
    sa, sb = _scale((40,), 2), _scale((4, 48), 3)
    out = scaled_grouped_mm(a, sa, b, sb, OFFSETS, out_dtype=out_dtype, mm_config=ScaledMMConfig())
    assert out.shape == (40, 48) and out.dtype == out_dtype
    start, ref = 0, []
    for e, end in enumerate(OFFSETS.tolist()):
        x = a[start:end].float() / sa[start:end, None]
        ref.append(x @ (b[e].float() / sb[e][None, :]))
        start = end
    ref = torch.cat(ref)
    assert sqnr(ref, out) > 45  # the kernel outputs bf16 ([Note: grouped gemm constraints])
    assert torch.equal(out, ref.bfloat16().to(out_dtype)) or sqnr(ref.bfloat16(), out) > 60
    emu = scaled_grouped_mm(a, sa, b, sb, OFFSETS, out_dtype=torch.float32, mm_config=EMULATE)
    assert sqnr(emu, ref) > exact_gemm_db()


def test_2d_2d_matches_a_loop_over_experts_and_empty_groups_get_zero():
    a, b = _fp8((48, 40), 0), _fp8((40, 32), 1)  # [N, M], [M, K]
    sa, sb = _scale((4, 48), 2), _scale((4, 32), 3)
    out = scaled_grouped_mm(a, sa, b, sb, OFFSETS, out_dtype=torch.float32,
                            mm_config=ScaledMMConfig())
    assert out.shape == (4, 48, 32)
    start = 0
    for e, end in enumerate(OFFSETS.tolist()):
        ref = (a[:, start:end].float() / sa[e][:, None]) @ (b[start:end].float() / sb[e][None, :])
        if start == end:
            assert torch.equal(out[e], torch.zeros_like(out[e]))
        else:
            assert sqnr(ref, out[e]) > 45  # rounded to bf16 ([Note: grouped gemm constraints])
        start = end


def test_rows_past_the_last_group_are_zero():
    a, b = _fp8((40, 32), 0), _fp8((4, 32, 16), 1)
    offsets = torch.tensor([5, 5, 21, 30], dtype=torch.int32)
    out = scaled_grouped_mm(a, torch.ones(40), b, torch.ones(4, 16), offsets,
                            out_dtype=torch.float32, mm_config=ScaledMMConfig())
    assert torch.equal(out[30:], torch.zeros(10, 16))


def test_no_tokens_at_all():
    a, b = _fp8((0, 32), 0), _fp8((4, 32, 16), 1)
    zeros = torch.zeros(4, dtype=torch.int32)
    out = scaled_grouped_mm(a, torch.ones(0), b, torch.ones(4, 16), zeros,
                            out_dtype=torch.bfloat16, mm_config=ScaledMMConfig())
    assert out.shape == (0, 16)
    gw = scaled_grouped_mm(_fp8((16, 0), 0), torch.ones(4, 16), _fp8((0, 32), 1),
                           torch.ones(4, 32), zeros, out_dtype=torch.float32,
                           mm_config=ScaledMMConfig())
    assert torch.equal(gw, torch.zeros(4, 16, 32))


def test_the_cpu_kernel_checks_cudas_constraints():
    a = _fp8((16, 32), 0)
    b = _fp8((2, 32, 16), 1).transpose(-2, -1).contiguous().transpose(-2, -1)
    offs = torch.tensor([16, 16], dtype=torch.int32)
    args = (torch.ones(16), torch.ones(2, 16), offs, torch.bfloat16)
    assert cpu_scaled_grouped_mm(a, b, *args).shape == (16, 16)
    with pytest.raises(RuntimeError, match="e4m3"):
        cpu_scaled_grouped_mm(a.to(torch.float8_e5m2), b, *args)
    with pytest.raises(RuntimeError, match="multiples of 16 rows"):
        cpu_scaled_grouped_mm(a, b, torch.ones(16), torch.ones(2, 16),
                              torch.tensor([8, 16], dtype=torch.int32), torch.bfloat16)
    with pytest.raises(RuntimeError, match="column-major"):
        cpu_scaled_grouped_mm(a, b.contiguous(), *args)
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_scaled_grouped_mm(a, b, *args[:-1], torch.float32)


def test_pad_groups_to_a_block_of_32_rows():
    padded, rows, m_padded = pad_groups(OFFSETS, 40, 32)
    assert padded.tolist() == [32, 32, 64, 96] and m_padded == 64 + 4 * 32
    assert rows[5:21].tolist() == list(range(32, 48)) and rows[21:].tolist() == list(range(64, 83))


@on_cpu  # the CPU block kernel
def test_the_block_kernel_refuses_blocks_that_would_span_two_groups():
    """2d x 2d contracts the tokens: each group must be whole blocks ([Note: the CPU block
    grouped kernel]); the caller pads them."""
    a, b = _fp8((16, 64), 0), _fp8((64, 32), 1)  # [N, M], [M, K]
    inv_a, inv_b = torch.ones(16, 2), torch.ones(2, 32)
    ok = torch.tensor([32, 32, 64], dtype=torch.int32)
    out = cpu_block_scaled_grouped_mm(a, b, inv_a, inv_b, [1, 32], [32, 1], ok, torch.float32)
    assert torch.equal(out[1], torch.zeros(16, 32))
    assert sqnr(a[:, 32:].float() @ b[32:].float(), out[2]) > 120
    with pytest.raises(ValueError, match="multiples of the contraction block"):
        cpu_block_scaled_grouped_mm(a, b, inv_a, inv_b, [1, 32], [32, 1],
                                    torch.tensor([16, 64], dtype=torch.int32), torch.float32)


def test_block_grouped_gemms_on_meta_give_shapes():
    a, b = torch.empty(4, 32, device="meta", dtype=E4M3), torch.empty(2, 32, 16, device="meta",
                                                                        dtype=E4M3)
    # meta runs the CPU op's fake kernel (a shape-only step of a model built on meta); it stood
    # for a device without a kernel before, whose error a CPU-only machine cannot show now
    out = block_scaled_grouped_mm(a, torch.ones(4, 1, device="meta"), (1, 32), b,
                                  torch.ones(2, 1, 16, device="meta"), (32, 1),
                                  torch.tensor([2, 4], device="meta"), out_dtype=torch.bfloat16,
                                  mm_config=ScaledMMConfig())
    assert out.is_meta and out.shape == (4, 16)


def _nvfp4(shape, block, seed):
    """e2m1 values one a byte as e4m3 (what the gemm reads), their e4m3 block scales, the
    float32 tensor scale: an NVFP4 cast of gaussian data."""
    from f8dist.core.scaling import e2m1_unpack, nvfp4_cast

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    block = (1,) * (len(shape) - len(block)) + tuple(block)
    data, scale, tensor_scale = nvfp4_cast(x, block, x.abs().amax())
    return e2m1_unpack(data).to(E4M3), scale, tensor_scale


@on_cpu  # [Note: the NVFP4 gemm] in f8dist/core/gemm.py: the CPU kernel or emulation
@pytest.mark.parametrize("emulate", [False, True])
def test_nvfp4_grouped_gemms_are_the_dense_nvfp4_gemm_per_expert(emulate):
    """Grouped NVFP4 (1x16 tokens, 16x16 expert weights, one tensor scale each): per expert, bit
    for bit the dense NVFP4 gemm of its rows, or with ``emulate`` the dequantize-then-mm
    reference; an empty group gets no rows (2d x 3d) and a zero gradient (2d x 2d)."""
    from f8dist.core.gemm import float8_mm
    from f8dist.core.scaling import nvfp4_dequantize

    cfg = ScaledMMConfig(emulate=emulate)
    a, sa, ta = _nvfp4((40, 32), (1, 16), 0)  # [M, K] tokens
    b, sb, tb = _nvfp4((4, 32, 48), (16, 16), 1)  # [E, K, N] expert weights
    out = float8_mm(a, sa, (1, 16), b, sb, (1, 16, 16), OFFSETS, out_dtype=torch.float32,
                    mm_config=cfg, tensor_scales=(ta, tb))  # [M, N]
    # 2d x 2d: [N, M] x [M, K] over groups padded to 16 rows (as the grad_weight gemm pads them)
    offs16 = pad_groups(OFFSETS, 40)[0]
    g, sg, tg = _nvfp4((48, 64), (1, 16), 2)  # [N, M'] gradient, 16-token blocks
    x, sx, tx = _nvfp4((64, 32), (16, 1), 3)  # [M', K] tokens, 16-token blocks
    gw = float8_mm(g, sg, (1, 16), x, sx, (16, 1), offs16, out_dtype=torch.float32,
                   mm_config=cfg, tensor_scales=(tg, tx))  # [E, N, K]
    assert torch.equal(gw[1], torch.zeros_like(gw[1]))  # the expert without tokens
    starts = [0] + OFFSETS.tolist()[:-1]
    for e, (s, t) in enumerate(zip(starts, OFFSETS.tolist())):
        s16, t16 = s if e == 0 else offs16[e - 1].item(), offs16[e].item()
        if emulate:  # dequantize, then a float32 matmul
            hp = lambda d, sc, blk, ts: nvfp4_dequantize(d, sc, blk, ts, torch.float32)
            want = hp(a[s:t], sa[s:t], (1, 16), ta) @ hp(b[e], sb[e], (16, 16), tb)
            want_gw = (hp(g[:, s16:t16], sg[:, s16 // 16:t16 // 16], (1, 16), tg)
                       @ hp(x[s16:t16], sx[s16 // 16:t16 // 16], (16, 1), tx))
        else:  # the dense CPU kernel
            want = float8_mm(a[s:t], sa[s:t], (1, 16), b[e], sb[e], (16, 16),
                             out_dtype=torch.float32, mm_config=cfg, tensor_scales=(ta, tb))
            want_gw = float8_mm(g[:, s16:t16], sg[:, s16 // 16:t16 // 16], (1, 16), x[s16:t16],
                                sx[s16 // 16:t16 // 16], (16, 1), out_dtype=torch.float32,
                                mm_config=cfg, tensor_scales=(tg, tx))
        assert torch.equal(out[s:t], want), e
        assert torch.equal(gw[e], want_gw if t > s else torch.zeros_like(gw[e])), e
