"""Configuration of float8 training: how each operand of each gemm is cast.

A :class:`Float8LinearConfig` is a table. Rows are the three gemms of a linear layer (see
``[Note: gemms]`` in ``f8dist/linear.py``), columns are their two operands, and each cell is a
:class:`CastConfig`::

    gemm          left operand                    right operand
    output        input                           weight (transposed)
    grad_input    grad_output                     weight  (cast_config_weight_for_grad_input)
    grad_weight   grad_output (transposed)        input   (cast_config_*_for_grad_weight)

All configs are frozen and keyword-only; contradictions are rejected in ``__post_init__`` with a
message that says what to change.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Optional

import torch

__all__ = [
    "ScalingType",
    "ScalingGranularity",
    "CastConfig",
    "DelayedScalingConfig",
    "Float8GemmConfig",
    "Float8LinearConfig",
    "Float8LinearRecipeName",
    "E4M3",
    "E5M2",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_FLOAT8_DTYPES = (E4M3, E5M2)


class ScalingType(enum.Enum):
    """How the scale of a cast is obtained."""

    DYNAMIC = "dynamic"  # from the amax of the tensor being cast, now
    DELAYED = "delayed"  # from an amax history of earlier iterations
    DISABLED = "disabled"  # no cast: the gemm operand stays in high precision

    def short_str(self) -> str:
        return {"dynamic": "dyn", "delayed": "del", "disabled": "dis"}[self.value]


class ScalingGranularity(enum.Enum):
    """How many scales a cast uses."""

    TENSORWISE = "tensorwise"  # one scale for the whole tensor
    AXISWISE = "axiswise"  # one scale per row (or column): amax over the gemm's contraction dim

    def short_str(self) -> str:
        return {"tensorwise": "ten", "axiswise": "axs"}[self.value]


@dataclass(frozen=True, kw_only=True)
class CastConfig:
    """How one gemm operand is cast to float8.

    ``target_dtype=None`` means the operand's default: e4m3 for input and weight, e5m2 for
    grad_output (see :meth:`Float8LinearConfig.resolved_dtype`).
    """

    scaling_type: ScalingType = ScalingType.DYNAMIC
    scaling_granularity: ScalingGranularity = ScalingGranularity.TENSORWISE
    target_dtype: Optional[torch.dtype] = None

    def __post_init__(self):
        if not isinstance(self.scaling_type, ScalingType):
            raise TypeError(
                f"CastConfig.scaling_type must be a ScalingType, got {self.scaling_type!r}; "
                "use ScalingType.DYNAMIC, ScalingType.DELAYED or ScalingType.DISABLED"
            )
        if not isinstance(self.scaling_granularity, ScalingGranularity):
            raise TypeError(
                f"CastConfig.scaling_granularity must be a ScalingGranularity, got "
                f"{self.scaling_granularity!r}; use ScalingGranularity.TENSORWISE or .AXISWISE"
            )
        if self.target_dtype is not None and self.target_dtype not in _FLOAT8_DTYPES:
            raise ValueError(
                f"CastConfig.target_dtype must be torch.float8_e4m3fn or torch.float8_e5m2 "
                f"(or None for the operand's default), got {self.target_dtype}"
            )
        if (
            self.scaling_type is ScalingType.DELAYED
            and self.scaling_granularity is not ScalingGranularity.TENSORWISE
        ):
            raise ValueError(
                "delayed scaling keeps one amax history per tensor, so it needs "
                "scaling_granularity=ScalingGranularity.TENSORWISE; use ScalingType.DYNAMIC "
                "for axiswise scaling"
            )

    @property
    def enabled(self) -> bool:
        return self.scaling_type is not ScalingType.DISABLED

    def short_str(self) -> str:
        dtype = {None: "dflt", E4M3: "e4m3", E5M2: "e5m2"}[self.target_dtype]
        return f"{self.scaling_type.short_str()}_{self.scaling_granularity.short_str()}_{dtype}"


@dataclass(frozen=True, kw_only=True)
class DelayedScalingConfig:
    """Amax history used by ``ScalingType.DELAYED`` casts."""

    history_len: int = 16
    scale_fn_name: str = "max"  # how the history becomes one amax

    def __post_init__(self):
        if not isinstance(self.history_len, int) or self.history_len < 1:
            raise ValueError(
                f"DelayedScalingConfig.history_len must be a positive int, got {self.history_len!r}"
            )
        if self.scale_fn_name != "max":
            raise ValueError(
                f"DelayedScalingConfig.scale_fn_name {self.scale_fn_name!r} is not supported; "
                "the only scale function is 'max' (the max over the history)"
            )


@dataclass(frozen=True, kw_only=True)
class Float8GemmConfig:
    """Per-gemm options of ``torch._scaled_mm``."""

    use_fast_accum: bool = False


_DEFAULT_DTYPE = {"input": E4M3, "weight": E4M3, "grad_output": E5M2}


class Float8LinearRecipeName(enum.Enum):
    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    ROWWISE_WITH_GW_HP = "rowwise_with_gw_hp"
    DELAYED = "delayed"


@dataclass(frozen=True, kw_only=True)
class Float8LinearConfig:
    """The full cast table of a :class:`~f8dist.linear.Float8Linear` plus its options.

    The ``*_for_grad_*`` fields override the operand's config in one backward gemm; ``None``
    means "same as the operand's main config". Use :meth:`cast_config` to read the resolved table.

    Example::

        >>> config = Float8LinearConfig.from_recipe_name("rowwise")
        >>> config.cast_config("grad_weight", "grad_output").scaling_granularity
        <ScalingGranularity.AXISWISE: 'axiswise'>
    """

    cast_config_input: CastConfig = field(default_factory=CastConfig)
    cast_config_input_for_grad_weight: Optional[CastConfig] = None
    cast_config_weight: CastConfig = field(default_factory=CastConfig)
    cast_config_weight_for_grad_input: Optional[CastConfig] = None
    cast_config_grad_output: CastConfig = field(default_factory=CastConfig)
    cast_config_grad_output_for_grad_weight: Optional[CastConfig] = None

    gemm_config_output: Float8GemmConfig = field(
        default_factory=lambda: Float8GemmConfig(use_fast_accum=True)
    )
    gemm_config_grad_input: Float8GemmConfig = field(default_factory=Float8GemmConfig)
    gemm_config_grad_weight: Float8GemmConfig = field(default_factory=Float8GemmConfig)

    # dequantize and matmul in high precision instead of calling torch._scaled_mm
    emulate: bool = False
    # round every scale down to a power of 2 (exact rescaling, the rowwise recipes' default)
    round_scales_to_power_of_2: bool = False
    # cast weights to float8 before the FSDP2 all-gather (1 byte per element on the wire)
    enable_fsdp_float8_all_gather: bool = False
    # zero-pad the contraction dim of each gemm to a multiple of 16 instead of raising
    pad_inner_dim: bool = False
    # axiswise grad_weight gemm: keep the float8 forward copy of the input for backward and
    # re-scale it along the token axis there (less memory, a second rounding), instead of the
    # high-precision input (exact); see [Note: what the matmul keeps for backward] in linear.py
    axiswise_requantize_input_for_grad_weight: bool = False

    # delayed scaling (see f8dist/delayed.py)
    delayed_scaling_config: DelayedScalingConfig = field(default_factory=DelayedScalingConfig)
    # initialize the amax history from the first batch seen (off for autocast+compile+FSDP users)
    enable_amax_init: bool = True
    # run the pre/post forward hooks that keep delayed buffers up to date
    enable_pre_and_post_forward: bool = True

    def __post_init__(self):
        for name in (
            "cast_config_input",
            "cast_config_input_for_grad_weight",
            "cast_config_weight",
            "cast_config_weight_for_grad_input",
            "cast_config_grad_output",
            "cast_config_grad_output_for_grad_weight",
        ):
            value = getattr(self, name)
            if value is None and name.endswith(("_for_grad_weight", "_for_grad_input")):
                continue
            if not isinstance(value, CastConfig):
                raise TypeError(f"Float8LinearConfig.{name} must be a CastConfig, got {value!r}")
        for name in ("gemm_config_output", "gemm_config_grad_input", "gemm_config_grad_weight"):
            if not isinstance(getattr(self, name), Float8GemmConfig):
                raise TypeError(f"Float8LinearConfig.{name} must be a Float8GemmConfig")

        # A gemm runs in float8 only if both of its operands are cast; half-cast gemms do not exist.
        for gemm, (left, right) in _GEMM_OPERANDS.items():
            a, b = self.cast_config(gemm, left), self.cast_config(gemm, right)
            if a.enabled != b.enabled:
                on, off = (left, right) if a.enabled else (right, left)
                raise ValueError(
                    f"the {gemm} gemm casts {on} to float8 but not {off}: a gemm runs either in "
                    f"float8 (both operands cast) or in high precision (both ScalingType.DISABLED); "
                    f"set {_field_name(gemm, on)} to CastConfig(scaling_type=ScalingType.DISABLED) "
                    f"too, or give {_field_name(gemm, off)} a float8 CastConfig"
                )

        if self.axiswise_requantize_input_for_grad_weight:
            fwd, gw = self.cast_config("output", "input"), self.cast_config("grad_weight", "input")
            if not (fwd.enabled and gw.enabled
                    and gw.scaling_granularity is ScalingGranularity.AXISWISE):
                raise ValueError(
                    "axiswise_requantize_input_for_grad_weight re-scales the float8 forward copy "
                    "of the input for an axiswise grad_weight gemm, so it needs the input cast in "
                    "both the output and the grad_weight gemm, the latter AXISWISE (e.g. the "
                    "'rowwise' recipe); got output:input "
                    f"{fwd.short_str()}, grad_weight:input {gw.short_str()}. Turn it off for this "
                    "config (tensorwise already keeps the float8 input; a high-precision "
                    "grad_weight gemm needs the high-precision input)"
                )

        if self.enable_fsdp_float8_all_gather:
            w = self.cast_config_weight
            if not w.enabled or w.scaling_granularity is not ScalingGranularity.TENSORWISE:
                raise ValueError(
                    "enable_fsdp_float8_all_gather sends one float8 weight per rank with one scale, "
                    "so it needs a tensorwise weight cast (dynamic or delayed); set "
                    "cast_config_weight to a TENSORWISE CastConfig or turn "
                    "enable_fsdp_float8_all_gather off (axiswise weights are all-gathered in high "
                    "precision)"
                )

    # -- the resolved table -------------------------------------------------------------------

    def cast_config(self, gemm: str, operand: str) -> CastConfig:
        """The CastConfig of ``operand`` ("input", "weight", "grad_output") in ``gemm``
        ("output", "grad_input", "grad_weight")."""
        if gemm not in _GEMM_OPERANDS or operand not in _GEMM_OPERANDS[gemm]:
            raise ValueError(
                f"no operand {operand!r} in gemm {gemm!r}; gemms and operands are "
                f"{ {g: list(ops) for g, ops in _GEMM_OPERANDS.items()} }"
            )
        override = getattr(self, _field_name(gemm, operand))
        if override is not None:
            return override
        return getattr(self, f"cast_config_{operand}")

    def resolved_dtype(self, gemm: str, operand: str) -> torch.dtype:
        """The float8 dtype ``operand`` is cast to in ``gemm``."""
        dtype = self.cast_config(gemm, operand).target_dtype
        return dtype if dtype is not None else _DEFAULT_DTYPE[operand]

    def gemm_config(self, gemm: str) -> Float8GemmConfig:
        return getattr(self, f"gemm_config_{gemm}")

    def gemm_in_float8(self, gemm: str) -> bool:
        left, _ = _GEMM_OPERANDS[gemm]
        return self.cast_config(gemm, left).enabled

    def uses(self, scaling_type: ScalingType) -> bool:
        return any(
            self.cast_config(g, op).scaling_type is scaling_type
            for g, ops in _GEMM_OPERANDS.items()
            for op in ops
        )

    def short_str(self) -> str:
        return ", ".join(
            f"{g}:{'x'.join(self.cast_config(g, op).short_str() for op in ops)}"
            for g, ops in _GEMM_OPERANDS.items()
        )

    def replace(self, **changes) -> "Float8LinearConfig":
        return dataclasses.replace(self, **changes)

    # -- recipes ------------------------------------------------------------------------------

    @staticmethod
    def from_recipe_name(recipe_name) -> "Float8LinearConfig":
        """A config by recipe name: "tensorwise", "rowwise", "rowwise_with_gw_hp" or "delayed"."""
        if isinstance(recipe_name, str):
            known = [r.value for r in Float8LinearRecipeName]
            if recipe_name not in known:
                raise ValueError(f"unknown float8 recipe {recipe_name!r}; known recipes: {known}")
            recipe_name = Float8LinearRecipeName(recipe_name)

        if recipe_name is Float8LinearRecipeName.TENSORWISE:
            return Float8LinearConfig()

        if recipe_name is Float8LinearRecipeName.ROWWISE:
            # every operand axiswise; grad_output in e4m3 too: with a scale per row (or column)
            # the extra mantissa bit is worth more than e5m2's range (torchao's choice as well)
            axiswise = CastConfig(scaling_granularity=ScalingGranularity.AXISWISE)
            return Float8LinearConfig(
                cast_config_input=axiswise,
                cast_config_weight=axiswise,
                cast_config_grad_output=CastConfig(
                    scaling_granularity=ScalingGranularity.AXISWISE, target_dtype=E4M3
                ),
                round_scales_to_power_of_2=True,
            )

        if recipe_name is Float8LinearRecipeName.ROWWISE_WITH_GW_HP:
            # output and grad_input in rowwise float8; grad_weight (the gemm most sensitive to
            # precision: it sums over all tokens) in high precision. grad_output in e4m3 as in
            # "rowwise". The weight of the grad_input gemm is scaled tensorwise, as torchao does: its columns
            # would need a second pass over the weight, and the result is torchao's bit for bit.
            axiswise = CastConfig(scaling_granularity=ScalingGranularity.AXISWISE)
            disabled = CastConfig(scaling_type=ScalingType.DISABLED)
            return Float8LinearConfig(
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
            return Float8LinearConfig(
                cast_config_input=delayed,
                cast_config_weight=delayed,
                cast_config_grad_output=delayed,
            )

        raise AssertionError(recipe_name)


# gemm -> (left operand, right operand); see [Note: gemms] in f8dist/linear.py
_GEMM_OPERANDS = {
    "output": ("input", "weight"),
    "grad_input": ("grad_output", "weight"),
    "grad_weight": ("grad_output", "input"),
}

_OVERRIDE_FIELD = {
    ("grad_input", "weight"): "cast_config_weight_for_grad_input",
    ("grad_weight", "input"): "cast_config_input_for_grad_weight",
    ("grad_weight", "grad_output"): "cast_config_grad_output_for_grad_weight",
}


def _field_name(gemm: str, operand: str) -> str:
    return _OVERRIDE_FIELD.get((gemm, operand), f"cast_config_{operand}")


GEMMS = tuple(_GEMM_OPERANDS)
