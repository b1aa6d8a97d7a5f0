"""The recipes: named Float8LinearConfigs (``Float8LinearConfig.from_recipe_name``), the one
list that the auto filter, torchtitan converters and scripts/train.py derive theirs from."""

from __future__ import annotations

from typing import Dict, Tuple

from f8dist.config.cells import E2M1, E4M3, E8M0, CastConfig, ScalingGranularity, ScalingType
from f8dist.config.recipe_names import Float8LinearRecipeName

__all__ = ["Float8LinearRecipeName", "recipe_fields"]


def _mx(block_size: Tuple[int, int] = (1, 32)) -> CastConfig:
    """An MXFP8 cast: e4m3 with one e8m0 scale per ``block_size`` block (RCEIL)."""
    return CastConfig(scaling_granularity=ScalingGranularity.BLOCKWISE, target_dtype=E4M3,
                      block_size=block_size, scale_dtype=E8M0)


def _deepseek(block_size: Tuple[int, int]) -> CastConfig:
    """A DeepSeek-V3 blockwise cast: e4m3 with one float32 scale per ``block_size`` block."""
    return CastConfig(scaling_granularity=ScalingGranularity.BLOCKWISE, target_dtype=E4M3,
                      block_size=block_size)


def _nvfp4(block_size: Tuple[int, int] = (1, 16), **rounding: bool) -> CastConfig:
    """An NVFP4 cast: e2m1 with one e4m3 scale per ``block_size`` block under a float32 tensor
    scale ([Note: NVFP4] in f8dist/config/cells.py); ``rounding``: its stochastic_rounding and
    random_hadamard."""
    return CastConfig(scaling_granularity=ScalingGranularity.BLOCKWISE, target_dtype=E2M1,
                      block_size=block_size, scale_dtype=E4M3, **rounding)


def recipe_fields(recipe_name: str) -> Dict[str, object]:
    """The Float8LinearConfig fields (beyond the defaults) of the recipe ``recipe_name``."""
    recipe_name = Float8LinearRecipeName(recipe_name)
    if recipe_name is Float8LinearRecipeName.TENSORWISE:
        return {}

    if recipe_name is Float8LinearRecipeName.ROWWISE:
        # every operand axiswise; grad_output in e4m3 too: with a scale per row (or column)
        # the extra mantissa bit is worth more than e5m2's range (torchao's choice as well)
        axiswise = CastConfig(scaling_granularity=ScalingGranularity.AXISWISE)
        return dict(
            cast_config_input=axiswise,
            cast_config_weight=axiswise,
            cast_config_grad_output=CastConfig(
                scaling_granularity=ScalingGranularity.AXISWISE, target_dtype=E4M3
            ),
            round_scales_to_power_of_2=True,
        )

    if recipe_name is Float8LinearRecipeName.ROWWISE_WITH_GW_HP:
        # grad_weight (it sums over all tokens) in high precision; the grad_input gemm's weight
        # tensorwise, as torchao does (its columns would need a second pass over the weight)
        axiswise = CastConfig(scaling_granularity=ScalingGranularity.AXISWISE)
        disabled = CastConfig(scaling_type=ScalingType.DISABLED)
        return dict(
            cast_config_input=axiswise,
            cast_config_input_for_grad_weight=disabled,
            cast_config_weight=axiswise,
            cast_config_weight_for_grad_input=CastConfig(),
            cast_config_grad_output=CastConfig(
                scaling_granularity=ScalingGranularity.AXISWISE, target_dtype=E4M3
            ),
            cast_config_grad_output_for_grad_weight=disabled,
            round_scales_to_power_of_2=True,
        )

    if recipe_name is Float8LinearRecipeName.DELAYED:
        delayed = CastConfig(scaling_type=ScalingType.DELAYED)
        return dict(
            cast_config_input=delayed,
            cast_config_weight=delayed,
            cast_config_grad_output=delayed,
        )

    # [Note: block scales] in f8dist/config/cells.py: e4m3 everywhere (a scale per 32 or 128 elements
    # leaves e5m2's range nothing to do), every operand re-cast from high precision per gemm
    if recipe_name is Float8LinearRecipeName.MXFP8:
        return dict(
            cast_config_input=_mx(), cast_config_weight=_mx(), cast_config_grad_output=_mx())

    if recipe_name is Float8LinearRecipeName.MXFP8_WGRAD_WITH_HP:
        disabled = CastConfig(scaling_type=ScalingType.DISABLED)
        return dict(
            cast_config_input=_mx(), cast_config_weight=_mx(), cast_config_grad_output=_mx(),
            cast_config_input_for_grad_weight=disabled,
            cast_config_grad_output_for_grad_weight=disabled,
        )

    if recipe_name is Float8LinearRecipeName.MXFP8_SQUARE_WEIGHTS:
        # 32x32 weight blocks: one float8 weight serves the output and grad_input gemms
        return dict(
            cast_config_input=_mx(), cast_config_weight=_mx((32, 32)),
            cast_config_grad_output=_mx())

    if recipe_name is Float8LinearRecipeName.BLOCKWISE:
        # DeepSeek-V3: 1x128 tiles for activations and gradients, 128x128 weight blocks
        return dict(
            cast_config_input=_deepseek((1, 128)), cast_config_weight=_deepseek((128, 128)),
            cast_config_grad_output=_deepseek((1, 128)))

    if recipe_name in (Float8LinearRecipeName.NVFP4, Float8LinearRecipeName.NVFP4_NO_RHT):
        # NVIDIA's NVFP4 training recipe: 16x16 weight blocks, so one cast serves both of the
        # weight's gemms; gradients rounded stochastically ([Note: stochastic rounding] in
        # f8dist/core/scaling.py); the grad_weight gemm's operands transformed along the tokens
        # ([Note: random Hadamard transform] there), but in "nvfp4_no_rht"
        rht = recipe_name is Float8LinearRecipeName.NVFP4
        return dict(
            cast_config_input=_nvfp4(), cast_config_weight=_nvfp4((16, 16)),
            cast_config_grad_output=_nvfp4(stochastic_rounding=True),
            cast_config_input_for_grad_weight=_nvfp4(random_hadamard=rht),
            cast_config_grad_output_for_grad_weight=_nvfp4(stochastic_rounding=True,
                                                           random_hadamard=rht))

    raise AssertionError(recipe_name)
