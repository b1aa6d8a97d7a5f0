import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from f8dist import Float8Linear, Float8LinearConfig, Float8Tensor
from f8dist.core.numerics import sqnr
from f8dist.core.cast import cast_to_float8
from f8dist.nn.swiglu import swiglu

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


# -- recompute_swiglu_product: [Note: a product recomputed in backward] ---------------------------


def _ffn_parts(recipe, recompute):
    config = Float8LinearConfig.from_recipe_name(recipe).replace(
        float8_activations_for_backward=True, recompute_swiglu_product=recompute)
    torch.manual_seed(0)
    return Float8Linear.from_float(nn.Linear(H, 32, bias=False).to(torch.bfloat16), config,
                                   fqn="ffn.w2")


def _ffn_grads(w2, gate, up, grad):
    from f8dist.nn.swiglu import swiglu_for

    gate, up = (t.detach().clone().requires_grad_() for t in (gate, up))
    product, kwargs = swiglu_for(gate, up, w2)
    out = w2(product, **kwargs)
    out.backward(grad)
    grads = out, gate.grad, up.grad, w2.weight.grad
    w2.weight.grad = None
    return grads


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"])
def test_recomputed_product_gives_w2_the_gradient_of_the_float8_product(recipe):
    """w2's forward, its input gradient and SwiGLU's gradients are those without the option; its
    weight gradient is, bit for bit, what w2 gives when handed silu(gate8) * up8; nothing of its
    input is kept beside SwiGLU's two float8 tensors."""
    from f8dist.nn.swiglu import float8_product
    from f8dist.testing import graph_saved_tensors

    gate, up = _inputs()
    grad = torch.randn(2, 24, 32, dtype=torch.bfloat16)
    on, off = _ffn_parts(recipe, True), _ffn_parts(recipe, False)
    ours, plain = _ffn_grads(on, gate, up, grad), _ffn_grads(off, gate, up, grad)
    for a, b in zip(ours[:3], plain[:3]):
        assert torch.equal(a, b)
    spec = on.specs.activation
    gate8, up8 = (cast_to_float8(t.detach().reshape(-1, H), spec) for t in (gate, up))
    ref = _ffn_grads(off, gate, up, grad)  # w2 handed the float8 product:
    h = float8_product(gate8, up8).reshape(gate.shape).requires_grad_()
    off(h).backward(grad)
    assert torch.equal(off.weight.grad, ours[3]) and not torch.equal(ref[3], ours[3])
    assert sqnr(plain[3], ours[3]) > 25  # one more e4m3 rounding inside it

    from f8dist.nn.swiglu import swiglu_for
    product, kwargs = swiglu_for(gate, up, on)
    saved = graph_saved_tensors(on(product, **kwargs).grad_fn)
    hidden = {id(t) for t in saved if t.shape == (48, H)}  # [M, H]: the two float8 tensors
    assert len(hidden) == 2 and all(isinstance(t, Float8Tensor) for t in saved if id(t) in hidden)


def test_recomputed_product_compiled_matches_eager():
    torch._dynamo.reset()
    gate, up = _inputs()
    grad = torch.randn(2, 24, 32, dtype=torch.bfloat16)
    w2 = _ffn_parts("rowwise", True)
    eager = _ffn_grads(w2, gate, up, grad)

    from f8dist.nn.swiglu import swiglu_for

    def ffn(g, u):
        product, kwargs = swiglu_for(g, u, w2)
        return w2(product, **kwargs)

    compiled_ffn = torch.compile(ffn, fullgraph=True)
    g, u = (t.detach().clone().requires_grad_() for t in (gate, up))
    out = compiled_ffn(g, u)
    out.backward(grad)
    # inductor computes the bf16 product in float32 (as in test_no_grad_and_compiled)
    for a, b in zip(eager, (out, g.grad, u.grad, w2.weight.grad)):
        assert sqnr(a, b) > 40


def test_recompute_needs_float8_activations():
    with pytest.raises(ValueError, match="float8_activations_for_backward=True"):
        Float8LinearConfig(recompute_swiglu_product=True)


def test_recompute_under_tensor_parallelism():
    """A rowwise-parallel w2 reads its Shard(-1) input as the local product of the column-parallel
    w1 and w3 ([Note: a recomputed input] in f8dist/nn/linear.py): backward recomputes it from the
    local float8 gate and up and lays it out as the forward's input was, so each rank's gradients
    are those of a one-device w2 holding its weight shard (fake process group, rank 0 of 2). A
    plan that hands w2 other local values (a slice of a replicated input) raises in backward."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from f8dist.parallel.tp import Float8RowwiseParallel

    gate, up = (t[..., : H // 2] for t in _inputs())  # rank 0's channels
    grad = torch.randn(2, 24, 32, dtype=torch.bfloat16)
    local = _ffn_parts("rowwise", True)
    local.weight = nn.Parameter(local.weight.detach()[:, : H // 2].clone())  # rank 0's shard
    want = _ffn_grads(local, gate, up, grad)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        w2 = parallelize_module(_ffn_parts("rowwise", True), mesh, Float8RowwiseParallel())
        got = _ffn_grads(w2, gate, up, grad)
        for a, b in zip(want, got):
            assert torch.equal(a, getattr(b, "_local_tensor", b))
        split = parallelize_module(  # whole gate and up: w2 reads a slice of their product
            _ffn_parts("rowwise", True), mesh, Float8RowwiseParallel(input_layouts=Replicate()))
        with pytest.raises(RuntimeError, match="turn the option off for this plan"):
            _ffn_grads(split, *_inputs(), grad)
    finally:
        dist.destroy_process_group()
