"""The rules a :class:`~f8dist.config.Float8LinearConfig` is checked against, each in one place.

``check(config)`` runs the field types (:func:`check_field_types`), the cast table
(:func:`check_gemm`), then ``RULES``, one function per option; each raises naming the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
import warnings
from typing import Callable, Dict, Tuple

from f8dist.config.cells import (
    CastConfig, Gemm, Operand, ScalingGranularity, SPGradWeight, _Name,
)

__all__ = ["check", "check_field_types", "check_gemm", "RULES"]


# The config field that overrides an operand's main CastConfig in one gemm
OVERRIDE_FIELD = {
    (Gemm.GRAD_INPUT, Operand.WEIGHT): "cast_config_weight_for_grad_input",
    (Gemm.GRAD_WEIGHT, Operand.INPUT): "cast_config_input_for_grad_weight",
    (Gemm.GRAD_WEIGHT, Operand.GRAD_OUTPUT): "cast_config_grad_output_for_grad_weight",
}


def field_name(gemm: Gemm, operand: Operand) -> str:
    """The config field that sets ``operand``'s cast in ``gemm``."""
    return OVERRIDE_FIELD.get((gemm, operand), f"cast_config_{operand.value}")


@functools.lru_cache(maxsize=None)
def _field_types(cls: type) -> Tuple[Tuple[str, type, bool], ...]:
    """(name, type, None allowed) of each field of the dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint, optional = hints[f.name], False
        if typing.get_origin(hint) is typing.Union:  # Optional[X]
            (hint,), optional = [a for a in typing.get_args(hint) if a is not type(None)], True
        out.append((f.name, hint, optional))
    return tuple(out)


def check_field_types(config) -> None:
    """Every field of ``config`` holds its declared type; a name field (an enum of strings such
    as :class:`SPGradWeight`) takes its member or its string and is stored as the member."""
    owner = type(config).__name__
    for name, kind, optional in _field_types(type(config)):
        value = getattr(config, name)
        if issubclass(kind, _Name):
            object.__setattr__(config, name, kind.coerce(value, f"{owner}.{name}"))
        elif not (isinstance(value, kind) or (optional and value is None)):
            raise TypeError(f"{owner}.{name} must be a {kind.__name__}, got {value!r}")


def check_gemm(gemm: Gemm, a: CastConfig, b: CastConfig) -> None:
    """A gemm casts both operands or neither; a block-scaled one agrees on the contraction block
    and scale dtype ([Note: block scales] in f8dist/config/cells.py)."""
    left, right = gemm.operands
    if a.random_hadamard or b.random_hadamard:  # [Note: random Hadamard transform]
        if gemm is not Gemm.GRAD_WEIGHT or a.random_hadamard != b.random_hadamard:
            raise ValueError(
                f"the {gemm} gemm transforms {left}: random_hadamard={a.random_hadamard}, "
                f"{right}: random_hadamard={b.random_hadamard}; the transform leaves a product "
                "unchanged only when both operands take it along the contraction dim, the "
                "tokens of the grad_weight gemm: set random_hadamard=True on both of "
                f"{field_name(Gemm.GRAD_WEIGHT, Operand.INPUT)} and "
                f"{field_name(Gemm.GRAD_WEIGHT, Operand.GRAD_OUTPUT)} (and on no other cast)")
    if a.enabled != b.enabled:
        on, off = (left, right) if a.enabled else (right, left)
        raise ValueError(
            f"the {gemm} gemm casts {on} to float8 but not {off}: a gemm runs either in "
            f"float8 (both operands cast) or in high precision (both ScalingType.DISABLED); "
            f"set {field_name(gemm, on)} to CastConfig(scaling_type=ScalingType.DISABLED) "
            f"too, or give {field_name(gemm, off)} a float8 CastConfig"
        )
    if not (a.enabled and (a.blockwise or b.blockwise)):
        return
    fix = (f"set {field_name(gemm, left)} and {field_name(gemm, right)} to BLOCKWISE "
           "CastConfigs with the same inner block_size and scale_dtype")
    if not (a.blockwise and b.blockwise):
        raise ValueError(
            f"the {gemm} gemm scales {left} {a.scaling_granularity.value} and {right} "
            f"{b.scaling_granularity.value}: a block-scaled gemm needs both operands blockwise; "
            + fix
        )
    if a.block_size[1] != b.block_size[1] or a.scale_dtype != b.scale_dtype:
        raise ValueError(
            f"the {gemm} gemm's operands {left} (block_size={a.block_size}, {a.scale_dtype}) and "
            f"{right} (block_size={b.block_size}, {b.scale_dtype}) differ along the contraction "
            "dim: the kernel multiplies each block product by one scale of each operand; " + fix
        )


# -- one rule per option, named after it ---------------------------------------------------------

def force_recompute_fp8_weight_in_bwd(config) -> None:
    if config.force_recompute_fp8_weight_in_bwd:
        warnings.warn(
            "Float8LinearConfig.force_recompute_fp8_weight_in_bwd is deprecated (as in torchao) "
            "and has no effect (backward re-casts the high-precision weight anyway): drop it.",
            DeprecationWarning, stacklevel=5,  # the caller of Float8LinearConfig(...)
        )


def float8_weight_for_backward(config) -> None:
    if config.float8_weight_for_backward and not config.cast_specs().weight_same_bytes:
        raise ValueError(
            "float8_weight_for_backward keeps the forward's float8 weight for the grad_input "
            "gemm, so both gemms must cast the weight to the same bytes: a tensorwise weight "
            "cast (dynamic or delayed) or square weight blocks (the 'tensorwise', 'delayed', "
            "'mxfp8_square_weights' and 'blockwise' recipes); got output:weight "
            f"{config.cast_config(Gemm.OUTPUT, Operand.WEIGHT).short_str()}, grad_input:weight "
            f"{config.cast_config(Gemm.GRAD_INPUT, Operand.WEIGHT).short_str()}. Turn it off "
            "for this config")


def recompute_swiglu_product(config) -> None:
    if config.recompute_swiglu_product and not config.float8_activations_for_backward:
        raise ValueError(
            "recompute_swiglu_product recomputes an FFN's w2 input in backward from the float8 "
            "gate and up that float8_activations_for_backward keeps: set "
            "float8_activations_for_backward=True too, or drop recompute_swiglu_product")


def float8_activations_for_backward(config) -> None:
    if config.float8_activations_for_backward and config.axiswise_requantize_input_for_grad_weight:
        raise ValueError(
            "float8_activations_for_backward and axiswise_requantize_input_for_grad_weight "
            "both decide what the grad_weight gemm reads as its input; set one: "
            "float8_activations_for_backward casts the high-precision input along the token "
            "axis in forward (backward's gradients, bit for bit, 1 byte kept per element), "
            "axiswise_requantize_input_for_grad_weight keeps the forward's float8 copy and "
            "re-scales it in backward (no second cast in forward, a second rounding)"
        )


def axiswise_requantize_input_for_grad_weight(config) -> None:
    if not config.axiswise_requantize_input_for_grad_weight:
        return
    fwd = config.cast_config(Gemm.OUTPUT, Operand.INPUT)
    gw = config.cast_config(Gemm.GRAD_WEIGHT, Operand.INPUT)
    if not (fwd.enabled and gw.enabled and gw.scaling_granularity is ScalingGranularity.AXISWISE):
        raise ValueError(
            "axiswise_requantize_input_for_grad_weight re-scales the float8 forward copy "
            "of the input for an axiswise grad_weight gemm, so it needs the input cast in "
            "both the output and the grad_weight gemm, the latter AXISWISE (e.g. the "
            "'rowwise' recipe); got output:input "
            f"{fwd.short_str()}, grad_weight:input {gw.short_str()}. Turn it off for this "
            "config (tensorwise already keeps the float8 input; a high-precision "
            "grad_weight gemm needs the high-precision input)"
        )


def sp_grad_weight(config) -> None:
    """One that changes something for this table ([Note: the grad_weight operand of a gathered
    tensor] in f8dist/config/cells.py)."""
    if config.sp_grad_weight is SPGradWeight.FORWARD_GATHER:
        return
    specs, table = config.cast_specs(), config.short_str()
    if config.sp_grad_weight is SPGradWeight.RECAST and not (
            specs.own_grad_weight_operand(Operand.INPUT)
            or specs.own_grad_weight_operand(Operand.GRAD_OUTPUT)):
        raise ValueError(
            "sp_grad_weight='recast' re-casts a gathered float8 tensor for a grad_weight gemm "
            "in token blocks or high precision, but this config's grad_weight gemm reads the "
            f"gathered float8 as it is or re-scales it already ({table}): leave "
            "sp_grad_weight at 'forward_gather' (tensorwise and rowwise recipes gather one "
            "float8 copy whatever it says)")
    if config.sp_grad_weight is SPGradWeight.DERIVE and not (
            specs.derives_grad_weight_operand(Operand.INPUT)
            or specs.derives_grad_weight_operand(Operand.GRAD_OUTPUT)):
        raise ValueError(
            "sp_grad_weight='derive' makes the float8 grad_weight gemm re-cast its token blocks "
            "from the other gemms' row-block casts, but this config's grad_weight gemm reads "
            f"those casts as they are, re-scales them or runs in high precision ({table}): use "
            "'forward_gather' (or 'recast' to accept a re-cast under tensor parallelism only)")
    if config.sp_grad_weight is SPGradWeight.DERIVE and config.float8_activations_for_backward:
        raise ValueError(
            "sp_grad_weight='derive' re-casts the grad_weight gemm's input from the forward's "
            "float8 row blocks, but float8_activations_for_backward casts it from high precision "
            "in forward: set one of them (float8_activations_for_backward=False keeps derive)")
    if config.sp_grad_weight is SPGradWeight.BACKWARD_GATHER and not (
            specs.own_grad_weight_operand(Operand.INPUT)
            and specs[Gemm.GRAD_WEIGHT, Operand.INPUT].enabled):
        raise ValueError(
            "sp_grad_weight='backward_gather' all-gathers the grad_weight gemm's token-block "
            "float8 cast of the input in backward, but this config's grad_weight gemm takes "
            f"no such cast ({table}): use 'forward_gather' (one device's numbers: a "
            "high-precision grad_weight gemm's input crosses in high precision) or 'recast' "
            "(the row-block float8 only, a second rounding)")


def enable_fsdp_float8_all_gather(config) -> None:
    if not config.enable_fsdp_float8_all_gather:
        return
    w = config.cast_config_weight
    square = w.enabled and w.blockwise and config.cast_specs().weight_same_bytes
    if not w.enabled or not (w.scaling_granularity is ScalingGranularity.TENSORWISE or square):
        raise ValueError(
            "enable_fsdp_float8_all_gather sends one float8 weight per rank that serves "
            "both of the weight's gemms, so it needs a tensorwise weight cast (dynamic or "
            "delayed) or square weight blocks (the 'mxfp8_square_weights' and 'blockwise' "
            "recipes: [Note: block scales]); set cast_config_weight accordingly or turn "
            "enable_fsdp_float8_all_gather off (other weights are all-gathered in high "
            "precision)"
        )


# The options' rules by option, in the order they are checked
RULES: Dict[str, Callable[[object], None]] = {rule.__name__: rule for rule in (
    force_recompute_fp8_weight_in_bwd, float8_weight_for_backward, recompute_swiglu_product,
    float8_activations_for_backward, axiswise_requantize_input_for_grad_weight, sp_grad_weight,
    enable_fsdp_float8_all_gather,
)}


def check(config) -> None:
    """Every rule of ``config`` (a Float8LinearConfig), in order: the first broken one raises."""
    check_field_types(config)
    for gemm in Gemm:
        check_gemm(gemm, *(config.cast_config(gemm, op) for op in gemm.operands))
    for rule in RULES.values():
        rule(config)
