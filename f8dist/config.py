"""Configuration of float8 training: what users write.

A :class:`Float8LinearConfig` is a table. Rows are the three gemms of a linear layer, columns
their two operands (the table and its names: f8dist/cells.py), and each cell is a
:class:`CastConfig`, plus options (memory, exactness, delayed scaling) checked against each other.

The config is what users write (torchao's field names). What the code reads is its resolution:
``config.cast_spec(gemm, operand)``, one frozen :class:`CastSpec` per cell (f8dist/specs.py).
Recipes are named configs (f8dist/recipes.py, :meth:`Float8LinearConfig.from_recipe_name`).

All configs are frozen and keyword-only; contradictions are rejected in ``__post_init__`` with a
message that says what to change. This module re-exports the names of cells.py, specs.py and
recipes.py: ``from f8dist.config import X`` works for all of them.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Optional, Tuple, Union

import torch

from f8dist.cells import (  # noqa: F401  (re-exported)
    _CELLS, _CONTRACTION_AXIS, _FLOAT8_DTYPES, _GEMM_OPERANDS, _SCALE_DTYPES, E4M3, E5M2, E8M0,
    CastConfig, Gemm, Operand, SavedInput, ScaleRounding, ScalingGranularity, ScalingType,
    SPGradWeight, _check_block, _Name,
)
from f8dist.recipes import Float8LinearRecipeName, _deepseek, _mx, recipe_fields  # noqa: F401
from f8dist.specs import (  # noqa: F401  (re-exported)
    _COMMUNICATED, CastSite, CastSpec, CastSpecs, ScaledMMConfig, _amax_follows, _same_bytes,
)

__all__ = [
    "ScalingType", "ScalingGranularity", "Gemm", "Operand", "CastConfig", "CastSpec", "CastSpecs",
    "CastSite", "DelayedScalingConfig", "Float8GemmConfig", "Float8LinearConfig",
    "Float8LinearRecipeName", "SavedInput", "ScaledMMConfig", "ScaleRounding", "SPGradWeight",
    "E4M3", "E5M2", "E8M0",
]


# The config field that overrides an operand's main CastConfig in one gemm
_OVERRIDE_FIELD = {
    (Gemm.GRAD_INPUT, Operand.WEIGHT): "cast_config_weight_for_grad_input",
    (Gemm.GRAD_WEIGHT, Operand.INPUT): "cast_config_input_for_grad_weight",
    (Gemm.GRAD_WEIGHT, Operand.GRAD_OUTPUT): "cast_config_grad_output_for_grad_weight",
}

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


def _field_name(gemm: Gemm, operand: Operand) -> str:
    return _OVERRIDE_FIELD.get((gemm, operand), f"cast_config_{operand.value}")


@dataclass(frozen=True, kw_only=True)
class DelayedScalingConfig:
    """Amax history used by ``ScalingType.DELAYED`` casts."""

    history_len: int = 16
    scale_fn_name: str = "max"  # how the history becomes one amax
    # a cast whose current amax is out of range of the history scale keeps the history scale, the
    # step counted and the history restarted by the sync (False, the default: one pass over the
    # tensor per cast), or re-scales in its own step (True: a second pass per cast); chosen by
    # measurement, [Note: the price of re-scaling] in f8dist/delayed.py
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


def _check_block_gemm(gemm: Gemm, a: CastConfig, b: CastConfig) -> None:
    """A float8 gemm with block scales: both operands blockwise, one contraction block, one
    scale dtype ([Note: block scales] in f8dist/cells.py)."""
    left, right = gemm.operands
    fix = (f"set {_field_name(gemm, left)} and {_field_name(gemm, right)} to BLOCKWISE "
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
    # block recipes and high-precision grad_weight gemms under sequence parallelism: how the
    # grad_weight gemm gets the operand a tensor-parallel style all-gathers in float8 (both casts
    # in forward, exact; the row-block cast re-cast, bytes first; the token-block shard gathered in
    # backward, exact): [Note: the grad_weight operand of a gathered tensor] in f8dist/cells.py.
    # Beside axiswise_requantize_input_for_grad_weight, which is about what a linear keeps, not what
    # crosses the wire
    sp_grad_weight: SPGradWeight = SPGradWeight.FORWARD_GATHER
    # keep what backward reads only for gradients in float8, cast in forward from high precision:
    # the grad_weight gemm's float8 input, cast as that gemm casts it (gradients bit for bit those
    # of casting in backward), and SwiGLU's inputs (f8dist/swiglu.py, activation_spec); see
    # [Note: what the matmul keeps for backward] in linear.py
    float8_activations_for_backward: bool = False
    # with float8_activations_for_backward, for the linear that reads a SwiGLU's product (an FFN's
    # w2): keep nothing of its input and recompute it in backward from the float8 gate and up the
    # SwiGLU keeps anyway ([Note: a product recomputed in backward] in f8dist/swiglu.py). Its
    # grad_weight gemm then reads silu(gate8) * up8, not the product of the high-precision values:
    # other numerics (docs/performance.md), hence off by default
    recompute_swiglu_product: bool = False
    # for the linears that read an RMSNorm's output (attention's wq/wk/wv, an FFN's w1/w3 in
    # f8dist.models.llama): keep nothing of their input and recompute it in backward from what the
    # norm keeps anyway, its input and rstd ([Note: a norm output recomputed in backward] in
    # f8dist/models/norm.py). Gradients bit for bit those without it; backward pays the norm's
    # pointwise pass and the grad_weight cast once per reader
    recompute_norm_output: bool = False
    # keep the forward's float8 weight for the grad_input gemm instead of re-casting the
    # high-precision weight in backward, where one cast serves both gemms (tensorwise, square
    # weight blocks): backward reads 1 byte per weight element instead of casting again (2 read,
    # 1 written), and each weight's float8 copy stays alive until its backward (+1 byte per
    # element; under FSDP2 with a high-precision all-gather, of the unsharded weight). Compiled,
    # the partitioner then keeps the forward's bytes too. See [Note: what the matmul keeps for
    # backward] in linear.py
    float8_weight_for_backward: bool = False

    # delayed scaling (see f8dist/delayed.py)
    delayed_scaling_config: DelayedScalingConfig = field(default_factory=DelayedScalingConfig)
    # fill the amax histories from the first training step (reduced over the ranks, so step 0
    # casts as one device on the global batch); off: start from scale 1.0
    enable_amax_init: bool = True
    # torchao's deprecated flag, accepted for porting: it has no effect there either (backward
    # re-casts the high-precision weight, [Note: what the matmul keeps for backward])
    force_recompute_fp8_weight_in_bwd: bool = False

    def __post_init__(self):
        if self.force_recompute_fp8_weight_in_bwd:
            warnings.warn(
                "Float8LinearConfig.force_recompute_fp8_weight_in_bwd is deprecated (as in torchao) "
                "and has no effect (backward re-casts the high-precision weight anyway): drop it.",
                DeprecationWarning, stacklevel=3,
            )
        overrides = tuple(_OVERRIDE_FIELD.values())  # None: the operand's main config
        for name in tuple(f"cast_config_{op.value}" for op in Operand) + overrides:
            value = getattr(self, name)
            if not isinstance(value, CastConfig) and not (value is None and name in overrides):
                raise TypeError(f"Float8LinearConfig.{name} must be a CastConfig, got {value!r}")
        for name in (f"gemm_config_{g.value}" for g in Gemm):
            if not isinstance(getattr(self, name), Float8GemmConfig):
                raise TypeError(f"Float8LinearConfig.{name} must be a Float8GemmConfig")

        # A gemm runs in float8 only if both of its operands are cast; half-cast gemms do not exist.
        for gemm in Gemm:
            left, right = gemm.operands
            a, b = self.cast_config(gemm, left), self.cast_config(gemm, right)
            if a.enabled != b.enabled:
                on, off = (left, right) if a.enabled else (right, left)
                raise ValueError(
                    f"the {gemm} gemm casts {on} to float8 but not {off}: a gemm runs either in "
                    f"float8 (both operands cast) or in high precision (both ScalingType.DISABLED); "
                    f"set {_field_name(gemm, on)} to CastConfig(scaling_type=ScalingType.DISABLED) "
                    f"too, or give {_field_name(gemm, off)} a float8 CastConfig"
                )
            if a.enabled and (a.blockwise or b.blockwise):
                _check_block_gemm(gemm, a, b)

        if not isinstance(self.float8_activations_for_backward, bool):
            raise TypeError("Float8LinearConfig.float8_activations_for_backward must be a bool, "
                            f"got {self.float8_activations_for_backward!r}")
        if not isinstance(self.recompute_swiglu_product, bool):
            raise TypeError("Float8LinearConfig.recompute_swiglu_product must be a bool, "
                            f"got {self.recompute_swiglu_product!r}")
        if not isinstance(self.float8_weight_for_backward, bool):
            raise TypeError("Float8LinearConfig.float8_weight_for_backward must be a bool, "
                            f"got {self.float8_weight_for_backward!r}")
        if self.float8_weight_for_backward and not self.cast_specs().weight_same_bytes:
            raise ValueError(
                "float8_weight_for_backward keeps the forward's float8 weight for the grad_input "
                "gemm, so both gemms must cast the weight to the same bytes: a tensorwise weight "
                "cast (dynamic or delayed) or square weight blocks (the 'tensorwise', 'delayed', "
                "'mxfp8_square_weights' and 'blockwise' recipes); got output:weight "
                f"{self.cast_config(Gemm.OUTPUT, Operand.WEIGHT).short_str()}, grad_input:weight "
                f"{self.cast_config(Gemm.GRAD_INPUT, Operand.WEIGHT).short_str()}. Turn it off "
                "for this config")
        if not isinstance(self.recompute_norm_output, bool):
            raise TypeError("Float8LinearConfig.recompute_norm_output must be a bool, "
                            f"got {self.recompute_norm_output!r}")
        if self.recompute_swiglu_product and not self.float8_activations_for_backward:
            raise ValueError(
                "recompute_swiglu_product recomputes an FFN's w2 input in backward from the float8 "
                "gate and up that float8_activations_for_backward keeps: set "
                "float8_activations_for_backward=True too, or drop recompute_swiglu_product")
        if self.float8_activations_for_backward and self.axiswise_requantize_input_for_grad_weight:
            raise ValueError(
                "float8_activations_for_backward and axiswise_requantize_input_for_grad_weight "
                "both decide what the grad_weight gemm reads as its input; set one: "
                "float8_activations_for_backward casts the high-precision input along the token "
                "axis in forward (backward's gradients, bit for bit, 1 byte kept per element), "
                "axiswise_requantize_input_for_grad_weight keeps the forward's float8 copy and "
                "re-scales it in backward (no second cast in forward, a second rounding)"
            )
        if self.axiswise_requantize_input_for_grad_weight:
            fwd = self.cast_config(Gemm.OUTPUT, Operand.INPUT)
            gw = self.cast_config(Gemm.GRAD_WEIGHT, Operand.INPUT)
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

        self._check_sp_grad_weight()

        if self.enable_fsdp_float8_all_gather:
            w = self.cast_config_weight
            square = w.enabled and w.blockwise and self.cast_specs().weight_same_bytes
            if not w.enabled or not (w.scaling_granularity is ScalingGranularity.TENSORWISE
                                     or square):
                raise ValueError(
                    "enable_fsdp_float8_all_gather sends one float8 weight per rank that serves "
                    "both of the weight's gemms, so it needs a tensorwise weight cast (dynamic or "
                    "delayed) or square weight blocks (the 'mxfp8_square_weights' and 'blockwise' "
                    "recipes: [Note: block scales]); set cast_config_weight accordingly or turn "
                    "enable_fsdp_float8_all_gather off (other weights are all-gathered in high "
                    "precision)"
                )

    def _check_sp_grad_weight(self) -> None:
        """``sp_grad_weight`` is an SPGradWeight, and one that changes something for this table
        ([Note: the grad_weight operand of a gathered tensor] in f8dist/cells.py)."""
        object.__setattr__(self, "sp_grad_weight", SPGradWeight.coerce(
            self.sp_grad_weight, "Float8LinearConfig.sp_grad_weight"))
        if self.sp_grad_weight is SPGradWeight.FORWARD_GATHER:
            return
        specs, table = self.cast_specs(), self.short_str()
        if self.sp_grad_weight is SPGradWeight.RECAST and not (
                specs.own_grad_weight_operand(Operand.INPUT)
                or specs.own_grad_weight_operand(Operand.GRAD_OUTPUT)):
            raise ValueError(
                "sp_grad_weight='recast' re-casts a gathered float8 tensor for a grad_weight gemm "
                "in token blocks or high precision, but this config's grad_weight gemm reads the "
                f"gathered float8 as it is or re-scales it already ({table}): leave "
                "sp_grad_weight at 'forward_gather' (tensorwise and rowwise recipes gather one "
                "float8 copy whatever it says)")
        if self.sp_grad_weight is SPGradWeight.BACKWARD_GATHER and not (
                specs.own_grad_weight_operand(Operand.INPUT)
                and specs[Gemm.GRAD_WEIGHT, Operand.INPUT].enabled):
            raise ValueError(
                "sp_grad_weight='backward_gather' all-gathers the grad_weight gemm's token-block "
                "float8 cast of the input in backward, but this config's grad_weight gemm takes "
                f"no such cast ({table}): use 'forward_gather' (one device's numbers: a "
                "high-precision grad_weight gemm's input crosses in high precision) or 'recast' "
                "(the row-block float8 only, a second rounding)")

    # -- the resolved table -------------------------------------------------------------------

    def cast_config(self, gemm: Union[str, Gemm], operand: Union[str, Operand]) -> CastConfig:
        """The CastConfig of ``operand`` ("input", "weight", "grad_output") in ``gemm``
        ("output", "grad_input", "grad_weight")."""
        gemm, operand = _cell(gemm, operand)
        override = getattr(self, _field_name(gemm, operand))
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
        )

    def cast_specs(self, fqn: str = "") -> CastSpecs:
        """All six cast specs of the linear ``fqn``."""
        specs = CastSpecs(tuple(self.cast_spec(g, op, fqn) for g, op in _CELLS))
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
            sp_grad_weight=self.sp_grad_weight,
        )

    def _saved_input(self, specs: CastSpecs) -> SavedInput:
        """What a linear keeps of its input for backward: the one rule ([Note: what the matmul
        keeps for backward] in f8dist/linear.py)."""
        if not specs.gemm_in_float8(Gemm.GRAD_WEIGHT):
            return SavedInput.HIGH_PRECISION  # a high-precision gemm reads the values
        if _same_bytes(specs, Operand.INPUT, Gemm.OUTPUT, Gemm.GRAD_WEIGHT):
            return SavedInput.FORWARD_CAST  # one cast serves both gemms
        if self.float8_activations_for_backward:
            return SavedInput.GRAD_WEIGHT_CAST
        if self.axiswise_requantize_input_for_grad_weight:
            return SavedInput.FORWARD_CAST  # re-scaled along the token axis in backward
        return SavedInput.HIGH_PRECISION

    def activation_spec(self, fqn: str = "") -> Optional[CastSpec]:
        """How an activation that backward reads only to compute gradients is kept, with
        ``float8_activations_for_backward`` (SwiGLU's inputs, f8dist/swiglu.py); None when off.
        e4m3, one dynamic scale per channel: the amax of ``[tokens, channels]`` over the tokens,
        the grad_weight gemm's axis, so a tensor-parallel shard of the channels scales as one
        device and no collective runs. A linear resolves it once (``CastSpecs.activation``, its
        FQN + ".activation": no linear's, so telemetry leaves these casts out)."""
        if not self.float8_activations_for_backward:
            return None
        return CastSpec(
            dtype=E4M3, granularity=ScalingGranularity.AXISWISE, axis=0,
            round_scales_to_power_of_2=self.round_scales_to_power_of_2,
            gemm=Gemm.GRAD_WEIGHT, operand=Operand.INPUT, fqn=fqn,
        )

    def grouped_cast_specs(self, fqn: str = "") -> CastSpecs:
        """The six casts of the grouped (expert) gemm ``fqn``: this config's table with
        ``grouped=True`` ([Note: grouped casts] in f8dist/specs.py). The flags a linear derives
        from its options (``saved_input``, ``save_float8_weight``, ...) keep their defaults:
        experts keep their own way, and refuse the options that would change it ([Note: options
        of grouped experts] in f8dist/grouped.py).

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
            specs.append(dataclasses.replace(spec, dtype=E4M3, grouped=True))
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
        """A config by recipe name: a :class:`Float8LinearRecipeName` or its value
        ("tensorwise", "rowwise", ...), the one list of recipes that the auto filter, the
        torchtitan converters and scripts/train.py derive theirs from."""
        try:
            recipe_name = Float8LinearRecipeName(recipe_name)
        except ValueError:
            raise ValueError(
                f"Float8LinearConfig.from_recipe_name: unknown recipe_name {recipe_name!r}; "
                f"known recipes: {[r.value for r in Float8LinearRecipeName]}"
            ) from None

        return Float8LinearConfig(**recipe_fields(recipe_name.value))
