"""f8dist/models/norm.py: RMSNorm is nn.RMSNorm keeping only its input and rstd for backward."""

import pytest
import torch
import torch.nn as nn

from f8dist.models.norm import RMSNorm
from f8dist.testing import measure_fwd_bwd


def _pair(dtype, dim=64):
    torch.manual_seed(0)
    ref = nn.RMSNorm(dim, eps=1e-5).to(dtype)
    nn.init.normal_(ref.weight)
    ours = RMSNorm(dim, eps=1e-5).to(dtype)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 8, 64), (5, 64), (3, 1, 7, 64), (0, 64)])
def test_outputs_and_gradients_are_nn_rmsnorm(dtype, shape):
    ref, ours = _pair(dtype)
    x_ref = torch.randn(*shape, dtype=dtype, requires_grad=True)
    x = x_ref.detach().clone().requires_grad_()
    grad = torch.randn(*shape, dtype=dtype)
    out_ref, out = ref(x_ref), ours(x)
    assert torch.equal(out_ref, out)
    out_ref.backward(grad)
    out.backward(grad)
    assert torch.equal(ref.weight.grad, ours.weight.grad)
    if dtype == torch.float32:  # float32 sums in another order: within an ulp or two
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    else:  # the float32 difference vanishes in the rounding to 16 bits
        assert torch.equal(x.grad, x_ref.grad)


def test_keeps_input_and_rstd_only():
    """bf16 [64, 64]: the input (8 KiB; measure_fwd_bwd counts it) and 64 float32 rstd;
    nn.RMSNorm on the CPU keeps two float32 copies of the input instead."""
    ref, ours = _pair(torch.bfloat16)
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    kept = measure_fwd_bwd(ours, x).kept_bytes
    assert kept == x.numel() * 2 + 64 * 4, kept
    assert measure_fwd_bwd(ref, x).kept_bytes == 2 * x.numel() * 4 + 64 * 4


def test_compiled_equals_eager():
    _, ours = _pair(torch.bfloat16)
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    x_c = x.detach().clone().requires_grad_()
    eager = ours(x)
    eager.float().sum().backward()
    grad_w = ours.weight.grad.clone()
    ours.weight.grad = None
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")(x_c)
    compiled.float().sum().backward()
    assert torch.equal(eager, compiled)
    assert torch.equal(x.grad, x_c.grad) and torch.equal(grad_w, ours.weight.grad)


def test_mixed_dtypes_and_no_grad_fall_back_to_nn_rmsnorm():
    ref, ours = _pair(torch.float32)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="Mismatch dtype"):  # torch's own, as with nn.RMSNorm
        assert torch.equal(ref(x), ours(x))  # fp32 weight, bf16 input: promoted by nn.RMSNorm
    with torch.no_grad():
        assert torch.equal(ref(x.float()), ours(x.float()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_normalize_gives_the_output_again_from_what_backward_keeps(dtype):
    """[Note: a norm output recomputed in backward]: ``fn(*tensors)`` is the output bit for bit,
    from tensors that are the input, the rstd backward keeps and the weight (no new bytes); none
    without grad."""
    _, ours = _pair(dtype)
    x = torch.randn(3, 8, 64, dtype=dtype, requires_grad=True) * 3
    out, (fn, tensors) = ours.normalize(x)
    assert torch.equal(out, ours(x)) and torch.equal(fn(*tensors), out)
    kept = {t.untyped_storage().data_ptr() for t in out.grad_fn.saved_tensors}
    assert {t.untyped_storage().data_ptr() for t in tensors} == kept
    with torch.no_grad():
        assert ours.normalize(x)[1] is None


def test_recompute_norm_output_is_a_bool():
    from f8dist import Float8LinearConfig

    with pytest.raises(TypeError, match="recompute_norm_output must be a bool"):
        Float8LinearConfig(recompute_norm_output=1)
