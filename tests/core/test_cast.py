"""f8dist/core/cast.py: ``cast_to_float8`` given an amax it already knows; compiled block casts."""

import dataclasses

import pytest
import torch

from f8dist.core.cast import cast_to_float8
from f8dist.config import CastSpec, ScaleRounding, ScalingGranularity
from tests.floors import on_cpu

AXISWISE = ScalingGranularity.AXISWISE


@pytest.mark.parametrize("spec", [CastSpec(), CastSpec(granularity=AXISWISE, axis=-1)])
def test_a_given_amax_casts_as_the_computed_one(spec):
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    amax = x.abs().float().amax(dim=-1, keepdim=True) if spec.axiswise else x.abs().float().max()
    computed, given = cast_to_float8(x, spec), cast_to_float8(x, spec, amax=amax)
    assert torch.equal(given._scale, computed._scale)
    assert torch.equal(given._data.view(torch.uint8), computed._data.view(torch.uint8))


def test_a_given_amax_sets_the_scale():
    """The amax is taken as given, not recomputed: twice the amax, half the scale."""
    x = torch.randn(16, 32)
    amax = x.abs().max()
    assert torch.equal(cast_to_float8(x, CastSpec(), amax=2 * amax)._scale,
                       cast_to_float8(x, CastSpec())._scale / 2)


def test_an_amax_of_the_wrong_shape_or_with_a_scale_is_rejected():
    x = torch.randn(16, 32)
    with pytest.raises(ValueError, match="shape of the cast's own"):
        cast_to_float8(x, CastSpec(), amax=x.abs().amax(dim=-1, keepdim=True))
    with pytest.raises(ValueError, match="shape of the cast's own"):
        cast_to_float8(x, CastSpec(granularity=AXISWISE), amax=x.abs().max())
    with pytest.raises(ValueError, match="not both"):
        cast_to_float8(x, CastSpec(), torch.tensor(1.0), amax=x.abs().max())


@on_cpu  # a CPU mesh
def test_block_casts_of_dtensors_need_shards_on_block_boundaries():
    """[Note: shards on block boundaries]: a DTensor whose shards hold whole blocks casts its
    local shard (no collective); one whose shards would split a block raises, naming the fix."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from f8dist import Float8LinearConfig

    spec = Float8LinearConfig.from_recipe_name("mxfp8").cast_spec("output", "input", "lin")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        local = torch.randn(4, 64)
        for placement in (Shard(0), Shard(1)):  # 1x32 blocks: rows, and 64 columns per rank
            fp8 = cast_to_float8(DTensor.from_local(local, mesh, [placement]), spec)
            assert fp8.placements == (placement,)
            alone = cast_to_float8(local, spec)
            assert torch.equal(fp8.to_local()._data.view(torch.uint8), alone._data.view(torch.uint8))
        split = DTensor.from_local(torch.randn(4, 48), mesh, [Shard(1)])  # 48 columns per rank
        with pytest.raises(NotImplementedError, match="lin:output:input: a block-scaled cast of a "
                                                      "DTensor needs shards on block boundaries.*"
                                                      "splits its 32-wide blocks"):
            cast_to_float8(split, spec)
    finally:
        dist.destroy_process_group()


def _block_specs():
    """One spec per distinct block cast of the block recipes (the block in the operand's layout,
    dtype, scale dtype, rounding), plus MXFP8's OCP floor rounding ([Note: e8m0 rounding])."""
    from f8dist import Float8LinearConfig
    from f8dist.config import Gemm

    specs = {}
    for recipe in ("mxfp8", "mxfp8_square_weights", "blockwise"):
        config = Float8LinearConfig.from_recipe_name(recipe)
        for gemm in Gemm:
            for operand in gemm.operands:
                spec = config.cast_spec(gemm, operand, "lin")
                if spec.blockwise:
                    key = (spec.block_shape(2), spec.dtype, spec.scale_dtype, spec.scale_rounding)
                    specs.setdefault(key, spec)
    mx = next(s for s in specs.values() if s.block_size == (1, 32))
    specs["floor"] = dataclasses.replace(mx, scale_rounding=ScaleRounding.FLOOR)
    return list(specs.values())


@on_cpu  # compiled casts on the CPU (the Note)
@pytest.mark.parametrize("spec", _block_specs(), ids=lambda s: "{}x{}-{}-{}".format(
    *s.block_shape(2), str(s.scale_dtype).split(".")[1], s.scale_rounding.value))
def test_compiled_block_casts_are_eager_bit_for_bit(spec):
    """[Note: a block cast in one pass] in f8dist/core/scaling.py: compiled, a block cast gives eager's
    bytes and scales, bit for bit; blocks of zeros, of float32 subnormals, of an inf, and blocks
    whose amax sits just above e4m3's max (where floor and rceil part) included."""
    torch.manual_seed(0)
    x = torch.randn(256, 256) * torch.logspace(-6, 6, 256)  # [256, 256], 12 decades
    x[:128, :128] = 0.0
    x[128:, :32] *= 1e-40  # subnormal float32 amaxes
    x[:32, 128:160] = 449.0 * torch.rand(32, 32).sign()
    x[200, 250] = float("inf")
    x = x.to(torch.bfloat16)

    def cast(t):
        fp8 = cast_to_float8(t, spec)
        return fp8._data, fp8._scale

    torch._dynamo.reset()
    for e, c in zip(cast(x), torch.compile(cast, fullgraph=True)(x)):
        assert e.dtype == c.dtype and e.shape == c.shape
        nan = torch.isnan(e.float())  # the inf's block: NaN either way, its sign bit may differ
        assert torch.equal(nan, torch.isnan(c.float()))
        bits = {1: torch.uint8, 4: torch.int32}[e.element_size()]
        assert torch.equal(e.view(bits)[~nan], c.view(bits)[~nan])


def test_nvfp4_grad_weight_casts_take_the_random_hadamard_transform():
    # [Note: random Hadamard transform] in f8dist/core/scaling.py: the "nvfp4" recipe's
    # grad_weight operands are the casts of their transformed tokens (signs from the seed), kept
    # in the operand's dtype
    from f8dist import Float8LinearConfig
    from f8dist.core.cast import stochastic_rounding
    from f8dist.core.scaling import hadamard_signs, nvfp4_cast, random_hadamard, tensor_amax

    spec = Float8LinearConfig.from_recipe_name("nvfp4").cast_spec("grad_weight", "input")
    assert spec.random_hadamard and not spec.stochastic_rounding
    x = torch.randn(2, 24, 32, dtype=torch.bfloat16)  # [B, S, K]: 48 tokens, three 16-blocks
    stochastic_rounding.reset(7)
    fp8 = cast_to_float8(x, spec)
    xt = random_hadamard(x, hadamard_signs(stochastic_rounding.signs_key()))
    data, scale, tensor_scale = nvfp4_cast(xt, (1, 16, 1), tensor_amax(xt))
    assert fp8.dtype == torch.bfloat16 and torch.equal(fp8._tensor_scale, tensor_scale)
    assert torch.equal(fp8._data.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(fp8._scale.view(torch.uint8), scale.view(torch.uint8))


def test_random_hadamard_cast_takes_no_given_amax():
    from f8dist import Float8LinearConfig

    spec = Float8LinearConfig.from_recipe_name("nvfp4").cast_spec("grad_weight", "input")
    x = torch.randn(32, 16)
    with pytest.raises(ValueError, match="random_hadamard=True casts the transformed tensor, "
                                         "whose amax it computes; give it no amax"):
        cast_to_float8(x, spec, amax=x.abs().max())


def _sr_error(x: torch.Tensor, stream: int) -> torch.Tensor:
    """The stochastically rounded NVFP4 cast of ``x`` less ``x``, drawn from ``stream``."""
    from f8dist import Float8LinearConfig
    from f8dist.core.cast import stochastic_rounding

    spec = Float8LinearConfig.from_recipe_name("nvfp4").cast_spec("grad_input", "grad_output")
    assert spec.stochastic_rounding
    stochastic_rounding.reset(5, stream=stream)
    try:
        return cast_to_float8(x, spec).to_original_precision() - x
    finally:
        stochastic_rounding.reset()


def test_data_parallel_streams_draw_apart_and_each_reproduces():
    # [Note: the stochastic rounding key]: a replica's stream is mixed into the key, so two
    # replicas round one tensor differently, and one device on a stream draws as it does
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(_sr_error(x, 1), _sr_error(x, 1))
    assert not torch.equal(_sr_error(x, 0), _sr_error(x, 1))


def test_data_parallel_streams_round_independently():
    # two replicas' errors on the same tensor (their batches' worst case: alike positions) are
    # uncorrelated, so they average down over the gradient reduction: |corr| below 5 sigma of
    # independent samples' (1 / sqrt(n)); one stream's are the same errors (corr 1)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    e0, e1 = _sr_error(x, 0).flatten(), _sr_error(x, 1).flatten()
    corr = torch.corrcoef(torch.stack([e0, e1]))[0, 1]
    assert corr.abs() < 5 / e0.numel() ** 0.5, corr
