"""One-process tests of the float8 reduce-scatter's chunk math (cast per block, pack, dequantize
and sum), its reduce-op semantics, its config and its errors. The collective itself runs in
tests/distributed/test_fsdp_reduce_scatter.py (gloo) and tests/sim/parallel/fsdp/test_reduce_scatter.py."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from f8dist.parallel.fsdp import Float8ReduceScatterConfig, enable_float8_reduce_scatter
from f8dist.parallel.fsdp.reduce_scatter import (
    _sum_factor,
    dequantize_and_sum,
    payload_numel,
    quantize_chunks,
)
from f8dist.core.numerics import sqnr
from f8dist.core.scaling import amax_to_scale, dequantize

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _chunks(w=4, n=1000, seed=0):
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    return torch.randn(w, n, generator=g)  # [W, n]


@pytest.mark.parametrize("block, n_blocks", [(256, 4), (100, 10), (1000, 1), (None, 1), (7, 143)])
def test_payload_is_float8_bytes_then_one_float32_scale_per_block(block, n_blocks):
    config = Float8ReduceScatterConfig(block_size=block)
    x = _chunks()
    payload = quantize_chunks(x, config)
    assert payload.dtype == torch.uint8
    assert payload.shape == (4, 1000 + 4 * n_blocks) == (4, payload_numel(1000, config))
    # the scales are amax_to_scale of each block's amax, in the bytes after the data
    size = block or 1000
    scales = payload[:, 1000:].contiguous().view(torch.float32)  # [W, nb]
    padded = torch.nn.functional.pad(x, (0, n_blocks * size - 1000)).view(4, n_blocks, size)
    expected = amax_to_scale(padded.abs().amax(-1), E4M3)  # [W, nb]
    assert torch.equal(scales, expected)
    # and the data bytes are the saturated casts with those scales
    data = payload[:, :1000].contiguous().view(E4M3).view(4, 1000)
    per_elem = expected.repeat_interleave(size, dim=1)[:, :1000]  # [W, n]
    assert torch.equal(data, (x * per_elem).to(E4M3))


@pytest.mark.parametrize("dtype, floor_db", [(E4M3, 28.0), (E5M2, 22.0)])
@pytest.mark.parametrize("block", [None, 256, 100])
def test_dequantize_and_sum_is_the_float32_sum_within_the_format_noise(dtype, floor_db, block):
    config = Float8ReduceScatterConfig(float8_dtype=dtype, block_size=block)
    x = _chunks(n=1000)
    for rank in (0, 3):
        out = dequantize_and_sum(quantize_chunks(x, config), x[rank], rank, config)
        assert out.dtype == torch.float32 and out.shape == (1000,)
        assert sqnr(x.double().sum(0), out) > floor_db
        # the same as dequantizing every row that crossed the wire and adding the exact own row
        payload = quantize_chunks(x, config)
        rows = [x[r] if r == rank else _dequantize_row(payload[r], 1000, config) for r in range(4)]
        assert torch.allclose(out, torch.stack(rows).sum(0), rtol=0, atol=1e-6)


def _dequantize_row(row, n, config):
    """One payload row back to float32, written out elementwise."""
    block = config.block_size or n
    data = row[:n].contiguous().view(config.float8_dtype)  # [n]
    scales = row[n:].contiguous().view(torch.float32)  # [nb]
    return dequantize(data, scales.repeat_interleave(block)[:n], torch.float32)


def test_own_chunk_never_quantized():
    config = Float8ReduceScatterConfig()
    x = _chunks(w=1)
    # a single rank's reduction is its own chunk, bit for bit (nothing crossed the wire)
    assert torch.equal(dequantize_and_sum(quantize_chunks(x, config), x[0], 0, config), x[0])


def test_blocks_keep_small_gradients_a_chunk_scale_flushes():
    # one chunk: 256 gradient elements of magnitude 1e-7 next to 256 of magnitude 1e2 (a norm's
    # gradient beside a large matrix's): per-block scales keep both; one chunk scale flushes the
    # small ones to zero (e4m3's smallest subnormal is 2**-9 of 448 / amax)
    small = _chunks(w=2, n=256, seed=1) * 1e-7
    big = _chunks(w=2, n=256, seed=2) * 1e2
    x = torch.cat([small, big], dim=1)  # [2, 512]
    ref = x.double().sum(0)
    blocked = Float8ReduceScatterConfig(block_size=256)
    chunk = Float8ReduceScatterConfig(block_size=None)
    out_blocked = dequantize_and_sum(quantize_chunks(x, blocked), x[1], 1, blocked)
    out_chunk = dequantize_and_sum(quantize_chunks(x, chunk), x[1], 1, chunk)
    assert sqnr(ref[:256], out_blocked[:256]) > 28
    assert sqnr(ref[:256], out_chunk[:256]) < 10  # rank 0's small half arrives as zeros
    assert sqnr(ref[256:], out_blocked[256:]) > 28


def test_zero_and_empty_chunks():
    config = Float8ReduceScatterConfig()
    zeros = torch.zeros(3, 300)
    out = dequantize_and_sum(quantize_chunks(zeros, config), zeros[0], 0, config)
    assert torch.equal(out, torch.zeros(300))  # finite scale for amax 0, no NaN
    empty = torch.zeros(3, 0)
    payload = quantize_chunks(empty, config)
    assert payload.shape == (3, 0) and payload_numel(0, config) == 0
    assert dequantize_and_sum(payload, empty[0], 0, config).shape == (0,)


def test_bfloat16_chunks_reduce_in_float32():
    config = Float8ReduceScatterConfig()
    x = _chunks(n=512).to(torch.bfloat16)
    out = dequantize_and_sum(quantize_chunks(x, config), x[2], 2, config)
    assert out.dtype == torch.float32
    assert sqnr(x.double().sum(0), out) > 28


def test_reduce_op_factors_are_fsdp2s_semantics():
    ReduceOp = dist.ReduceOp
    assert _sum_factor(ReduceOp.SUM, 4) is None  # FSDP2 divides itself (force-sum, fp16)
    assert _sum_factor(ReduceOp.AVG, 4) == 0.25  # the default mean
    # set_gradient_divide_factor(8); FSDP2 builds the op with _make_nccl_premul_sum on every
    # torch >= 2.11, whose factor Python can read from 2.13 on
    premul = dist._make_nccl_premul_sum(0.125)
    if hasattr(premul, "factor"):
        assert _sum_factor(premul, 4) == 0.125
        assert _sum_factor(dist._make_nccl_premul_sum(torch.tensor(0.5)), 4) == 0.5
    else:
        with pytest.raises(NotImplementedError, match="set_gradient_divide_factor"):
            _sum_factor(premul, 4)
    with pytest.raises(NotImplementedError, match="SUM, AVG or PREMUL_SUM"):
        _sum_factor(ReduceOp.MAX, 4)


@pytest.mark.parametrize("kwargs, match", [
    ({"float8_dtype": torch.bfloat16}, "float8_e4m3fn or torch.float8_e5m2"),
    ({"block_size": 0}, "positive int"),
    ({"block_size": -8}, "positive int"),
    ({"block_size": 2.5}, "positive int"),
    ({"block_size": True}, "positive int"),
])
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Float8ReduceScatterConfig(**kwargs)


def test_config_is_frozen_and_keyword_only():
    config = Float8ReduceScatterConfig()
    assert (config.float8_dtype, config.block_size) == (E4M3, 256)  # the measured default
    with pytest.raises(Exception):
        config.block_size = 128
    with pytest.raises(TypeError):
        Float8ReduceScatterConfig(E4M3, 256)


def test_enable_needs_a_fully_shard_model():
    with pytest.raises(ValueError, match="after fully_shard"):
        enable_float8_reduce_scatter(nn.Linear(4, 4))
    with pytest.raises(TypeError, match="Float8ReduceScatterConfig"):
        enable_float8_reduce_scatter(nn.Linear(4, 4), config={"block_size": 256})


def test_enable_refuses_one_rank_shards_where_it_would_never_run():
    """FSDP2 runs no reduce-scatter on a one-rank shard group: the float8 one would silently do
    nothing, so enabling it there raises (a 2-rank group, on the fake backend, takes it)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        one = fully_shard(nn.Sequential(nn.Linear(32, 32)),
                          mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("r", "s"))["s"])
        with pytest.raises(ValueError, match="over one rank.*no reduce-scatter.*leave it off"):
            enable_float8_reduce_scatter(one)
        assert enable_float8_reduce_scatter(fully_shard(nn.Sequential(nn.Linear(32, 32)))) == 1
    finally:
        dist.destroy_process_group()


def test_clear_error_on_a_torch_without_the_hook(monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    monkeypatch.delattr(FSDPModule, "set_custom_reduce_scatter")
    with pytest.raises(RuntimeError, match="set_custom_reduce_scatter.*upgrade torch"):
        enable_float8_reduce_scatter(nn.Linear(4, 4))


def test_bytes_per_element():
    # what the docs and the bench quote: 1 byte per element plus 4 per block
    config = Float8ReduceScatterConfig()
    n = 256 * 1000
    assert payload_numel(n, config) == n + 4 * 1000
    assert math.isclose(payload_numel(n, config) / (2 * n), 0.5078125)
