import dataclasses

import pytest
import torch

from f8dist import (
    CastConfig,
    DelayedScalingConfig,
    Float8LinearConfig,
    ScalingGranularity,
    ScalingType,
)

from f8dist.config import CastSpec

AXISWISE = ScalingGranularity.AXISWISE


def test_defaults_are_tensorwise_dynamic_with_role_dtypes():
    c = Float8LinearConfig()
    for gemm, op in [("output", "input"), ("output", "weight"), ("grad_input", "weight")]:
        assert c.cast_config(gemm, op).scaling_type is ScalingType.DYNAMIC
        assert c.resolved_dtype(gemm, op) == torch.float8_e4m3fn
    assert c.resolved_dtype("grad_input", "grad_output") == torch.float8_e5m2
    assert c.resolved_dtype("grad_weight", "grad_output") == torch.float8_e5m2


def test_configs_are_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Float8LinearConfig().emulate = True
    with pytest.raises(TypeError):
        CastConfig(ScalingType.DYNAMIC)  # positional


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed"])
def test_recipes_by_name(name):
    c = Float8LinearConfig.from_recipe_name(name)
    if name == "rowwise":
        assert c.round_scales_to_power_of_2
        for gemm in ("output", "grad_input", "grad_weight"):
            for op in ("input", "weight", "grad_output"):
                if op in {"output": ("input", "weight"), "grad_input": ("grad_output", "weight"),
                          "grad_weight": ("grad_output", "input")}[gemm]:
                    assert c.cast_config(gemm, op).scaling_granularity is AXISWISE
    if name == "rowwise_with_gw_hp":
        assert not c.gemm_in_float8("grad_weight")
        assert c.gemm_in_float8("output") and c.gemm_in_float8("grad_input")
    if name == "delayed":
        assert c.uses(ScalingType.DELAYED)


@pytest.mark.parametrize("name", ["colwise", None, 3])
def test_unknown_recipe_names_the_argument_and_lists_known_ones(name):
    with pytest.raises(ValueError, match=r"recipe_name .*known recipes.*tensorwise.*rowwise"):
        Float8LinearConfig.from_recipe_name(name)


def test_half_float8_gemm_is_rejected_with_the_field_to_change():
    with pytest.raises(ValueError, match="cast_config_grad_output_for_grad_weight"):
        Float8LinearConfig(
            cast_config_input_for_grad_weight=CastConfig(scaling_type=ScalingType.DISABLED)
        )


def test_delayed_axiswise_is_rejected():
    with pytest.raises(ValueError, match="TENSORWISE"):
        CastConfig(scaling_type=ScalingType.DELAYED, scaling_granularity=AXISWISE)


def test_bad_dtype_and_types_are_rejected():
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        CastConfig(target_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="ScalingType"):
        CastConfig(scaling_type="dynamic")
    with pytest.raises(TypeError, match="CastConfig"):
        Float8LinearConfig(cast_config_input="dynamic")
    with pytest.raises(ValueError, match="history_len"):
        DelayedScalingConfig(history_len=0)
    with pytest.raises(ValueError, match="rescale_out_of_range"):
        DelayedScalingConfig(rescale_out_of_range="no")


def test_fsdp_float8_all_gather_needs_tensorwise_weight():
    with pytest.raises(ValueError, match="tensorwise weight"):
        Float8LinearConfig.from_recipe_name("rowwise").replace(enable_fsdp_float8_all_gather=True)
    Float8LinearConfig(enable_fsdp_float8_all_gather=True)  # valid


def test_unknown_gemm_or_operand():
    with pytest.raises(ValueError, match="no operand"):
        Float8LinearConfig().cast_config("grad_input", "input")


@pytest.mark.parametrize("name, once", [
    ("tensorwise", True), ("rowwise", False), ("rowwise_with_gw_hp", False),
])
def test_an_operand_is_cast_once_where_both_its_gemms_take_the_same_bytes(name, once):
    """CastSpecs.save_float8_input / cast_grad_output_once: a tensorwise operand cast alike in its
    two gemms is cast once (only the gemm options, e.g. pad_k, may differ)."""
    specs = Float8LinearConfig.from_recipe_name(name).cast_specs("w1")
    assert specs.save_float8_input is once
    assert specs.cast_grad_output_once is once


def test_operands_cast_differently_per_gemm_are_cast_per_gemm():
    e4m3, e5m2 = (CastConfig(target_dtype=d) for d in (torch.float8_e4m3fn, torch.float8_e5m2))
    config = Float8LinearConfig(cast_config_grad_output_for_grad_weight=e4m3,
                                cast_config_input_for_grad_weight=e5m2)
    specs = config.cast_specs()
    assert not specs.cast_grad_output_once and not specs.save_float8_input
    same = Float8LinearConfig(cast_config_grad_output_for_grad_weight=e5m2,
                              cast_config_input_for_grad_weight=e4m3).cast_specs()
    assert same.cast_grad_output_once and same.save_float8_input


@pytest.mark.parametrize("name, carried", [
    ("tensorwise", True), ("rowwise", False), ("rowwise_with_gw_hp", True), ("delayed", False),
])
def test_backward_takes_the_forward_weight_amax_where_its_cast_is_tensorwise(name, carried):
    """CastSpecs.weight_amax_from_forward: backward's weight cast is tensorwise and dynamic, as is
    the forward's amax (of either granularity); rowwise scales the weight per column in backward,
    delayed takes its scales from a history."""
    specs = Float8LinearConfig.from_recipe_name(name).cast_specs("w1")
    assert specs.weight_amax_from_forward is carried


def test_no_weight_amax_is_carried_into_a_high_precision_gemm():
    off = CastConfig(scaling_type=ScalingType.DISABLED)
    config = Float8LinearConfig(cast_config_grad_output=off, cast_config_weight_for_grad_input=off,
                                cast_config_grad_output_for_grad_weight=CastConfig())
    assert not config.cast_specs().weight_amax_from_forward


@pytest.mark.parametrize("name, saved", [
    ("tensorwise", "forward_cast"), ("rowwise", "grad_weight_cast"),
    ("rowwise_with_gw_hp", "high_precision"), ("delayed", "forward_cast"),
])
def test_what_a_linear_keeps_of_its_input(name, saved):
    """One rule (Float8LinearConfig._saved_input) for the grad_weight gemm's input: by default
    float8 only where one cast serves both gemms; float8_activations_for_backward casts it in
    forward where backward would cast it; a high-precision gemm reads the input itself."""
    config = Float8LinearConfig.from_recipe_name(name)
    on = config.replace(float8_activations_for_backward=True).cast_specs("w")
    assert on.saved_input == saved
    assert config.cast_specs("w").saved_input == ("forward_cast" if saved == "forward_cast"
                                                  else "high_precision")
    requantized = Float8LinearConfig.from_recipe_name("rowwise").replace(
        axiswise_requantize_input_for_grad_weight=True)
    assert requantized.cast_specs().saved_input == "forward_cast"
    # SwiGLU's saved inputs: e4m3, a scale per channel (over the tokens), for every recipe
    spec = on.activation
    assert (spec.dtype, spec.granularity, spec.axis) == (
        torch.float8_e4m3fn, ScalingGranularity.AXISWISE, 0)
    assert spec.site.fqn == "w.activation" and config.cast_specs("w").activation is None


def test_float8_activations_for_backward_and_requantize_are_exclusive():
    rowwise = Float8LinearConfig.from_recipe_name("rowwise")
    with pytest.raises(ValueError, match="set one"):
        rowwise.replace(float8_activations_for_backward=True,
                        axiswise_requantize_input_for_grad_weight=True)
    with pytest.raises(TypeError, match="must be a bool"):
        rowwise.replace(float8_activations_for_backward=1)


# -- block scales ([Note: block scales] in f8dist/config/cells.py) --------------------------------------

BLOCKWISE = ScalingGranularity.BLOCKWISE
E8M0 = torch.float8_e8m0fnu


@pytest.mark.parametrize("kwargs, words", [
    (dict(scaling_granularity=BLOCKWISE), "block_size=\\(outer, inner\\)"),
    (dict(scaling_granularity=BLOCKWISE, block_size=(1, 0)), "two positive"),
    (dict(scaling_granularity=BLOCKWISE, block_size=(1, 24)), "multiple of 16"),
    (dict(scaling_granularity=BLOCKWISE, block_size=(1, 32), scale_dtype=torch.bfloat16),
     "scale_dtype must be"),
    (dict(scaling_granularity=BLOCKWISE, block_size=(1, 32), scale_rounding="floor"),
     "rounds e8m0 scales"),
    (dict(block_size=(1, 32)), "leave them unset"),
    # e8m0 rounding on a tensorwise cast would do nothing: refused, not ignored
    (dict(scale_rounding="floor"), "scale_rounding describe block scales.*scale_rounding=floor"),
    # an unknown name: the field, the value and the names it takes
    (dict(scaling_granularity=BLOCKWISE, block_size=(1, 32), scale_dtype=E8M0,
          scale_rounding="nearest"),
     r"CastConfig.scale_rounding must be one of \['rceil', 'floor'\].*got 'nearest'"),
    (dict(scale_rounding="nearest"), r"CastConfig.scale_rounding must be one of"),
    (dict(scaling_granularity=BLOCKWISE, block_size=(1, 32), scaling_type=ScalingType.DELAYED),
     "TENSORWISE"),
])
def test_block_cast_config_is_validated(kwargs, words):
    with pytest.raises(ValueError, match=words):
        CastConfig(**kwargs)


@pytest.mark.parametrize("make, words", [
    (lambda: CastSpec(gemm="fwd"), r"CastSpec.gemm must be one of \['output', 'grad_input', "
                                   r"'grad_weight'\].*got 'fwd'"),
    (lambda: CastSpec(operand="x"), r"CastSpec.operand must be one of .*got 'x'"),
    (lambda: Float8LinearConfig(sp_grad_weight="both"),
     r"Float8LinearConfig.sp_grad_weight must be one of \['forward_gather', .*got 'both'"),
])
def test_names_are_refused_with_the_field_and_the_values(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def test_block_gemm_needs_both_operands_blockwise_with_one_inner_block():
    mx = CastConfig(scaling_granularity=BLOCKWISE, block_size=(1, 32), scale_dtype=E8M0)
    with pytest.raises(ValueError, match="needs both operands blockwise"):
        Float8LinearConfig(cast_config_input=mx)
    with pytest.raises(ValueError, match="differ along the contraction dim"):
        Float8LinearConfig(cast_config_input=mx, cast_config_grad_output=mx,
                           cast_config_weight=dataclasses.replace(mx, block_size=(128, 128)))
    with pytest.raises(ValueError, match="enable_fsdp_float8_all_gather.*square weight blocks"):
        Float8LinearConfig.from_recipe_name("mxfp8").replace(enable_fsdp_float8_all_gather=True)
    for name in ("mxfp8_square_weights", "blockwise"):  # one gathered weight serves both gemms
        Float8LinearConfig.from_recipe_name(name).replace(enable_fsdp_float8_all_gather=True)


@pytest.mark.parametrize("name, block, scale_dtype", [
    ("mxfp8", (1, 32), E8M0), ("mxfp8_wgrad_with_hp", (1, 32), E8M0),
    ("mxfp8_square_weights", (1, 32), E8M0), ("blockwise", (1, 128), torch.float32),
])
def test_block_recipes_block_along_each_gemms_contraction_dim(name, block, scale_dtype):
    specs = Float8LinearConfig.from_recipe_name(name).cast_specs()
    outer, inner = block
    # activations and gradients: (1, inner) along K or N, (inner, 1) along the tokens
    assert specs["output", "input"].block_shape(2) == (outer, inner)
    assert specs["grad_input", "grad_output"].block_shape(2) == (outer, inner)
    for spec in specs:
        if spec.enabled:
            assert spec.dtype == torch.float8_e4m3fn and spec.scale_dtype == scale_dtype and spec.block_size[1] == inner
    if name == "mxfp8_wgrad_with_hp":
        assert not specs["grad_weight", "input"].enabled
    else:
        assert specs["grad_weight", "input"].block_shape(2) == (inner, outer)
    weight = {"mxfp8_square_weights": (32, 32), "blockwise": (128, 128)}.get(name)
    if weight:  # square: the same block in both of the weight's gemms
        assert specs["output", "weight"].block_shape(2) == weight == specs["grad_input", "weight"].block_shape(2)
    assert specs.weight_same_bytes == (weight is not None)


def test_torchaos_deprecated_field_is_accepted_with_a_warning():
    # issue 23 item 18: torchao 0.18 accepts force_recompute_fp8_weight_in_bwd (no effect, warns)
    import warnings

    with pytest.warns(DeprecationWarning, match="force_recompute_fp8_weight_in_bwd.*no effect"):
        config = Float8LinearConfig(force_recompute_fp8_weight_in_bwd=True)
    assert config.cast_specs("x") == Float8LinearConfig().cast_specs("x")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Float8LinearConfig()  # the default does not warn


def test_grouped_cast_specs_are_the_table_per_expert_in_e4m3():
    config = Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp")
    specs = config.grouped_cast_specs("moe.experts.w1")
    plain = config.cast_specs("moe.experts.w1")
    for g, op in (("output", "input"), ("grad_input", "weight"), ("grad_weight", "input")):
        s, p = specs[g, op], plain[g, op]
        assert s.grouped and not p.grouped and s.fqn == "moe.experts.w1"
        assert (s.granularity, s.axis, s.scaling_type) == (p.granularity, p.axis, p.scaling_type)
    assert Float8LinearConfig().grouped_cast_specs()["grad_input", "grad_output"].dtype == torch.float8_e4m3fn


def test_sp_grad_weight_is_validated_and_reaches_the_cast_specs():
    # [Note: the grad_weight operand of a gathered tensor]: a string or an SPGradWeight
    from f8dist.config import SPGradWeight

    config = Float8LinearConfig.from_recipe_name("mxfp8").replace(sp_grad_weight="backward_gather")
    assert config.sp_grad_weight is SPGradWeight.BACKWARD_GATHER
    assert config.cast_specs("w1").sp_grad_weight is SPGradWeight.BACKWARD_GATHER
    assert Float8LinearConfig().cast_specs().sp_grad_weight is SPGradWeight.FORWARD_GATHER
    with pytest.raises(ValueError, match="must be one of.*forward_gather"):
        Float8LinearConfig(sp_grad_weight="both")
    # a high-precision grad_weight gemm can take the re-cast, not a token-block cast
    Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp").replace(sp_grad_weight="recast")
    with pytest.raises(ValueError, match="takes no such cast.*'forward_gather'.*'recast'"):
        Float8LinearConfig.from_recipe_name("mxfp8_wgrad_with_hp").replace(
            sp_grad_weight="backward_gather")
    # tensorwise and rowwise gather one float8 copy whatever the knob says
    for recipe in ("tensorwise", "rowwise"):
        with pytest.raises(ValueError, match="leave sp_grad_weight at 'forward_gather'"):
            Float8LinearConfig.from_recipe_name(recipe).replace(sp_grad_weight="recast")


def test_sp_grad_weight_derive_needs_a_token_block_grad_weight_gemm():
    # derive re-casts the row blocks in token blocks on one device too: block recipes whose
    # grad_weight gemm is float8; it keeps the forward's cast, so not float8_activations_for_backward
    config = Float8LinearConfig.from_recipe_name("blockwise").replace(sp_grad_weight="derive")
    assert config.cast_specs().saved_input.value == "forward_cast"
    for recipe in ("tensorwise", "rowwise", "mxfp8_wgrad_with_hp"):
        with pytest.raises(ValueError, match="sp_grad_weight='derive'.*use 'forward_gather'"):
            Float8LinearConfig.from_recipe_name(recipe).replace(sp_grad_weight="derive")
    with pytest.raises(ValueError, match="sp_grad_weight='derive'.*float8_activations_for_backward"):
        Float8LinearConfig.from_recipe_name("mxfp8").replace(
            sp_grad_weight="derive", float8_activations_for_backward=True)


def test_nvfp4_cells_take_e2m1_with_e4m3_block_scales_only():
    # [Note: NVFP4]: e2m1 data with e4m3 scales in 1x16 / 16x16 blocks, and nothing else
    from f8dist.config.cells import E2M1, E4M3

    nvfp4 = dict(scaling_granularity=ScalingGranularity.BLOCKWISE, target_dtype=E2M1,
                 scale_dtype=E4M3)
    for block in [(1, 16), (16, 16)]:
        assert CastConfig(block_size=block, **nvfp4).short_str() == f"dyn_blk{block[0]}x16e4m3_e2m1"
    for bad, words in [
        (dict(nvfp4, block_size=(1, 32)), r"block_size=\(1, 32\).*\(1, 16\) or \(16, 16\)"),
        (dict(nvfp4, block_size=(1, 16), scale_dtype=torch.float32), "scale_dtype=torch.float32"),
        (dict(target_dtype=E2M1), "scaling_granularity=ScalingGranularity.TENSORWISE"),
        (dict(nvfp4, block_size=(1, 16), target_dtype=torch.float8_e4m3fn),
         "scale_dtype=torch.float8_e4m3fn is NVFP4's block scale.*target_dtype="
         "torch.float8_e4m3fn"),
    ]:
        with pytest.raises(ValueError, match=words):
            CastConfig(**bad)
    # a gemm whose operands mix NVFP4 and MXFP8 blocks is refused by the gemm-pair rule
    with pytest.raises(ValueError, match="differ along the contraction"):
        Float8LinearConfig.from_recipe_name("nvfp4").replace(
            cast_config_weight=Float8LinearConfig.from_recipe_name("mxfp8").cast_config_weight)


def test_nvfp4_recipe_is_one_row():
    config = Float8LinearConfig.from_recipe_name("nvfp4")
    spec = config.cast_spec("output", "weight", "w")
    assert (spec.dtype, spec.block_size, spec.scale_dtype) == (
        torch.float4_e2m1fn_x2, (16, 16), torch.float8_e4m3fn)
    assert config.cast_spec("grad_weight", "grad_output", "w").block_size == (1, 16)


def test_stochastic_rounding_and_random_hadamard_are_for_nvfp4_casts_only():
    # [Note: stochastic rounding] in f8dist/core/scaling.py rounds e2m1 values
    from f8dist.config.cells import E2M1, E4M3

    nvfp4 = dict(scaling_granularity=ScalingGranularity.BLOCKWISE, target_dtype=E2M1,
                 scale_dtype=E4M3, block_size=(1, 16))
    assert CastConfig(stochastic_rounding=True, **nvfp4).short_str() == "dyn_blk1x16e4m3_e2m1_sr"
    with pytest.raises(ValueError, match="stochastic_rounding=True rounds NVFP4's e2m1 values, "
                                         "got target_dtype=torch.float8_e4m3fn"):
        CastConfig(target_dtype=torch.float8_e4m3fn, stochastic_rounding=True)
    with pytest.raises(TypeError, match="stochastic_rounding must be a bool, got 1"):
        CastConfig(stochastic_rounding=1, **nvfp4)
    # so is the random Hadamard transform ([Note: random Hadamard transform] there)
    assert CastConfig(random_hadamard=True, **nvfp4).short_str() == "dyn_blk1x16e4m3_e2m1_rht"
    with pytest.raises(ValueError, match="random_hadamard=True transforms NVFP4 operands, got "
                                         "target_dtype=None"):
        CastConfig(random_hadamard=True)


def test_nvfp4_experts_round_gradients_stochastically_and_transform_grad_weight_tokens():
    # grouped specs keep the gradients' stochastic rounding ([Note: positions in token groups]),
    # round the weights to nearest, and transform the grad_weight gemm's tokens as a linear does
    config = Float8LinearConfig.from_recipe_name("nvfp4")
    specs = config.grouped_cast_specs("experts.w1")
    assert all(s.dtype == torch.float4_e2m1fn_x2 for s in specs)
    assert [(s.gemm.value, s.operand.value) for s in specs if s.stochastic_rounding] == [
        ("grad_input", "grad_output"), ("grad_weight", "grad_output")]
    assert [(s.gemm.value, s.operand.value) for s in specs if s.random_hadamard] == [
        ("grad_weight", "grad_output"), ("grad_weight", "input")]
