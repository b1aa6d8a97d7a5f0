"""float8_sac_context_fn: what it saves, that recompute is exact, and the seed-004 regression."""

import copy
from functools import lru_cache, partial

import pytest
import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from f8dist import Float8LinearConfig, convert_to_float8_training
from f8dist.core.cast import stochastic_rounding
from f8dist.testing import measure_fwd_bwd
from f8dist.models.llama import FeedForward, ModelArgs
from f8dist.policy.sac import Float8SACConfig, float8_sac_context_fn, float8_sac_policy
from tests.floors import on_cpu

aten = torch.ops.aten
ARGS = ModelArgs(dim=64, n_heads=4)


def make_ffn(recipe):
    torch.manual_seed(0)
    ffn = FeedForward(ARGS.dim, ARGS.ffn_hidden_dim).to(torch.bfloat16)
    if recipe != "bf16":
        convert_to_float8_training(ffn, config=Float8LinearConfig.from_recipe_name(recipe))
    return ffn, torch.randn(2, 32, ARGS.dim, dtype=torch.bfloat16)


def recording_context_fn(config=None, extra_ops=()):
    """The float8 policy, recording its forward decisions; ``extra_ops`` are forced saved
    (bypassing Float8SACConfig's validation, to build the broken policy of seed 004)."""
    decisions = []

    def context_fn():
        policy = float8_sac_policy(config)

        def recorded(ctx, op, *args, **kwargs):
            decision = policy(ctx, op, *args, **kwargs)
            if op in extra_ops:
                decision = torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
            if not ctx.is_recompute:
                decisions.append((op, decision.name))
            return decision

        return create_selective_checkpoint_contexts(recorded)

    return context_fn, decisions


def test_policy_saves_matmuls_and_amax_never_pointwise():
    ffn, x = make_ffn("rowwise")
    context_fn, decisions = recording_context_fn()
    checkpoint(ffn, x.requires_grad_(), use_reentrant=False, context_fn=context_fn)
    saved = [op for op, d in decisions if d == "MUST_SAVE"]
    mms = [d for op, d in decisions if op is aten.mm.default]
    assert mms == ["MUST_SAVE", "PREFER_RECOMPUTE", "MUST_SAVE"]  # every other matmul
    assert saved.count(aten.amax.default) == 6  # input and weight of each of the 3 linears
    assert all(torch.Tag.pointwise not in op.tags for op in saved), saved
    assert any(op is aten.abs.default for op, _ in decisions)  # the casts ran under the policy


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "nvfp4"])
def test_sac_recompute_is_exact(recipe):
    """Full activation checkpointing and the float8 policy recompute the casts bit for bit."""
    ffn, x = make_ffn(recipe)
    grads = []
    for ac in (None, {}, dict(context_fn=float8_sac_context_fn)):  # none, full, per-op
        model = copy.deepcopy(ffn)
        stochastic_rounding.reset()  # each run draws alike (docs/design.md, NVFP4)
        xi = x.clone().requires_grad_()
        out = model(xi) if ac is None else checkpoint(model, xi, use_reentrant=False, **ac)
        out.float().square().sum().backward()
        grads.append([xi.grad] + [p.grad for p in model.parameters()])
    for g in grads[1:]:
        for a, b in zip(grads[0], g):
            assert torch.equal(a, b)


def test_saving_abs_breaks_the_bound_and_ours_does_not():
    """Seed 004: a policy that also saves ``abs`` keeps |x| and |W| (as large as the weight) for
    backward; float8 then keeps more than bf16. Our policy keeps no more (scales aside)."""
    bf16, x = make_ffn("bf16")
    bound = measure_fwd_bwd(bf16, x, context_fn=float8_sac_context_fn).kept_bytes
    for recipe in ("tensorwise", "rowwise"):
        ffn, _ = make_ffn(recipe)
        ours = measure_fwd_bwd(ffn, x, context_fn=float8_sac_context_fn)
        assert ours.activation_bytes <= bound
        with_abs, _ = recording_context_fn(extra_ops=(aten.abs.default,))
        broken = measure_fwd_bwd(ffn, x, context_fn=with_abs)
        weights = sum(p.numel() * p.element_size() for p in ffn.parameters())
        assert broken.activation_bytes > bound
        assert broken.kept_by_op["aten.abs.default"] >= weights  # |W| of every weight


def test_recompute_every_nth_mm_trades_memory():
    ffn, x = make_ffn("tensorwise")
    kept = {
        n: measure_fwd_bwd(
            ffn, x,
            context_fn=partial(float8_sac_context_fn, Float8SACConfig(recompute_every_nth_mm=n)),
        ).kept_bytes
        for n in (None, 2, 1)
    }
    assert kept[None] > kept[2] > kept[1]


def test_config_rejects_pointwise_ops_and_bad_values():
    with pytest.raises(ValueError, match="pointwise"):
        Float8SACConfig(extra_ops_to_save=(aten.abs.default,))
    with pytest.raises(TypeError, match="overload"):
        Float8SACConfig(extra_ops_to_save=(aten.bmm,))
    with pytest.raises(ValueError, match="positive int"):
        Float8SACConfig(recompute_every_nth_mm=0)
    with pytest.raises(ValueError, match="amax_min_reduction must be a positive int"):
        Float8SACConfig(amax_min_reduction=0)
    with pytest.raises(TypeError, match="Float8SACConfig"):
        float8_sac_context_fn({"recompute_every_nth_mm": 2})
    assert aten.bmm.default in Float8SACConfig(extra_ops_to_save=(aten.bmm.default,)).ops_to_save()


@lru_cache(maxsize=None)
def compiled_sac_saved_bytes(recipe):
    """What compiled SAC keeps of ``make_ffn(recipe)``, compiled once per recipe for every test
    that compares against it (bf16: three)."""
    from f8dist.testing import compiled_saved_bytes

    ffn, x = make_ffn(recipe)
    return compiled_saved_bytes(ffn, x, context_fn=float8_sac_context_fn)


def test_compiled_sac_keeps_no_more_than_bf16():
    """Under torch.compile the policy sees the same ops (``mm`` of Float8Tensors, amax) and
    AOTAutograd's partitioner applies it: float8 saves no more than bf16 for backward."""
    saved = {recipe: compiled_sac_saved_bytes(recipe) for recipe in ("bf16", "tensorwise", "rowwise")}
    assert saved["bf16"] > 0
    assert saved["tensorwise"] <= saved["bf16"] and saved["rowwise"] <= saved["bf16"], saved


@on_cpu  # CUDA runs block-scaled gemms on sm90 or sm100+ only (tests/floors.py)
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_square_weights"])
def test_block_scaled_recipes_under_sac(recipe):
    """The policy saves the block-scaled gemms and the amaxes of blocks of 64 or more elements
    (32x32 weight blocks; not 1x32 blocks: [Note: which amaxes SAC saves]; with
    ``amax_min_reduction=1`` every block amax), never a pointwise op; recompute is exact either
    way, and eager and compiled SAC keep no more than bf16 (scales aside)."""
    ffn, x = make_ffn(recipe)
    all_amaxes = partial(float8_sac_context_fn, Float8SACConfig(amax_min_reduction=1))
    for config, amaxes in ((None, 0 if recipe == "mxfp8" else 3),  # 32x32 blocks: 3 weights
                           (Float8SACConfig(amax_min_reduction=1), 6)):  # input and weight, x3
        context_fn, decisions = recording_context_fn(config)
        checkpoint(ffn, x.clone().requires_grad_(), use_reentrant=False, context_fn=context_fn)
        mms = [d for op, d in decisions if op is aten.mm.default]
        assert mms == ["MUST_SAVE", "PREFER_RECOMPUTE", "MUST_SAVE"]
        saved = [op for op, d in decisions if d == "MUST_SAVE"]
        assert saved.count(aten.amax.default) == amaxes, config
        assert all(torch.Tag.pointwise not in op.tags for op in saved), saved

    grads = []
    for context_fn in (None, float8_sac_context_fn, all_amaxes):
        model, xi = copy.deepcopy(ffn), x.clone().requires_grad_()
        out = model(xi) if context_fn is None else checkpoint(
            model, xi, use_reentrant=False, context_fn=context_fn)
        out.float().square().sum().backward()
        grads.append([xi.grad] + [p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for g in grads[1:] for a, b in zip(grads[0], g))

    bf16, _ = make_ffn("bf16")
    bound = measure_fwd_bwd(bf16, x, context_fn=float8_sac_context_fn).kept_bytes
    ours = measure_fwd_bwd(ffn, x, context_fn=float8_sac_context_fn)
    assert ours.activation_bytes <= bound
    assert ours.kept_bytes <= bound or recipe != "mxfp8", ours.kept_by_op  # no amax kept at all
    compiled = [compiled_sac_saved_bytes(r) for r in ("bf16", recipe)]  # of bf16 and of ffn
    assert compiled[1] <= compiled[0], compiled
