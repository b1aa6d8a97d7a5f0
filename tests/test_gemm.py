import pytest
import torch

from f8dist.cast import cast_to_float8
from f8dist.config import ScalingGranularity
from f8dist.gemm import check_gemm_shape, scaled_mm
from f8dist.numerics import sqnr
from f8dist.tensor import ScaledMMConfig

E4M3 = torch.float8_e4m3fn
AXISWISE = ScalingGranularity.AXISWISE


def _operands(m, k, n, dtype, axiswise, mm_config):
    torch.manual_seed(0)
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    g = AXISWISE if axiswise else ScalingGranularity.TENSORWISE
    fa = cast_to_float8(a, E4M3, granularity=g, axiswise_dim=1, mm_config=mm_config)
    fb = cast_to_float8(b, E4M3, granularity=g, axiswise_dim=0, mm_config=mm_config)
    return a, b, fa, fb


@pytest.mark.parametrize("axiswise", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_matches_emulation(axiswise, dtype):
    a, b, fa, fb = _operands(32, 64, 48, dtype, axiswise, ScaledMMConfig())
    out = scaled_mm(fa, fb)
    assert out.dtype == dtype and out.shape == (32, 48)
    emu = scaled_mm(fa.with_mm_config(ScaledMMConfig(emulate=True)), fb)
    assert sqnr(emu, out) > (100 if dtype == torch.float32 else 40)
    assert sqnr(a.float() @ b.float(), out) > 25


def test_unaligned_shapes_raise_a_clear_error_or_pad_exactly():
    a, b, fa, fb = _operands(8, 40, 24, torch.float32, False, ScaledMMConfig())
    with pytest.raises(ValueError, match=r"K=40, N=24.*pad_inner_dim=True"):
        scaled_mm(fa, fb)
    padded = ScaledMMConfig(pad_inner_dim=True)
    out = scaled_mm(fa.with_mm_config(padded), fb.with_mm_config(padded))
    emu = scaled_mm(fa.with_mm_config(ScaledMMConfig(emulate=True)), fb)
    assert out.shape == (8, 24) and sqnr(emu, out) > 100


def test_rowwise_padding_of_n_pads_scales_too():
    padded = ScaledMMConfig(pad_inner_dim=True)
    a, b, fa, fb = _operands(8, 40, 24, torch.float32, True, padded)
    emu = scaled_mm(fa.with_mm_config(ScaledMMConfig(emulate=True)), fb)
    assert sqnr(emu, scaled_mm(fa, fb)) > 100


def test_check_gemm_shape_names_the_culprit():
    check_gemm_shape(32, 16, what="x", pad_inner_dim=False)
    with pytest.raises(ValueError, match="layers.0.w1.*N=8"):
        check_gemm_shape(32, 8, what="layers.0.w1", pad_inner_dim=False)


def test_fp32_rowwise_fallback_applies_scales_to_a_fp32_result(monkeypatch):
    # CUDA's rowwise kernel emits bf16 only; the fallback (unit-scale fp32 gemm, scales applied
    # after) must give the float32 result, not a bf16-rounded one. Forced here on the CPU.
    import f8dist.gemm as gemm

    a, b, fa, fb = _operands(32, 64, 48, torch.float32, True, ScaledMMConfig())
    native = scaled_mm(fa, fb)
    monkeypatch.setattr(gemm, "rowwise_fp32_output_supported", lambda device: False)
    fallback = scaled_mm(fa, fb)
    assert fallback.dtype == torch.float32
    emu = scaled_mm(fa.with_mm_config(ScaledMMConfig(emulate=True)), fb)
    assert sqnr(emu, fallback) > 100 and sqnr(native, fallback) > 100
    assert sqnr(emu, fallback.bfloat16()) < 70  # what a bf16 output would have cost
