"""f8dist/cast.py: ``cast_to_float8`` given an amax it already knows."""

import pytest
import torch

from f8dist.cast import cast_to_float8
from f8dist.config import CastSpec, ScalingGranularity
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
