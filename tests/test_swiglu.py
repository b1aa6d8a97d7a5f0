import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from f8dist import Float8Linear, Float8LinearConfig, Float8Tensor
from f8dist.numerics import sqnr
from f8dist.swiglu import swiglu

H = 96


def _out_proj(on: bool, recipe="rowwise"):
    config = Float8LinearConfig.from_recipe_name(recipe).replace(float8_activations_for_backward=on)
    return Float8Linear.from_float(nn.Linear(H, 32, bias=False), config, fqn="ffn.w2")


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(2, 24, H, generator=g, dtype=torch.bfloat16) for _ in range(2))
    return gate.requires_grad_(), up.requires_grad_()


def _grads(fn, gate, up, grad):
    gate, up = (t.detach().clone().requires_grad_() for t in (gate, up))
    out = fn(gate, up)
    out.backward(grad)
    return out, gate.grad, up.grad


@pytest.mark.parametrize("out_proj", [None, nn.Linear(H, 32), "off"], ids=["none", "linear", "off"])
def test_without_the_option_it_is_silu_times_up(out_proj):
    out_proj = _out_proj(False) if out_proj == "off" else out_proj
    gate, up = _inputs()
    grad = torch.randn_like(gate)
    plain = _grads(lambda g, u: F.silu(g) * u, gate, up, grad)
    ours = _grads(lambda g, u: swiglu(g, u, out_proj), gate, up, grad)
    for a, b in zip(plain, ours):
        assert torch.equal(a, b)


def test_keeps_float8_gate_and_up_and_the_gradients_of_their_values():
    """[Note: SwiGLU's saved tensors]: two float8 tensors (e4m3, a scale per channel) instead of
    three bf16 ones; the gradients are autograd's on the values they stand for, bit for bit."""
    w2 = _out_proj(True)
    gate, up = _inputs()
    grad = torch.randn_like(gate)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = swiglu(gate, up, w2)
    assert [type(t) for t in saved] == [Float8Tensor, Float8Tensor]
    assert all(t._data.dtype == torch.float8_e4m3fn and t._scale.shape == (1, H) for t in saved)
    assert torch.equal(out, F.silu(gate) * up)  # the forward is untouched

    ours = _grads(lambda g, u: swiglu(g, u, w2), gate, up, grad)
    # the reference: autograd on the values the float8 tensors stand for
    g8, u8 = (t.to_original_precision().detach().requires_grad_() for t in saved)
    (F.silu(g8) * u8).backward(grad.view(-1, H))
    assert torch.equal(g8.grad, ours[1].view(-1, H)) and torch.equal(u8.grad, ours[2].view(-1, H))
    plain = _grads(lambda g, u: F.silu(g) * u, gate, up, grad)
    for a, b in zip(plain[1:], ours[1:]):  # against bf16's gradients: an e4m3 rounding
        assert 25 < sqnr(a, b) < 40


def test_no_grad_and_compiled():
    w2 = _out_proj(True)
    gate, up = _inputs()
    with torch.no_grad():
        assert torch.equal(swiglu(gate, up, w2), F.silu(gate) * up)
    torch._dynamo.reset()
    grad = torch.randn_like(gate)
    eager = _grads(lambda g, u: swiglu(g, u, w2), gate, up, grad)
    compiled = _grads(torch.compile(lambda g, u: swiglu(g, u, w2), fullgraph=True), gate, up, grad)
    for a, b in zip(eager, compiled):
        assert sqnr(a, b) > 40
