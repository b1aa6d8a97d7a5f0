"""f8dist/cast.py: ``cast_to_float8`` given an amax it already knows."""

import pytest
import torch

from f8dist.cast import cast_to_float8
from f8dist.config import CastSpec, ScalingGranularity

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
