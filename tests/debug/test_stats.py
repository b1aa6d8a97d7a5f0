"""f8dist.debug.stats: the statistics of one cast against values computed directly."""

import math

import pytest
import torch

from f8dist.core.cast import cast_to_float8
from f8dist.config import CastSpec, ScalingGranularity
from f8dist.debug.stats import CastStats, cast_stats_tensors, saturated_mask, saturation_threshold
from f8dist.core.scaling import saturated_cast
from tests.floors import on_cpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def stats_of(hp, dtype, scale=None, **kwargs):
    fp8 = cast_to_float8(hp, CastSpec(dtype=dtype, **kwargs), scale)
    return CastStats.from_tensors(*cast_stats_tensors(hp, fp8._data, fp8._scale), float8_dtype=dtype)


def test_saturation_counts_exact_with_given_scale():
    # scale 1: e4m3 values up to 464 round to 448 anyway; beyond that the clamp changes them
    hp = torch.tensor([448.0, 464.0, 464.5, 470.0, -1000.0, 1.0, 0.0])
    s = stats_of(hp, E4M3, scale=torch.tensor(1.0))
    assert (s.saturated, s.numel) == (3, 7)
    assert s.saturated_frac == 3 / 7
    # e5m2: half-way above the max (61440) rounds away to inf, so it is saturated
    hp = torch.tensor([57344.0, 61439.0, 61440.0, -70000.0, 2.0])
    assert stats_of(hp, E5M2, scale=torch.tensor(1.0)).saturated == 2


def test_saturated_mask_is_exactly_where_clamp_changes_e5m2():
    # e5m2 casts without clamp overflow to inf, so "the clamp changed it" is observable directly
    x = torch.linspace(50000.0, 70000.0, 4001)
    x = torch.cat([x, -x, torch.tensor([61440.0, 61439.99])])
    scale = torch.tensor(1.0)
    changed = saturated_cast(x, scale, E5M2).float() != x.to(E5M2).float()
    assert changed.any() and (~changed).any()
    assert torch.equal(saturated_mask(x, scale, E5M2), changed)


def test_thresholds_half_an_ulp_above_max():
    assert saturation_threshold(E4M3) == (464.0, False)
    assert saturation_threshold(E5M2) == (61440.0, True)


def test_dynamic_scaling_never_counts_saturation():
    # amax * (fp8_max / amax) overshoots fp8_max by a float32 ulp in ~1 of 5 casts: not saturation
    g = torch.Generator(torch.get_default_device()).manual_seed(0)
    total = 0
    for _ in range(200):
        hp = torch.randn(16, generator=g) * torch.rand((), generator=g) * 100
        for dtype in (E4M3, E5M2):
            total += stats_of(hp, dtype).saturated
    assert total == 0


def test_underflow_counts_exact():
    # scale 1: e4m3's smallest subnormal is 2**-9; 2**-10 ties to 0 (even), above it rounds up
    tiny = 2.0**-10
    hp = torch.tensor([tiny, tiny * 1.01, 1e-5, -1e-5, 0.0, 1.0, -tiny * 1.5])
    s = stats_of(hp, E4M3, scale=torch.tensor(1.0))
    assert (s.underflow, s.nonzero) == (3, 6)
    assert s.underflow_frac == 0.5
    # the same values with a dynamic scale (amax 1 -> scale 448) all survive
    assert stats_of(hp, E4M3).underflow == 0


def test_sqnr_amax_scale_match_direct_computation():
    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    hp = torch.randn(64, 32, generator=g)
    for dtype, floor in ((E4M3, 25.0), (E5M2, 20.0)):
        fp8 = cast_to_float8(hp, CastSpec(dtype=dtype))
        s = stats_of(hp, dtype)
        dq = fp8.to_original_precision()
        direct = 10 * torch.log10(hp.pow(2).sum() / (hp - dq).pow(2).sum()).item()
        assert s.sqnr_db == pytest.approx(direct, abs=1e-3)
        assert s.sqnr_db > floor
        assert s.amax == hp.abs().max().item()
        assert s.scale_min == s.scale_max == fp8._scale.item()
        assert (s.numel, s.nonzero, s.casts) == (hp.numel(), hp.numel(), 1)


def test_axiswise_scale_range():
    hp = torch.randn(8, 16) * torch.arange(1, 9).unsqueeze(1)  # [8, 16] rows of growing range
    fp8 = cast_to_float8(hp, CastSpec(dtype=E4M3, granularity=ScalingGranularity.AXISWISE, axis=-1))
    s = stats_of(hp, E4M3, granularity=ScalingGranularity.AXISWISE, axis=-1)
    assert s.scale_min == fp8._scale.min().item() and s.scale_max == fp8._scale.max().item()
    assert s.scale_min < s.scale_max


def test_exact_cast_has_infinite_sqnr():
    hp = torch.tensor([1.0, -2.0, 0.5, 0.0])  # powers of 2 under a power-of-2 scale: exact
    s = stats_of(hp, E4M3, scale=torch.tensor(4.0))
    assert s.error_sq == 0 and math.isinf(s.sqnr_db)
    assert math.isinf(stats_of(torch.zeros(4), E4M3).sqnr_db)


def test_merge_equals_stats_of_concatenation():
    a = torch.randn(32) * 3
    b = torch.randn(16) * 1e-4
    b[0] = 0.0
    scale = torch.tensor(50.0)
    merged = stats_of(a, E4M3, scale=scale) + stats_of(b, E4M3, scale=scale)
    whole = stats_of(torch.cat([a, b]), E4M3, scale=scale)
    for name in ("casts", "numel", "nonzero", "saturated", "underflow"):
        expected = getattr(whole, name) * (2 if name == "casts" else 1)
        assert getattr(merged, name) == expected, name
    assert merged.signal_sq == pytest.approx(whole.signal_sq)
    assert merged.error_sq == pytest.approx(whole.error_sq)
    assert merged.amax == whole.amax
    with pytest.raises(ValueError, match="cannot merge"):
        merged + stats_of(a, E5M2)


def test_block_scaled_cast_statistics_per_block():
    """Per block: the count, the share of blocks with a saturated or underflowed element, and
    the distribution of block amaxes by power of 2 ([Note: block scales])."""
    from f8dist.config import CastSpec, ScalingGranularity, ScaleRounding

    spec = CastSpec(granularity=ScalingGranularity.BLOCKWISE, axis=-1, block_size=(1, 32),
                    scale_dtype=torch.float8_e8m0fnu, scale_rounding=ScaleRounding.FLOOR)
    hp = torch.ones(4, 64)
    hp[0, :32] = 2.0 ** -20  # amax 2**-20
    hp[1, 0] = 500.0  # OCP floor: 2**(8 - 8) scale, 500 clamps to 448: this block saturates
    hp[2, 32] = 1e-6  # next to ones: below e4m3's smallest subnormal at scale 2**8, underflows
    fp8 = cast_to_float8(hp, spec)
    s = CastStats.from_tensors(*cast_stats_tensors(hp, fp8._data, fp8._scale, fp8._block),
                               float8_dtype=torch.float8_e4m3fn)
    assert (s.blocks, s.blocks_saturated, s.blocks_underflow) == (8, 1, 1)
    assert s.blocks_saturated_frac == s.blocks_underflow_frac == 1 / 8
    assert sum(s.block_amax_log2) == 8
    assert s.block_amax_quantile(0.0) == 2.0 ** -20 and s.block_amax_quantile(1.0) == 256.0
    merged = s + s
    assert merged.blocks == 16 and merged.block_amax_log2 == tuple(2 * c for c in s.block_amax_log2)
    tensorwise = cast_to_float8(hp, CastSpec())
    t = CastStats.from_tensors(*cast_stats_tensors(hp, tensorwise._data, tensorwise._scale),
                               float8_dtype=torch.float8_e4m3fn)
    assert t.blocks == 0 and t.block_amax_log2 == ()


@on_cpu  # CUDA runs block-scaled gemms on sm90 or sm100+ only (tests/floors.py)
def test_recorder_reports_block_columns():
    from f8dist import Float8LinearConfig, convert_to_float8_training
    from f8dist.debug import record

    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("mxfp8"))
    with record(model) as rec:
        model(torch.randn(8, 64)).sum().backward()
    stats = rec.stats()
    assert all(s.blocks > 0 for s in stats.values())
    assert "blk sat %" in rec.table() and "blk amax p1..p99" in rec.table()


def test_nvfp4_cast_stats_count_flushed_blocks_and_e2m1_codes():
    """NVFP4 ([Note: NVFP4]): the share of 1x16 blocks that flush an element to 0 (an outlier's
    block), none that saturate, and the e2m1 code histogram; read through float8_values."""
    from f8dist import Float8LinearConfig
    from f8dist.core.scaling import E2M1

    spec = Float8LinearConfig.from_recipe_name("nvfp4").cast_spec("output", "input")
    row = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    x = torch.cat([row, -row]).repeat(4, 2)  # [4, 32]: each block holds every code twice
    x[3, 16:] = 1e-3
    x[3, 17] = 6.0  # with 6 in its block, 1e-3 flushes to 0
    s = CastStats.from_tensors(*cast_stats_tensors(x, cast_to_float8(x, spec)), float8_dtype=E2M1)
    assert (s.blocks, s.blocks_saturated, s.blocks_underflow) == (8, 0, 1)
    assert s.underflow == 15 and s.saturated == 0
    assert s.e2m1_codes == (14 + 15, 14, 14, 14, 14, 14, 14, 14 + 1)
    assert (s + s).e2m1_codes == tuple(2 * c for c in s.e2m1_codes)
    assert saturation_threshold(E2M1) == (7.0, True)  # 7 ties to 8, past 6: clamped
