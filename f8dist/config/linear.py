"""Configuration of float8 training: what users write.

A :class:`Float8LinearConfig` is a gemm x operand table (f8dist/config/cells.py) of
:class:`CastConfig` cells, with torchao's field names, plus options. The code reads its
resolution, one frozen :class:`CastSpec` per cell (``config.cast_spec``, f8dist/config/specs.py). Configs
are frozen and keyword-only; contradictions raise in ``__post_init__`` (f8dist/config/rules.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Tuple, Union

import torch

import f8dist.config.rules as config_rules
from f8dist.config.cells import (  # noqa: F401  (re-exported)
    _CELLS, _CONTRACTION_AXIS, _FLOAT8_DTYPES, _GEMM_OPERANDS, _SCALE_DTYPES, E2M1, E4M3, E5M2, E8M0,
    CastConfig, Gemm, Operand, SavedInput, ScaleRounding, ScalingGranularity, ScalingType,
    SPGradWeight, _check_block, _Name,
)
from f8dist.config.recipes import Float8LinearRecipeName, _deepseek, _mx, recipe_fields  # noqa: F401
from f8dist.config.specs import (  # noqa: F401  (re-exported)
    _COMMUNICATED, CastSite, CastSpec, CastSpecs, ScaledMMConfig, _amax_follows, _same_bytes,
)

__all__ = [
    "ScalingType", "ScalingGranularity", "Gemm", "Operand", "CastConfig", "CastSpec", "CastSpecs",
    "CastSite", "DelayedScalingConfig", "Float8GemmConfig", "Float8LinearConfig",
    "Float8LinearRecipeName", "SavedInput", "ScaledMMConfig", "ScaleRounding", "SPGradWeight",
    "E4M3", "E5M2", "E8M0",
]


def _cell(gemm: Union[str, Gemm], operand: Union[str, Operand]) -> Tuple[Gemm, Operand]:
    """``(gemm, operand)`` as enums; a clear error for a cell the table does not have."""
    try:
        g, op = Gemm(gemm), Operand(operand)
    except ValueError:
        g = op = None
    if g is None or op not in g.operands:
        raise ValueError(
            f"no operand {str(operand)!r} in gemm {str(gemm)!r}; gemms and operands are "
            f"{ {g.value: [o.value for o in g.operands] for g in Gemm} }"
        )
    return g, op


@dataclass(frozen=True, kw_only=True)
class DelayedScalingConfig:
    """Amax history used by ``ScalingType.DELAYED`` casts."""

    history_len: int = 16
    scale_fn_name: str = "max"  # how the history becomes one amax
    # an out-of-range cast re-scales in its own step (a second pass per cast) instead of keeping
    # the history's scale: [Note: the price of re-scaling] in f8dist/policy/delayed/scale.py
    rescale_out_of_range: bool = False

    def __post_init__(self):
        if not isinstance(self.history_len, int) or self.history_len < 1:
            raise ValueError(
                f"DelayedScalingConfig.history_len must be a positive int, got {self.history_len!r}"
            )
        if not isinstance(self.rescale_out_of_range, bool):
            raise ValueError(
                "DelayedScalingConfig.rescale_out_of_range must be a bool, got "
                f"{self.rescale_out_of_range!r}"
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

    def __post_init__(self):
        config_rules.check_field_types(self)


@dataclass(frozen=True, kw_only=True)
class Float8LinearConfig:
    """The full cast table of a :class:`~f8dist.nn.linear.Float8Linear` plus its options.

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

    # What backward keeps (less memory, opt-in; [Note: what the matmul keeps for backward] in
    # f8dist/nn/linear.py). Grouped experts refuse them ([Note: options of grouped experts]).
    # keep the grad_weight gemm's float8 input, cast in forward as that gemm casts it (gradients
    # bit for bit), and SwiGLU's inputs in float8 (f8dist/nn/swiglu.py)
    float8_activations_for_backward: bool = False
    # axiswise grad_weight gemm: keep the forward's float8 input and re-scale it in backward (a
    # second rounding); the alternative to float8_activations_for_backward
    axiswise_requantize_input_for_grad_weight: bool = False
    # an FFN's w2 keeps nothing of its input and recomputes it from SwiGLU's float8 gate and up
    # (other numerics; needs float8_activations_for_backward): [Note: a product recomputed in
    # backward] in f8dist/nn/swiglu.py
    recompute_swiglu_product: bool = False
    # an RMSNorm's readers keep nothing of their input and recompute it from what the norm keeps
    # (gradients bit for bit): [Note: a norm output recomputed in backward] in models/norm.py
    recompute_norm_output: bool = False
    # keep the forward's float8 weight for the grad_input gemm instead of re-casting it, where
    # one cast serves both gemms (tensorwise, square weight blocks)
    float8_weight_for_backward: bool = False

    # [Note: the grad_weight operand of a gathered tensor] in f8dist/config/cells.py
    sp_grad_weight: SPGradWeight = SPGradWeight.FORWARD_GATHER

    # delayed scaling ([Note: delayed scaling] in f8dist/policy/delayed/)
    delayed_scaling_config: DelayedScalingConfig = field(default_factory=DelayedScalingConfig)
    # fill the amax histories from the first training step ([Note: first step]); off: scale 1.0
    enable_amax_init: bool = True
    # torchao's deprecated flag, accepted for porting: no effect there either (warns)
    force_recompute_fp8_weight_in_bwd: bool = False

    def __post_init__(self):
        config_rules.check(self)  # each rule in one place: f8dist/config/rules.py

    # -- the resolved table -------------------------------------------------------------------

    def cast_config(self, gemm: Union[str, Gemm], operand: Union[str, Operand]) -> CastConfig:
        """The CastConfig of ``operand`` ("input", "weight", "grad_output") in ``gemm``
        ("output", "grad_input", "grad_weight")."""
        gemm, operand = _cell(gemm, operand)
        override = getattr(self, config_rules.field_name(gemm, operand))
        if override is not None:
            return override
        return getattr(self, f"cast_config_{operand.value}")

    def cast_spec(
        self, gemm: Union[str, Gemm], operand: Union[str, Operand], fqn: str = ""
    ) -> CastSpec:
        """How ``operand`` is cast in ``gemm`` of the linear ``fqn``: the resolved cell."""
        gemm, operand = _cell(gemm, operand)
        cc = self.cast_config(gemm, operand)
        return CastSpec(
            dtype=cc.target_dtype or operand.default_dtype,
            granularity=cc.scaling_granularity,
            axis=_CONTRACTION_AXIS[(gemm, operand)],
            scaling_type=cc.scaling_type,
            round_scales_to_power_of_2=self.round_scales_to_power_of_2,
            mm_config=ScaledMMConfig(
                emulate=self.emulate,
                use_fast_accum=self.gemm_config(gemm).use_fast_accum,
                pad_inner_dim=self.pad_inner_dim,
                pad_k=gemm is Gemm.GRAD_WEIGHT,
            ),
            gemm=gemm,
            operand=operand,
            fqn=fqn,
            block_size=cc.block_size,
            scale_dtype=cc.scale_dtype,
            scale_rounding=cc.scale_rounding,
            stochastic_rounding=cc.stochastic_rounding,
            random_hadamard=cc.random_hadamard,
        )

    def cast_specs(self, fqn: str = "") -> CastSpecs:
        """All six cast specs of the linear ``fqn``."""
        specs = CastSpecs(tuple(self.cast_spec(g, op, fqn) for g, op in _CELLS),
                          sp_grad_weight=self.sp_grad_weight)
        return dataclasses.replace(
            specs,
            saved_input=self._saved_input(specs),
            cast_grad_output_once=_same_bytes(
                specs, Operand.GRAD_OUTPUT, Gemm.GRAD_INPUT, Gemm.GRAD_WEIGHT),
            weight_amax_from_forward=_amax_follows(
                specs, Operand.WEIGHT, Gemm.OUTPUT, Gemm.GRAD_INPUT),
            weight_same_bytes=_same_bytes(specs, Operand.WEIGHT, Gemm.OUTPUT, Gemm.GRAD_INPUT),
            save_float8_weight=self.float8_weight_for_backward,  # checked: one cast for both
            activation=self.activation_spec(f"{fqn}.activation" if fqn else "activation"),
        )

    def _saved_input(self, specs: CastSpecs) -> SavedInput:
        """What a linear keeps of its input for backward: the one rule ([Note: what the matmul
        keeps for backward] in f8dist/nn/linear.py)."""
        if not specs.gemm_in_float8(Gemm.GRAD_WEIGHT):
            return SavedInput.HIGH_PRECISION  # a high-precision gemm reads the values
        if _same_bytes(specs, Operand.INPUT, Gemm.OUTPUT, Gemm.GRAD_WEIGHT):
            return SavedInput.FORWARD_CAST  # one cast serves both gemms
        if specs.derives_grad_weight_operand(Operand.INPUT):
            return SavedInput.FORWARD_CAST  # re-cast in token blocks in backward
        if self.float8_activations_for_backward:
            return SavedInput.GRAD_WEIGHT_CAST
        if self.axiswise_requantize_input_for_grad_weight:
            return SavedInput.FORWARD_CAST  # re-scaled along the token axis in backward
        return SavedInput.HIGH_PRECISION

    def activation_spec(self, fqn: str = "") -> Optional[CastSpec]:
        """How ``float8_activations_for_backward`` keeps an activation that backward reads only
        for gradients (SwiGLU's inputs); None when off. One scale per channel, over the tokens, so
        a tensor-parallel shard of the channels needs no collective."""
        if not self.float8_activations_for_backward:
            return None
        return CastSpec(
            dtype=E4M3, granularity=ScalingGranularity.AXISWISE, axis=0,
            round_scales_to_power_of_2=self.round_scales_to_power_of_2,
            gemm=Gemm.GRAD_WEIGHT, operand=Operand.INPUT, fqn=fqn,
        )

    def grouped_cast_specs(self, fqn: str = "") -> CastSpecs:
        """The six casts of the grouped (expert) gemm ``fqn`` ([Note: grouped casts] in
        f8dist/config/specs.py); the linear-only flags keep their defaults ([Note: options of grouped
        experts] in f8dist/nn/grouped.py).

        Example::

            >>> specs = Float8LinearConfig.from_recipe_name("tensorwise").grouped_cast_specs("w1")
            >>> specs["grad_input", "grad_output"].dtype  # CUDA's grouped gemm takes e4m3 only
            torch.float8_e4m3fn
        """
        specs = []
        for g, op in _CELLS:
            spec = self.cast_spec(g, op, fqn)
            cc = self.cast_config(g, op)
            if spec.enabled and cc.target_dtype is E5M2:
                raise ValueError(
                    f"{fqn or '<root>'}: {g}:{op} asks for e5m2, but torch._scaled_grouped_mm "
                    "takes e4m3 operands only; leave its target_dtype None (e4m3 in grouped "
                    "gemms) or set it to torch.float8_e4m3fn"
                )
            # NVFP4 keeps its e2m1 ([Note: the NVFP4 gemm] in f8dist/core/gemm.py, grouped too);
            # the tokens round stochastically where the cell says, drawing by their place in
            # their expert's group ([Note: positions in token groups] in f8dist/core/scaling.py),
            # the weights to nearest (a rank's gemm reads its shard as a plain tensor); the
            # grad_weight gemm's tokens take the random Hadamard transform as a linear's, in
            # 16-row blocks of one group each (the gemm pads each group to 16 rows)
            dtype = spec.dtype if spec.dtype == E2M1 else E4M3
            sr = spec.stochastic_rounding and op is not Operand.WEIGHT
            specs.append(dataclasses.replace(spec, dtype=dtype, grouped=True,
                                             stochastic_rounding=sr))
        return CastSpecs(tuple(specs))

    def resolved_dtype(self, gemm: Union[str, Gemm], operand: Union[str, Operand]) -> torch.dtype:
        """The float8 dtype ``operand`` is cast to in ``gemm``."""
        return self.cast_spec(gemm, operand).dtype

    def gemm_config(self, gemm: Union[str, Gemm]) -> Float8GemmConfig:
        return getattr(self, f"gemm_config_{Gemm(gemm).value}")

    def gemm_in_float8(self, gemm: Union[str, Gemm]) -> bool:
        gemm = Gemm(gemm)
        return self.cast_config(gemm, gemm.operands[0]).enabled

    def uses(self, scaling_type: ScalingType) -> bool:
        return any(self.cast_config(g, op).scaling_type is scaling_type for g, op in _CELLS)

    def short_str(self) -> str:
        return ", ".join(
            f"{g.value}:{'x'.join(self.cast_config(g, op).short_str() for op in g.operands)}"
            for g in Gemm
        )

    def replace(self, **changes) -> "Float8LinearConfig":
        return dataclasses.replace(self, **changes)

    # -- recipes ------------------------------------------------------------------------------

    @staticmethod
    def from_recipe_name(
        recipe_name: Union[str, Float8LinearRecipeName]
    ) -> "Float8LinearConfig":
        """A config by recipe name: a :class:`Float8LinearRecipeName` or its value."""
        try:
            recipe_name = Float8LinearRecipeName(recipe_name)
        except ValueError:
            raise ValueError(
                f"Float8LinearConfig.from_recipe_name: unknown recipe_name {recipe_name!r}; "
                f"known recipes: {[r.value for r in Float8LinearRecipeName]}"
            ) from None

        return Float8LinearConfig(**recipe_fields(recipe_name.value))
