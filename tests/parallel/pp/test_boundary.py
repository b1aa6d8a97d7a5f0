"""The float8 stage boundary on one device ([Note: the float8 stage boundary] in
f8dist/parallel/pp/boundary.py): what crosses it is f8dist's per-token cast, both ways; through
pipelining's schedules: tests/sim/parallel/pp/test_boundary.py."""

import pytest
import torch

from f8dist.core.cast import cast_to_float8
from f8dist.parallel.pp import Float8StageInput, Float8StageOutput, wire_like
from f8dist.parallel.pp.boundary import ACTIVATION, GRADIENT


def _dequantized(t: torch.Tensor, spec) -> torch.Tensor:
    return cast_to_float8(t.reshape(-1, t.shape[-1]), spec).to_original_precision().view(t.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_boundary_is_the_per_token_cast_both_ways(dtype):
    x = (torch.randn(2, 8, 64) * torch.logspace(-3, 3, 8)[:, None]).to(dtype).requires_grad_()
    wire = Float8StageOutput()(x)
    # a token's 64 bytes and its float32 scale, in x's elements
    assert wire.dtype == dtype and wire.shape == wire_like(x).shape == (2, 8, 68 // wire.element_size())
    out = Float8StageInput()(wire)
    assert torch.equal(out, _dequantized(x.detach(), ACTIVATION))  # e4m3, a scale per token
    grad = torch.randn(2, 8, 64).to(dtype)
    out.backward(grad)
    assert torch.equal(x.grad, _dequantized(grad, GRADIENT))  # e5m2, a scale per token
    assert not torch.equal(x.grad, grad)


def test_boundary_names_a_dim_it_cannot_pack():
    with pytest.raises(ValueError, match=r"last dim \(D=6\) must be a multiple of 4; pad the model dim"):
        Float8StageOutput()(torch.randn(2, 6))
