import copy

import pytest
import torch
import torch.nn as nn

from f8dist import (
    Float8Linear, Float8LinearConfig, convert_to_float8_training, sync_float8_amax_and_scale_history,
)
from f8dist.policy.delayed import delayed_scaling_counters
from f8dist.nn.grouped import (
    WEIGHTS, Float8GroupedExperts, GroupedExperts, float8_grouped_mm, grouped_mm,
)
from f8dist.config.cells import E2M1
from f8dist.core.cast import cast_to_float8, stochastic_rounding
from f8dist.core.numerics import sqnr
from tests.floors import NVFP4_FLOOR, exact_gemm_db, on_cpu

OFFSETS = torch.tensor([7, 7, 30, 48], dtype=torch.int32)  # expert 1 gets no token
RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]


def _operands(dtype=torch.bfloat16, m=48):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, 32, generator=g).to(dtype).requires_grad_()
    w = torch.randn(4, 16, 32, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(m, 16, generator=g).to(dtype)
    return x, w, grad


def _run(fn, x, w, grad, offsets=OFFSETS):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = fn(x, w, offsets)
    out.backward(grad.to(out.dtype))
    return out, x.grad, w.grad


@pytest.mark.parametrize("recipe", RECIPES)
def test_sqnr_per_gemm_against_the_high_precision_grouped_gemm(recipe):
    x, w, grad = _operands()
    specs = Float8LinearConfig.from_recipe_name(recipe).grouped_cast_specs("experts.w1")
    out, gx, gw = _run(lambda x, w, o: float8_grouped_mm(x, w, o, specs), x, w, grad)
    ref = _run(grouped_mm, x.float(), w.float(), grad.float())
    assert out.dtype == gx.dtype == gw.dtype == torch.bfloat16
    assert sqnr(ref[0], out) > 25 and sqnr(ref[1], gx) > 25
    assert sqnr(ref[2], gw) > (40 if recipe == "rowwise_with_gw_hp" else 25)
    assert torch.equal(gw[1], torch.zeros_like(gw[1]))  # the expert without tokens


def test_rowwise_equals_a_float8_linear_per_expert_bit_for_bit():
    """The grouped casts are the dense ones per expert: the same bytes, the same products."""
    x, w, grad = _operands()
    config = Float8LinearConfig.from_recipe_name("rowwise")
    specs = config.grouped_cast_specs("experts.w1")
    out, gx, gw = _run(lambda x, w, o: float8_grouped_mm(x, w, o, specs), x, w, grad)
    start = 0
    for e, end in enumerate(OFFSETS.tolist()):
        if start == end:
            continue
        lin = Float8Linear.from_float(nn.Linear(32, 16, bias=False), config)
        lin.weight = nn.Parameter(w[e].detach().clone())
        xe = x[start:end].detach().clone().requires_grad_()
        oe = lin(xe)
        oe.backward(grad[start:end])
        assert torch.equal(oe, out[start:end]) and torch.equal(xe.grad, gx[start:end])
        assert torch.equal(lin.weight.grad, gw[e])
        start = end


@pytest.mark.parametrize("m", [0, 3])
@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8", "nvfp4"])
@on_cpu  # block-scaled gemms have a CPU kernel only
def test_any_token_count(m, recipe):
    x, w, grad = _operands(m=m)
    offsets = torch.tensor([0, m, m, m], dtype=torch.int32)
    specs = Float8LinearConfig.from_recipe_name(recipe).grouped_cast_specs()
    out, gx, gw = _run(lambda x, w, o: float8_grouped_mm(x, w, o, specs), x, w, grad, offsets)
    ref = _run(grouped_mm, x.float(), w.float(), grad.float(), offsets)
    assert out.shape == (m, 16) and gx.shape == (m, 32)
    assert torch.equal(gw[0], torch.zeros_like(gw[0])) and torch.equal(gw[2:], torch.zeros_like(gw[2:]))
    if m:
        floor = NVFP4_FLOOR if recipe == "nvfp4" else 25
        assert sqnr(ref[0], out) > floor and sqnr(ref[2], gw) > floor


def run_experts(mod, x, groups, weights=("w1", "w2")):
    """(output, input grad, the ``weights``' grads) of an experts module on ``x`` and its token
    ``groups`` (offsets or counts, as the module takes), loss ``sum(out ** 2)``."""
    xi = x.clone().requires_grad_()
    out = mod(xi, groups)
    out.square().sum().backward()
    return (out, xi.grad, *(getattr(mod, w).grad.clone() for w in weights))


def _experts(dtype=torch.float32):
    experts = GroupedExperts(dim=32, hidden_dim=64, num_experts=4, dtype=dtype)
    experts.init_weights(0.02, torch.Generator().manual_seed(0))
    return experts


@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_experts_against_high_precision(recipe):
    ref = _experts()
    f8 = convert_to_float8_training(
        nn.ModuleDict({"experts": _experts()}), config=Float8LinearConfig.from_recipe_name(recipe)
    )["experts"]
    assert isinstance(f8, Float8GroupedExperts) and f8.fqn == "experts"
    x = torch.randn(48, 32, generator=torch.Generator().manual_seed(1))
    outs = [run_experts(mod, x, OFFSETS) for mod in (ref, f8)]
    for a, b in zip(*outs):
        assert sqnr(a, b) > 20
    assert torch.equal(f8.w2.grad[1], torch.zeros_like(f8.w2.grad[1]))


def test_conversion_follows_the_filter_and_keeps_the_state_dict():
    model = nn.ModuleDict({"experts": _experts(), "shared": nn.Linear(32, 32)})
    keys = set(model.state_dict())
    convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != "experts")
    assert type(model["experts"]) is GroupedExperts and isinstance(model["shared"], Float8Linear)
    convert_to_float8_training(model)
    assert isinstance(model["experts"], Float8GroupedExperts) and set(model.state_dict()) == keys
    assert model["experts"].specs["w2"]["output", "weight"].fqn == "experts.w2"
    convert_to_float8_training(model)  # again, same config: a no-op
    with pytest.raises(ValueError, match="already"):
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"))


def test_unaligned_experts_stay_high_precision_or_raise():
    experts = nn.ModuleDict({"e": GroupedExperts(dim=24, hidden_dim=64, num_experts=2)})
    convert_to_float8_training(experts)
    assert type(experts["e"]) is GroupedExperts
    with pytest.raises(ValueError, match="dim=24 \\(multiple of 16\\)"):
        convert_to_float8_training(experts, skip_incompatible=False)


def test_delayed_experts_keep_a_history_per_expert_weight_fqn():
    """[Note: delayed experts]: one e4m3 history per weight and operand, per tensor; the sync
    rolls them, the state dict holds them, a plain checkpoint loads (next step a first step)."""
    ref = _experts()
    model = convert_to_float8_training(nn.ModuleDict({"e": copy.deepcopy(ref)}),
                                       config=Float8LinearConfig.from_recipe_name("delayed"))
    f8 = model["e"]
    x = torch.randn(48, 32, generator=torch.Generator().manual_seed(1))
    for factor in (1.0, 0.75):  # a shrinking range: a delayed scale saturates nothing
        outs = [run_experts(mod, x * factor, OFFSETS, WEIGHTS) for mod in (ref, f8)]
        for a, b in zip(*outs):  # one scale for all experts' tokens, through three gemms
            assert sqnr(a, b) > 18
        sync_float8_amax_and_scale_history(model)
        ref.zero_grad(), f8.zero_grad()
    assert set(delayed_scaling_counters(model)) == {"e.w1", "e.w2", "e.w3"}
    w2 = f8.delayed_scaling["w2"]
    assert torch.equal(w2.fp8_amax_history_weight[:2], ref.w2.abs().amax().expand(2))
    assert w2.fp8_scale_weight == 448 / ref.w2.abs().amax()  # e4m3, not the recipe's e5m2
    amax = torch.stack([(x * f).abs().amax() for f in (0.75, 1.0)])  # newest first
    assert torch.equal(f8.delayed_scaling["w1"].fp8_amax_history_input[:2], amax)
    sd = model.state_dict()
    assert "e.delayed_scaling.w1.fp8_amax_history_grad_output" in sd
    plain = {k: v for k, v in sd.items() if "fp8" not in k}
    model.half()
    assert w2.fp8_scale_weight.dtype == torch.float32
    model.load_state_dict(plain)  # strict: the delayed state restarts
    assert w2.fp8_scale_weight == 1.0 and not w2.delayed.synced


def test_delayed_experts_without_any_token_record_no_data():
    """An expert layer whose experts get no token at all (an empty batch; under expert
    parallelism, a rank whose experts got none) records no token amax ([Note: no data] in
    f8dist/policy/delayed/state.py): the next steps are those of a layer that skipped that step (its weights,
    unchanged, record as always)."""
    config = Float8LinearConfig.from_recipe_name("delayed")
    model = convert_to_float8_training(nn.ModuleDict({"e": _experts()}), config=config)
    ref = copy.deepcopy(model)
    x = torch.randn(48, 32, generator=torch.Generator().manual_seed(1))
    run_experts(model["e"], x[:0], torch.zeros_like(OFFSETS), WEIGHTS)
    sync_float8_amax_and_scale_history(model)
    model.zero_grad()
    for factor in (1.0, 0.75):
        outs = [run_experts(mod["e"], x * factor, OFFSETS, WEIGHTS) for mod in (ref, model)]
        for a, b in zip(*outs):
            assert torch.equal(a, b)
        for mod in (ref, model):
            sync_float8_amax_and_scale_history(mod)
            mod.zero_grad()
    ref_sd = ref.state_dict()
    assert all(torch.equal(v, ref_sd[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("kind", ["plain", "float8"])
def test_delayed_experts_built_on_meta_load_with_assign(kind):
    """load_state_dict(sd, assign=True) into delayed experts built on meta gives the delayed
    buffers that ``sd`` lacks fresh on the weights' device (they stayed on meta)."""
    config = Float8LinearConfig.from_recipe_name("delayed")
    ref = convert_to_float8_training(nn.ModuleDict({"e": _experts()}), config=config)
    x = torch.randn(48, 32, generator=torch.Generator().manual_seed(1))
    if kind == "float8":
        run_experts(ref["e"], x, OFFSETS, WEIGHTS)
        sync_float8_amax_and_scale_history(ref)
        ref.zero_grad()
    sd = copy.deepcopy({k: v for k, v in ref.state_dict().items() if kind == "float8" or "fp8" not in k})
    with torch.device("meta"):
        model = convert_to_float8_training(
            nn.ModuleDict({"e": GroupedExperts(dim=32, hidden_dim=64, num_experts=4)}), config=config)
    model.load_state_dict(sd, assign=True)
    assert not [name for name, b in model.named_buffers() if b.is_meta]
    outs = [run_experts(mod["e"], x * 0.75, OFFSETS, WEIGHTS) for mod in (ref, model)]
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    for mod in (ref, model):
        sync_float8_amax_and_scale_history(mod)
    ref_sd = ref.state_dict()
    assert all(torch.equal(v, ref_sd[k]) for k, v in model.state_dict().items())


def test_e5m2_is_refused_for_experts_with_what_to_do():
    from f8dist.config import CastConfig, E5M2
    config = Float8LinearConfig(cast_config_grad_output=CastConfig(target_dtype=E5M2))
    with pytest.raises(ValueError, match="e4m3 operands only"):
        config.grouped_cast_specs("e")


BLOCK_RECIPES = ["mxfp8", "mxfp8_wgrad_with_hp", "mxfp8_square_weights", "blockwise"]


def _block_operands(recipe):
    """bf16 operands whose dims divide into ``recipe``'s blocks (128 for DeepSeek's)."""
    k, n = (128, 256) if recipe == "blockwise" else (32, 64)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, k, generator=g).bfloat16()
    w = torch.randn(4, n, k, generator=g).bfloat16()
    return x, w, torch.randn(48, n, generator=g).bfloat16()


@pytest.mark.parametrize("recipe", BLOCK_RECIPES)
@on_cpu  # block-scaled gemms have a CPU kernel only
def test_block_grouped_gemm_is_a_block_scaled_float8_linear_per_expert_bit_for_bit(recipe):
    """[Note: block grouped gemms]: groups of 7 and 23 tokens (not multiples of the blocks, one
    empty) give, per expert, the dense block-scaled gemms of a Float8Linear on its tokens."""
    x, w, grad = _block_operands(recipe)
    config = Float8LinearConfig.from_recipe_name(recipe)
    specs = config.grouped_cast_specs("experts.w1")
    out, gx, gw = _run(lambda x, w, o: float8_grouped_mm(x, w, o, specs), x, w, grad)
    ref = _run(grouped_mm, x.float(), w.float(), grad.float())
    floor = 50 if recipe == "mxfp8_wgrad_with_hp" else 25
    assert sqnr(ref[0], out) > 25 and sqnr(ref[1], gx) > 25 and sqnr(ref[2], gw) > floor
    assert torch.equal(gw[1], torch.zeros_like(gw[1]))  # the expert without tokens
    start = 0
    for e, end in enumerate(OFFSETS.tolist()):
        if start == end:
            continue
        lin = Float8Linear.from_float(nn.Linear(w.shape[2], w.shape[1], bias=False), config)
        lin.weight = nn.Parameter(w[e].clone())
        xe = x[start:end].clone().requires_grad_()
        oe = lin(xe)
        oe.backward(grad[start:end])
        assert torch.equal(oe, out[start:end]) and torch.equal(xe.grad, gx[start:end])
        assert torch.equal(lin.weight.grad, gw[e])
        start = end




@on_cpu  # [Note: the NVFP4 gemm] in f8dist/core/gemm.py: the CPU kernel or emulation
def test_nvfp4_grouped_gemms_sqnr_and_emulation():
    """The "nvfp4" recipe on experts: 1x16 tokens and gradients, 16x16 expert weights, groups of
    7, 0, 23 and 18 tokens (the grad_weight gemm pads them to 16); each gemm above e2m1's floor
    against high precision, and its CPU kernel its emulation's but for float32 sums."""
    x, w, grad = _operands(torch.float32)
    config = Float8LinearConfig.from_recipe_name("nvfp4")
    specs = config.grouped_cast_specs("experts.w1")
    assert specs["output", "input"].dtype == specs["output", "weight"].dtype == E2M1
    emu = config.replace(emulate=True).grouped_cast_specs("experts.w1")
    stochastic_rounding.reset()  # both draw alike ([Note: the stochastic rounding key])
    out = _run(lambda x, w, o: float8_grouped_mm(x, w, o, specs), x, w, grad)
    ref = _run(grouped_mm, x, w, grad)
    stochastic_rounding.reset()
    for r, a, e in zip(ref, out, _run(lambda x, w, o: float8_grouped_mm(x, w, o, emu), x, w, grad)):
        assert sqnr(r, a) > NVFP4_FLOOR and sqnr(e, a) > exact_gemm_db()
    assert torch.equal(out[2][1], torch.zeros_like(out[2][1]))  # the expert without tokens


@on_cpu
def test_nvfp4_experts_round_their_gradients_stochastically():
    """The "nvfp4" recipe's gradient casts round stochastically in experts too ([Note: positions
    in token groups] in f8dist/core/scaling.py): a seed draws alike every time, another seed
    otherwise."""
    specs = Float8LinearConfig.from_recipe_name("nvfp4").grouped_cast_specs("experts.w1")
    x, w, grad = _operands(torch.float32)

    def grads(seed):
        stochastic_rounding.reset(seed)
        return _run(lambda x, w, o: float8_grouped_mm(x, w, o, specs), x, w, grad)[1:]

    try:
        first, again, other = grads(1), grads(1), grads(2)
    finally:
        stochastic_rounding.reset()
    for a, b, c in zip(first, again, other):
        assert torch.equal(a, b) and not torch.equal(a, c)


def test_block_grouped_casts_block_each_expert_apart():
    """A weight's blocks never span two experts, the tokens' grad_weight blocks never two groups."""
    specs = Float8LinearConfig.from_recipe_name("mxfp8_square_weights").grouped_cast_specs("e")
    w = torch.randn(3, 48, 32)  # 48 rows: the 32x32 blocks of each expert end at its edge
    w8 = cast_to_float8(w, specs["output", "weight"])
    assert w8._scale.shape == (3, 2, 1) and w8._block == (1, 32, 32)
    for e in range(3):
        one = cast_to_float8(w[e], Float8LinearConfig.from_recipe_name(
            "mxfp8_square_weights").cast_spec("output", "weight"))
        assert torch.equal(w8._data[e].view(torch.uint8), one._data.view(torch.uint8))
        assert torch.equal(w8._scale[e].view(torch.uint8), one._scale.view(torch.uint8))
    assert torch.equal(w8.to_original_precision()[1], w8._data[1].float() / w8._scale[1].float()
                       .repeat_interleave(32, 0)[:48].repeat_interleave(32, 1))


def test_block_recipes_need_expert_dims_that_divide_into_their_blocks():
    experts = nn.ModuleDict({"e": GroupedExperts(dim=64, hidden_dim=96, num_experts=2)})
    config = Float8LinearConfig.from_recipe_name("blockwise")
    convert_to_float8_training(experts, config=config)  # skipped: 64, 96 are no blocks of 128
    assert type(experts["e"]) is GroupedExperts
    with pytest.raises(ValueError, match="dim=64 \\(block 128\\)"):
        convert_to_float8_training(experts, config=config, skip_incompatible=False)
    convert_to_float8_training(experts, config=Float8LinearConfig.from_recipe_name("mxfp8"))
    assert isinstance(experts["e"], Float8GroupedExperts)  # 64 and 96 divide into 32


@pytest.mark.parametrize("recipe", ["rowwise"])  # mxfp8 too, but its compile takes 2 min
def test_compiled_float8_experts_give_eagers_bits(recipe):
    """fullgraph: the grouped kernel is one custom op, the casts and padding trace."""
    torch._dynamo.reset()
    experts = convert_to_float8_training(
        nn.ModuleDict({"e": _experts()}), config=Float8LinearConfig.from_recipe_name(recipe))["e"]
    x = torch.randn(48, 32, generator=torch.Generator().manual_seed(1))
    eager = run_experts(experts, x, OFFSETS)
    experts.zero_grad(set_to_none=True)
    compiled = torch.compile(experts, fullgraph=True)
    for a, b in zip(eager, run_experts(compiled, x, OFFSETS)):
        assert torch.equal(a, b)


@on_cpu  # block-scaled gemms have a CPU kernel only
def test_mxfp8_grouped_gemm_matches_torchaos_emulated_one():
    """torchao 0.18's emulated MXFP8 grouped gemm (torchao.prototype.moe_training) on the same
    tensors: bit for bit with groups of whole 32-token blocks (docs/moe.md has larger figures)."""
    mx = pytest.importorskip("torchao.prototype.moe_training.mxfp8_grouped_mm")
    from torchao.prototype.moe_training.config import KernelPreference

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(128, 64, generator=g).bfloat16(), torch.randn(4, 64, 64, generator=g).bfloat16()
    grad = torch.randn(128, 64, generator=g).bfloat16()
    offsets = torch.tensor([32, 32, 96, 128], dtype=torch.int32)  # an expert without tokens
    specs = Float8LinearConfig.from_recipe_name("mxfp8").grouped_cast_specs()
    ours = _run(lambda a, b, o: float8_grouped_mm(a, b, o, specs), x, w, grad, offsets)
    theirs = _run(lambda a, b, o: mx._to_mxfp8_then_scaled_grouped_mm(
        a, b.transpose(-2, -1), o, out_dtype=torch.bfloat16,
        kernel_preference=KernelPreference.EMULATED), x, w, grad, offsets)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b), sqnr(b, a)


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_experts_built_on_meta_run_a_shape_only_step(recipe):
    # a model built on meta (torchtitan) may run a forward there: autocast, which has no meta
    # backend, raised, and the gemms took meta for CUDA
    with torch.device("meta"):
        model = convert_to_float8_training(
            nn.ModuleDict({"e": GroupedExperts(dim=32, hidden_dim=64, num_experts=2)}),
            config=Float8LinearConfig.from_recipe_name(recipe))
        x = torch.randn(32, 32, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model["e"](x, torch.tensor([16, 32], dtype=torch.int32))
    assert isinstance(model["e"], Float8GroupedExperts)
    assert (out.device.type, out.shape, out.dtype) == ("meta", (32, 32), torch.float32)
    out.sum().backward()
    assert x.grad.shape == x.shape and model["e"].w1.grad.is_meta


# [Note: options of grouped experts]: each option a linear only implements, in a config that
# allows it
LINEAR_ONLY = {
    "axiswise_requantize_input_for_grad_weight": ("rowwise", {}),
    "float8_activations_for_backward": ("tensorwise", {}),
    "recompute_swiglu_product": ("tensorwise", {"float8_activations_for_backward": True}),
    "recompute_norm_output": ("tensorwise", {}),
    "float8_weight_for_backward": ("tensorwise", {}),
}


def _is_experts(mod, fqn):
    return isinstance(mod, GroupedExperts)


def test_every_linear_only_option_is_tested():
    from f8dist.nn.grouped import LINEAR_ONLY_OPTIONS
    assert set(LINEAR_ONLY) == set(LINEAR_ONLY_OPTIONS)


@pytest.mark.parametrize("option", LINEAR_ONLY)
def test_an_option_experts_do_not_implement_is_refused_naming_the_fix(option):
    recipe, also = LINEAR_ONLY[option]
    config = Float8LinearConfig.from_recipe_name(recipe).replace(**{option: True, **also})
    model = nn.ModuleDict({"experts": _experts()})
    with pytest.raises(ValueError, match=rf"experts: .*{option}=True is implemented for "
                                         rf"Float8Linear only.*{option}=False.*module_filter_fn"):
        convert_to_float8_training(model, config=config)
    assert type(model["experts"]) is GroupedExperts  # all or nothing


def test_linears_and_experts_convert_with_two_configs_in_two_calls():
    """The fix the refusal names: the linears with their options, the experts without."""
    from f8dist.core import agreement
    config = Float8LinearConfig(float8_activations_for_backward=True,
                                float8_weight_for_backward=True)
    experts_config = config.replace(float8_activations_for_backward=False,
                                    float8_weight_for_backward=False)
    model = nn.ModuleDict({"experts": _experts(), "out": nn.Linear(32, 32, bias=False)})
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda mod, fqn: not _is_experts(mod, fqn))
    convert_to_float8_training(model, config=experts_config, module_filter_fn=_is_experts)
    assert model["out"].config is config and model["experts"].config is experts_config
    settings = agreement.settings(model)  # what the ranks compare, per module
    assert settings["out", "float8_weight_for_backward"] == "True"
    assert settings["experts", "float8_weight_for_backward"] == "False"
    x = torch.randn(48, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    model["out"](model["experts"](x, OFFSETS)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    convert_to_float8_training(model, config=experts_config, module_filter_fn=_is_experts)
    with pytest.raises(ValueError, match="experts: already a Float8GroupedExperts.*"
                                         "float8_activations_for_backward"):
        convert_to_float8_training(model, config=config)


def test_pad_inner_dim_does_not_pad_experts_and_says_so():
    model = nn.ModuleDict({"e": GroupedExperts(dim=24, hidden_dim=64, num_experts=2)})
    with pytest.raises(ValueError, match=r"e: pad_inner_dim=True pads a Float8Linear's dims, not "
                                         r"grouped experts' \(dim 24.*module_filter_fn"):
        convert_to_float8_training(model, config=Float8LinearConfig(pad_inner_dim=True))


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "mxfp8_square_weights", "blockwise"])
def test_float8_all_gather_wraps_expert_weights_of_every_recipe_that_takes_it(recipe, caplog):
    """[Note: float8 all-gather of expert weights]: the experts' weights gather in float8 like
    the linears' of the same config, without a warning."""
    from f8dist.core.weight import Float8AllGatherWeight
    dim = 128 if recipe == "blockwise" else 32
    config = Float8LinearConfig.from_recipe_name(recipe).replace(
        enable_fsdp_float8_all_gather=True)
    model = nn.ModuleDict({"moe": nn.ModuleDict({
        "experts": GroupedExperts(dim=dim, hidden_dim=dim, num_experts=2, device="meta"),
        "shared": nn.Linear(dim, dim, device="meta")})})
    with caplog.at_level("WARNING", logger="f8dist.nn.convert"):
        convert_to_float8_training(model, config=config)
    experts = model["moe"]["experts"]
    assert isinstance(model["moe"]["shared"].weight, Float8AllGatherWeight)
    assert all(isinstance(getattr(experts, w), Float8AllGatherWeight) for w in ("w1", "w2", "w3"))
    assert "high precision" not in caplog.text
