import math

import pytest
import torch

from f8dist import Float8Linear, Float8LinearConfig, convert_to_float8_training
from f8dist.nn.grouped import Float8GroupedExperts, GroupedExperts
from f8dist.models.llama import ModelArgs
from f8dist.models.moe import MoE, MoEArgs, MoETransformer, load_balancing_loss
from f8dist.core.numerics import sqnr


def _moe(**kw):
    moe = MoE(32, 64, MoEArgs(num_experts=4, **kw))
    moe.init_weights(0.02, torch.Generator().manual_seed(0))
    return moe


def _loop_reference(moe, x):
    """Routing and experts spelled out token by token ([Note: routing])."""
    xf = x.reshape(-1, x.shape[-1])
    top, experts, _ = moe.router(xf)
    e = moe.args.num_experts
    capacity = math.inf
    if moe.args.capacity_factor is not None:
        capacity = math.ceil(moe.args.capacity_factor * experts.numel() / e)
    taken = [0] * e
    out = torch.zeros_like(xf)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    for t in range(xf.shape[0]):
        for j in range(moe.args.top_k):
            ex = int(experts[t, j])
            taken[ex] += 1
            if taken[ex] > capacity:
                continue
            h = torch.nn.functional.silu(xf[t] @ w1[ex].t()) * (xf[t] @ w3[ex].t())
            out[t] += top[t, j] * (h @ w2[ex].t())
    if moe.shared_expert is not None:
        out = out + moe.shared_expert(xf)
    return out.reshape(x.shape)


@pytest.mark.parametrize("top_k,capacity_factor", [(1, None), (2, None), (2, 0.5)])
def test_routing_matches_a_token_by_token_loop(top_k, capacity_factor):
    """Capacity overflow drops the later assignments of an expert, in token order."""
    moe = _moe(top_k=top_k, capacity_factor=capacity_factor)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, ref = moe(x), _loop_reference(moe, x)
    assert sqnr(ref, out) > 100
    if capacity_factor is not None:  # something was dropped: differs from the uncapped layer
        uncapped = _moe(top_k=top_k)
        uncapped.load_state_dict(moe.state_dict())
        assert sqnr(uncapped(x), out) < 60


def test_load_balancing_loss_is_one_when_balanced_and_the_router_learns_from_it():
    scores = torch.full((8, 4), 0.25)
    experts = torch.arange(8).remainder(4)[:, None]
    assert load_balancing_loss(scores, experts).item() == pytest.approx(1.0)
    moe = _moe(top_k=2)
    moe(torch.randn(1, 8, 32))
    moe.aux_loss.backward()
    assert moe.router.gate.grad.abs().sum() > 0


def test_conversion_keeps_the_router_in_high_precision():
    model = MoETransformer(ModelArgs(dim=32, n_layers=1, n_heads=2, max_seq_len=8),
                           MoEArgs(num_experts=4, top_k=2))
    model.init_weights(seed=0)
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    ref = model(tokens)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"))
    moe = model.layers["0"].moe
    assert isinstance(moe.experts, Float8GroupedExperts) and moe.experts.fqn == "layers.0.moe.experts"
    assert isinstance(moe.shared_expert.w1, Float8Linear)
    assert type(moe.router.gate) is torch.nn.Parameter
    out = model(tokens)
    assert sqnr(ref, out) > 20
    (out.float().logsumexp(-1).mean() + model.aux_loss()).backward()
    assert moe.experts.w1.grad is not None and moe.router.gate.grad is not None


def test_moe_args_say_what_is_wrong():
    with pytest.raises(ValueError, match="top_k"):
        MoEArgs(num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="capacity_factor"):
        MoEArgs(capacity_factor=0)


@pytest.mark.parametrize("recipe", [None, "rowwise", "tensorwise"])
def test_an_empty_batch_and_a_nan_token(recipe):
    """No token: an empty output and zero gradients; a NaN token turns its own output row
    non-finite (per-token scales) or all rows (tensorwise: one scale per expert), never a
    silently finite number ([Note: non-finite values] in f8dist/core/scaling.py)."""
    moe = _moe(top_k=2)
    if recipe is not None:
        convert_to_float8_training(moe, config=Float8LinearConfig.from_recipe_name(recipe))
    x = torch.randn(1, 0, 32, requires_grad=True)
    out = moe(x)
    out.sum().backward()
    assert out.shape == (1, 0, 32) and torch.equal(moe.experts.w1.grad, torch.zeros_like(moe.experts.w1.grad))
    x = torch.randn(1, 8, 32)
    x[0, 3, 5] = float("nan")
    out = moe(x)
    assert not torch.isfinite(out[0, 3]).any()
    finite_rows = torch.isfinite(out[0]).all(-1)
    assert finite_rows.sum() == (0 if recipe == "tensorwise" else 7)


def test_recompute_norm_output_takes_effect_in_moe_blocks():
    """The MoE blocks' norms are f8dist's RMSNorm (which keeps input and rstd, not float32
    copies), so recompute_norm_output applies as in the dense blocks: wq/wk/wv and the shared
    expert's w1/w3 keep nothing of the norms' outputs, the gradients bit for bit those without
    it."""
    from f8dist.models.norm import RMSNorm
    from f8dist.testing import measure_fwd_bwd

    args = ModelArgs(dim=64, n_layers=1, n_heads=4, max_seq_len=16)
    models = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = MoETransformer(args, MoEArgs(num_experts=4, top_k=2))
        model.init_weights(seed=0)
        config = Float8LinearConfig.from_recipe_name("rowwise").replace(
            float8_activations_for_backward=True, recompute_norm_output=recompute)
        # the experts keep their own way ([Note: options of grouped experts]): a call of their own
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, f: (
            f != "output" and not isinstance(m, GroupedExperts)))
        convert_to_float8_training(
            model, config=config.replace(float8_activations_for_backward=False,
                                         recompute_norm_output=False),
            module_filter_fn=lambda m, f: isinstance(m, GroupedExperts))
        models.append(model)
    block = models[1].layers["0"]
    assert isinstance(block.attention_norm, RMSNorm) and isinstance(block.ffn_norm, RMSNorm)
    x = torch.randn(2, 16, args.dim, generator=torch.Generator().manual_seed(1))
    kept = [measure_fwd_bwd(m.layers["0"], x, m.rope).kept_bytes for m in models]
    normed = x.numel()  # one float8 byte per element of a norm output
    assert kept[0] - kept[1] >= 2 * normed, kept  # attention's and the shared expert's copies
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    grads = []
    for m in models:
        m.zero_grad()
        m(tokens).float().square().mean().backward()
        grads.append([p.grad for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
