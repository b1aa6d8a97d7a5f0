"""Configuration of float8 training: how each operand of each gemm is cast.

A :class:`Float8LinearConfig` is a table. Rows are the three gemms of a linear layer (see
``[Note: gemms]`` in ``f8dist/linear.py``), columns are their two operands, and each cell is a
:class:`CastConfig`::

    gemm          left operand                    right operand
    output        input                           weight (transposed)
    grad_input    grad_output                     weight  (cast_config_weight_for_grad_input)
    grad_weight   grad_output (transposed)        input   (cast_config_*_for_grad_weight)

The config is what users write (torchao's field names). What the code reads is its resolution:
``config.cast_spec(gemm, operand)``, one frozen :class:`CastSpec` per cell, which holds everything
a cast needs (float8 dtype, granularity, contraction axis, power-of-2 rounding, gemm options,
scaling type). ``Gemm`` and ``Operand`` name the rows and columns; this module is the one place
their tables live.

All configs are frozen and keyword-only; contradictions are rejected in ``__post_init__`` with a
message that says what to change.
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple, Union

import torch

__all__ = [
    "ScalingType", "ScalingGranularity", "Gemm", "Operand", "CastConfig", "CastSpec", "CastSpecs",
    "CastSite", "DelayedScalingConfig", "Float8GemmConfig", "Float8LinearConfig",
    "Float8LinearRecipeName", "SavedInput", "ScaledMMConfig", "ScaleRounding", "SPGradWeight",
    "E4M3", "E5M2", "E8M0",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_FLOAT8_DTYPES = (E4M3, E5M2)
E8M0 = torch.float8_e8m0fnu  # a power of 2 per byte: MX block scales
_SCALE_DTYPES = (torch.float32, E8M0)


class _Name(str, enum.Enum):
    """An enum whose members compare equal to, print as and serialize as their string value."""

    def __str__(self) -> str:
        return self.value

    __hash__ = str.__hash__  # hash like the string it equals

    @classmethod
    def coerce(cls, value, field: str):
        """``value`` (a member or its string) as a member; else an error naming the field, the
        value and the values it takes."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{field} must be one of {[m.value for m in cls]} (strings or "
                             f"{cls.__name__} members), got {value!r}") from None


class Operand(_Name):
    """A tensor that a linear layer casts to float8."""

    INPUT = "input"
    WEIGHT = "weight"
    GRAD_OUTPUT = "grad_output"

    @property
    def default_dtype(self) -> torch.dtype:
        """e4m3 for values (input, weight), e5m2 for gradients (more range, less precision)."""
        return E5M2 if self is Operand.GRAD_OUTPUT else E4M3

    @property
    def gemms(self) -> Tuple["Gemm", "Gemm"]:
        """The two gemms this operand enters."""
        return tuple(g for g in Gemm if self in g.operands)


class Gemm(_Name):
    """One of the three gemms of a linear layer ([Note: gemms] in f8dist/linear.py)."""

    OUTPUT = "output"
    GRAD_INPUT = "grad_input"
    GRAD_WEIGHT = "grad_weight"

    @property
    def operands(self) -> Tuple[Operand, Operand]:
        """(left, right) operand."""
        return _GEMM_OPERANDS[self]


_GEMM_OPERANDS = {
    Gemm.OUTPUT: (Operand.INPUT, Operand.WEIGHT),
    Gemm.GRAD_INPUT: (Operand.GRAD_OUTPUT, Operand.WEIGHT),
    Gemm.GRAD_WEIGHT: (Operand.GRAD_OUTPUT, Operand.INPUT),
}

# The contraction dim of each operand in each gemm, in the operand's own [rows, cols] layout
# (input [M, K], weight [N, K], grad_output [M, N]): an axiswise cast takes its amax over it.
_CONTRACTION_AXIS = {
    (Gemm.OUTPUT, Operand.INPUT): -1,  # K
    (Gemm.OUTPUT, Operand.WEIGHT): -1,  # K
    (Gemm.GRAD_INPUT, Operand.GRAD_OUTPUT): -1,  # N
    (Gemm.GRAD_INPUT, Operand.WEIGHT): 0,  # N
    (Gemm.GRAD_WEIGHT, Operand.GRAD_OUTPUT): 0,  # M
    (Gemm.GRAD_WEIGHT, Operand.INPUT): 0,  # M
}

# [Note: any token count]
# The grad_weight gemm contracts over M, the number of tokens: the batch decides it, not the layer,
# and 3 x 5 tokens, or 8 per rank, must train. Zero-padding M to a multiple of 16 is exact (zero
# products) and changes no scale: this gemm's axiswise casts reduce over M (one scale per column
# of the layer) and zeros do not raise an amax. So its ScaledMMConfig has pad_k: the gemm pads M
# in the copy that lays out its two transposed operands for the kernel, a copy it makes anyway
# (compiled, the same kernels; with dynamic token counts the graph specializes on M % 16 == 0).
# The layer's own dims K and N still need pad_inner_dim (a clear error says so).

# [Note: grouped casts]
# An expert's gemms (f8dist/grouped.py) use the same table as a linear's, with
# ``CastSpec.grouped``: the weight is 3-D, [experts, out, in], and the token operands (input,
# grad_output, [M, C]) are jagged groups of rows, one per expert ([Note: token groups] in
# f8dist/scaling.py). The cell's granularity and axis mean, per expert:
#   * axiswise, contraction along the row (output and grad_input gemms): one scale per token, and
#     one per expert and row (or column) of the weight, [E, N, 1] (or [E, 1, K]);
#   * axiswise over the tokens (grad_weight): one scale per expert and column, over the expert's
#     token group ([E, C]; stored per row as [M, C] so that the Float8Tensor dequantizes);
#   * tensorwise: one scale per expert, for the weight ([E, 1, 1]) and for each token group;
#   * blockwise ([Note: block scales]): the weight blocked per expert ([E, N/bn, K/bk] scales,
#     [Note: blocks of expert weights] in f8dist/scaling.py); tokens blocked along the row
#     (output, grad_input: 1 x inner blocks, local to a token) or, in grad_weight, along the
#     tokens within each expert's group: the gemm pads every group to a multiple of the block
#     first (zero rows, exact), so that no block holds tokens of two experts ([Note: block
#     grouped gemms] in f8dist/grouped.py).
# All are e4m3: torch._scaled_grouped_mm takes no e5m2 operand.

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
    BLOCKWISE = "blockwise"  # one scale per block of CastConfig.block_size ([Note: block scales])

    def short_str(self) -> str:
        return {"tensorwise": "ten", "axiswise": "axs", "blockwise": "blk"}[self.value]


class ScaleRounding(_Name):
    """How a block's amax becomes a power-of-2 (e8m0) scale ([Note: e8m0 rounding])."""

    RCEIL = "rceil"  # NVIDIA's (cuBLAS, Transformer Engine): the largest power of 2 that fits
    FLOOR = "floor"  # OCP MX v1.0: 2**(floor(log2(amax)) - emax), may saturate a block's top


# [Note: block scales]
# A BLOCKWISE cast scales each block of ``CastConfig.block_size = (outer, inner)`` elements by its
# own amax, ``inner`` along the gemm's contraction dim and ``outer`` across it, so the one config of
# an operand serves both of its gemms: MXFP8's (1, 32) blocks run along K for the output gemm's
# input and along the tokens M for the grad_weight gemm's input, each cast from the
# high-precision tensor (never from float8 twice). Both operands of a gemm must agree on ``inner``
# (the kernel multiplies block products by one scale pair). A square block, (32, 32) or (128, 128),
# is the same block in both gemms of an operand, so one float8 weight serves forward and backward
# (``CastSpecs.weight_same_bytes``): a weight that arrives in float8 needs no second cast. Scales are float32 (DeepSeek-V3) or ``float8_e8m0fnu`` (MX, a
# power of 2 per byte, rounded as ``scale_rounding`` says). A block cut short by the tensor's edge
# is zero-padded, which changes neither its amax nor any product: the token dim M may be anything;
# the layer's own dims K and N must divide into blocks (or pad_inner_dim).
#
# [Note: row blocks of N-D activations]
# A 1 x inner block along the last dim is local to one token, so an N-D activation ([B, S, K],
# what a sequence-parallel style casts before its all-gather) takes row blocks as its [B * S, K]
# view does: ``_block = (1, inner)`` and scales [B, S, ceil(K / inner)]. They follow the data
# through reshapes that keep the last dim and through splits, cats and all-gathers of the other
# dims (f8dist/tensor.py), so a cast before the all-gather gives the bytes and scales of a cast
# after it, bit for bit.
#
# [Note: token blocks of N-D activations]
# The grad_weight gemm blocks its operands along the tokens: (inner, 1) blocks of the [M, K] view,
# M = B * S tokens in row-major order, so on one device a block may hold the end of one sequence
# and the start of the next. A sequence-parallel style casts the [B, S / tp, K] shard it holds
# ([Note: two casts of one tensor] in f8dist/tensor.py), so an N-D operand in token blocks is
# blocked along dim -2 (the sequence) within each sequence: ``block_shape`` (inner, 1) over its
# last two dims, 1 along the others, scales [B, ceil(S / inner), K]. Those are the [M, K] view's
# blocks, and a shard's blocks are the logical tensor's, exactly when every sequence holds whole
# blocks (S % inner == 0; or B = 1) and every sequence shard does (S / tp % inner == 0): the rule
# of ``blocks_split_by_shards`` (f8dist/placement.py), by which the style falls back to a
# high-precision all-gather where it does not hold (e.g. 1x128 blocks need 128 * tp tokens per
# sequence; MXFP8's 1x32, 32 * tp).
#
# [Note: the grad_weight operand of a gathered tensor]
# A sequence-parallel style casts an activation shard before its all-gather in the output gemm's
# row blocks (1 x K); the grad_weight gemm wants the same tensor in token blocks (or in high
# precision), which cannot be derived from the row-block bytes without a second rounding.
# ``Float8LinearConfig.sp_grad_weight`` (an :class:`SPGradWeight`) chooses how that gemm gets it,
# for the input a style gathers in forward and the gradient the rowwise style gathers in backward
# (the rule is ``_grad_weight_cast`` in f8dist/tp/style.py, [Note: the grad_weight gemm under
# sequence parallelism]); tensorwise and rowwise recipes gather one float8 copy whatever it says,
# so it applies to block recipes and high-precision grad_weight gemms only:
#
#   FORWARD_GATHER (default)  both casts in the forward all-gather (the token-block one as the
#                             row-block one's companion), or high precision: one device's numbers;
#                             2 x (1 byte + scales) per element (1.03x bf16), the linear keeps the
#                             gathered token-block cast (1 byte per gathered element)
#   RECAST                    the row-block cast only (1 byte + scales: 0.52x bf16), in forward
#                             and, for the gradient, in backward; the grad_weight gemm re-casts
#                             the gathered float8 (a second rounding: weight gradients no longer
#                             one device's, docs/numerics.md)
#   BACKWARD_GATHER           forward gathers the row-block cast only and the style keeps the
#                             local shard's token-block cast; the linear all-gathers it in
#                             backward (Transformer Engine's way): the bytes of FORWARD_GATHER,
#                             one device's numbers, 1 / tp of the token-block cast kept between
#                             forward and backward, one more all-gather per linear in backward.
#                             Token-block grad_weight gemms only (a high-precision one reads the
#                             values: FORWARD_GATHER or RECAST); the gradient travels as in
#                             FORWARD_GATHER (its all-gather is in backward already)
#
# FORWARD_GATHER is the default because it is exact and costs no collective more (the step's
# all-gathers are one per tensor); the others trade numerics for bytes, or a backward all-gather
# for memory. Linears that read one shared input (``PrepareFloat8ModuleInput``) get the cast its
# ``fwd_config_submodule_fqn`` linear's config makes: a linear whose config asks for one device's
# grad_weight operand and finds none fitting on its float8 input raises, naming the fix.
#
# [Note: e8m0 rounding]
# RCEIL (default) picks the dequantizing scale 2**ceil(log2(amax / fp8_max)): the largest power of
# 2 that maps the block's amax inside the format, so no element saturates. It is what NVIDIA's
# hardware conversion (cvt.rp.satfinite.ue8m0), cuBLAS's MXFP8 recipe and Transformer Engine use,
# and what torchao's MXFP8 training defaults to. FLOOR is the OCP MX v1.0 rule,
# 2**(floor(log2(amax)) - emax): one power of 2 more resolution for blocks whose amax mantissa is
# below fp8_max's, but elements above fp8_max * 2**(e) clamp (e4m3: amax in (448, 512) * 2**e).
# scripts/sqnr_table.py compares the two.


@dataclass(frozen=True, kw_only=True)
class CastConfig:
    """How one gemm operand is cast to float8.

    ``target_dtype=None`` means the operand's default: e4m3 for input and weight, e5m2 for
    grad_output (see :meth:`Float8LinearConfig.resolved_dtype`).
    """

    scaling_type: ScalingType = ScalingType.DYNAMIC
    scaling_granularity: ScalingGranularity = ScalingGranularity.TENSORWISE
    target_dtype: Optional[torch.dtype] = None
    # BLOCKWISE only ([Note: block scales]): (outer, inner) elements per block, inner along the
    # gemm's contraction dim; the dtype scales are kept in; how e8m0 scales round
    block_size: Optional[Tuple[int, int]] = None
    scale_dtype: torch.dtype = torch.float32
    scale_rounding: ScaleRounding = ScaleRounding.RCEIL

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
                "for axiswise or blockwise scaling"
            )
        _check_block(self)

    @property
    def enabled(self) -> bool:
        return self.scaling_type is not ScalingType.DISABLED

    @property
    def blockwise(self) -> bool:
        return self.scaling_granularity is ScalingGranularity.BLOCKWISE

    def short_str(self) -> str:
        dtype = {None: "dflt", E4M3: "e4m3", E5M2: "e5m2"}[self.target_dtype]
        gran = self.scaling_granularity.short_str()
        if self.blockwise:
            scale = "e8m0" if self.scale_dtype == E8M0 else "f32"
            gran = f"{gran}{self.block_size[0]}x{self.block_size[1]}{scale}"
        return f"{self.scaling_type.short_str()}_{gran}_{dtype}"


def _check_block(cc: "CastConfig") -> None:
    """The block fields of a CastConfig ([Note: block scales]), with the fix in each message."""
    object.__setattr__(cc, "scale_rounding",
                       ScaleRounding.coerce(cc.scale_rounding, "CastConfig.scale_rounding"))
    if not cc.blockwise:
        if (cc.block_size is not None or cc.scale_dtype != torch.float32
                or cc.scale_rounding is not ScaleRounding.RCEIL):
            raise ValueError(
                f"CastConfig.block_size, scale_dtype and scale_rounding describe block scales; "
                f"with scaling_granularity={cc.scaling_granularity} leave them unset (got "
                f"block_size={cc.block_size}, scale_dtype={cc.scale_dtype}, scale_rounding="
                f"{cc.scale_rounding}) or use ScalingGranularity.BLOCKWISE"
            )
        return
    bs = cc.block_size
    if not (isinstance(bs, tuple) and len(bs) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in bs)):
        raise ValueError(
            "ScalingGranularity.BLOCKWISE needs CastConfig.block_size=(outer, inner), two positive "
            f"ints (inner along the gemm's contraction dim), e.g. (1, 32) for MXFP8, (1, 128) or "
            f"(128, 128) for DeepSeek-V3's blockwise recipe; got {bs!r}"
        )
    if bs[1] % 16:
        raise ValueError(
            f"CastConfig.block_size={bs}: the inner (contraction) block must be a multiple of 16, "
            "the float8 gemm's alignment (32 for MXFP8, 128 for DeepSeek-V3)"
        )
    if cc.scale_dtype not in _SCALE_DTYPES:
        raise ValueError(
            f"CastConfig.scale_dtype must be torch.float32 or torch.float8_e8m0fnu, got "
            f"{cc.scale_dtype}"
        )
    if cc.scale_rounding is not ScaleRounding.RCEIL and cc.scale_dtype != E8M0:
        raise ValueError(
            f"CastConfig.scale_rounding={cc.scale_rounding} rounds e8m0 scales; float32 scales "
            "are exact (set Float8LinearConfig.round_scales_to_power_of_2 for powers of 2): "
            "use scale_dtype=torch.float8_e8m0fnu or leave scale_rounding at RCEIL"
        )


class SPGradWeight(_Name):
    """How the grad_weight gemm gets a sequence-parallel operand that a tensor-parallel style
    all-gathers in float8 ([Note: the grad_weight operand of a gathered tensor])."""

    FORWARD_GATHER = "forward_gather"  # both casts cross in forward: exact, 1.03x bf16
    RECAST = "recast"  # the row-block cast only, re-cast for grad_weight: 0.52x bf16, not exact
    BACKWARD_GATHER = "backward_gather"  # token-block shard kept, gathered in backward: exact


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


@dataclass(frozen=True)
class ScaledMMConfig:
    """How a float8 gemm runs (from the config of the linear whose gemm it is). Hashable: it
    is compile-time metadata of every Float8Tensor."""

    emulate: bool = False
    use_fast_accum: bool = False
    pad_inner_dim: bool = False  # zero-pad K and N to multiples of 16
    pad_k: bool = False  # zero-pad K: the grad_weight gemm's ([Note: any token count])


@dataclass(frozen=True, kw_only=True)
class CastSpec:
    """Everything one cast to float8 needs: the resolved cell ``(gemm, operand)`` of a
    :class:`Float8LinearConfig` for the linear ``fqn``. Made by ``Float8LinearConfig.cast_spec``;
    ``f8dist.cast.cast_to_float8(t, spec)`` is the cast.

    ``axis`` is the gemm's contraction dim in the operand's own layout; an axiswise cast takes one
    scale per slice along it (its amax reduces over it). ``scaling_type`` DISABLED: the operand
    stays in high precision (the gemm does too).

    Example::

        >>> spec = Float8LinearConfig.from_recipe_name("rowwise").cast_spec("grad_weight", "input")
        >>> spec.dtype, spec.granularity.value, spec.axis
        (torch.float8_e4m3fn, 'axiswise', 0)
        >>> cast_to_float8(torch.randn(32, 16), CastSpec(dtype=E4M3))  # doctest: +SKIP
    """

    dtype: torch.dtype = E4M3
    granularity: ScalingGranularity = ScalingGranularity.TENSORWISE
    axis: int = -1
    scaling_type: ScalingType = ScalingType.DYNAMIC
    round_scales_to_power_of_2: bool = False
    mm_config: ScaledMMConfig = ScaledMMConfig()
    gemm: Gemm = Gemm.OUTPUT
    operand: Operand = Operand.INPUT
    fqn: str = ""
    # BLOCKWISE: (outer, inner) of [Note: block scales], the scales' dtype and e8m0 rounding
    block_size: Optional[Tuple[int, int]] = None
    scale_dtype: torch.dtype = torch.float32
    scale_rounding: ScaleRounding = ScaleRounding.RCEIL
    # a cast for a grouped (expert) gemm: [Note: grouped casts]
    grouped: bool = False

    def __post_init__(self):
        object.__setattr__(self, "gemm", Gemm.coerce(self.gemm, "CastSpec.gemm"))
        object.__setattr__(self, "operand", Operand.coerce(self.operand, "CastSpec.operand"))
        if self.dtype not in _FLOAT8_DTYPES:
            raise ValueError(f"CastSpec.dtype must be a float8 dtype {_FLOAT8_DTYPES}, got {self.dtype}")
        if not isinstance(self.axis, int):
            raise TypeError(f"CastSpec.axis must be an int (a dim of the operand), got {self.axis!r}")
        # the rest is validated where it comes from (CastConfig)
        CastConfig(scaling_type=self.scaling_type, scaling_granularity=self.granularity,
                   block_size=self.block_size, scale_dtype=self.scale_dtype,
                   scale_rounding=self.scale_rounding)

    @property
    def enabled(self) -> bool:
        return self.scaling_type is not ScalingType.DISABLED

    @property
    def axiswise(self) -> bool:
        return self.granularity is ScalingGranularity.AXISWISE

    @property
    def blockwise(self) -> bool:
        return self.granularity is ScalingGranularity.BLOCKWISE

    def axiswise_dim(self, ndim: int) -> Optional[int]:
        """The dim (of an ``ndim``-D operand) an axiswise cast reduces over; None otherwise."""
        return self.axis % ndim if self.axiswise else None

    def block_shape(self, ndim: int) -> Optional[Tuple[int, int]]:
        """The block in the operand's own [rows, cols] layout (``block_size``'s inner along
        ``axis``); None unless blockwise. Block scales are defined for 2-D operands, for the
        3-D weights of grouped casts, blocked per expert in their last two dims ([Note: grouped
        casts]), for N-D operands whose blocks are rows of the last dim (a [B, S, K]
        activation in 1 x K blocks: [Note: row blocks of N-D activations]) and for N-D operands
        of the grad_weight gemm, in token blocks along dim -2 ([Note: token blocks of N-D
        activations])."""
        if not self.blockwise:
            return None
        outer, inner = self.block_size
        if ndim == 2 or (ndim == 3 and self.grouped):  # a matrix, or each expert's matrix
            return (outer, inner) if self.axis % 2 == 1 else (inner, outer)
        if outer == 1 and self.axis % ndim == ndim - 1:  # rows of the last dim
            return (outer, inner)
        if outer == 1 and self.axis == 0:  # the tokens: [Note: token blocks of N-D activations]
            return (inner, outer)
        raise NotImplementedError(
            f"{self.site}: block scales are defined for 2-D operands, expert weights and rows of "
            f"an N-D one's last dim, got a {ndim}-D one with {self.block_size} blocks along dim "
            f"{self.axis}; use a tensorwise or rowwise recipe for this layer (module_filter_fn)"
        )

    @property
    def site(self) -> "CastSite":
        return CastSite(self.fqn, self.gemm, self.operand)


@dataclass(frozen=True)
class CastSite:
    """Where a cast happens: module FQN, gemm and operand (what telemetry is keyed by). The
    enums hash and compare like their strings: ``CastSite("0", "output", "input")`` finds it."""

    fqn: str
    gemm: Gemm
    operand: Operand

    def __str__(self):
        return f"{self.fqn or '<root>'}:{self.gemm}:{self.operand}"


class SavedInput(_Name):
    """What a linear keeps of its input for the grad_weight gemm: the one rule is
    ``Float8LinearConfig._saved_input`` ([Note: what the matmul keeps for backward] in
    f8dist/linear.py)."""

    HIGH_PRECISION = "high_precision"  # the input; backward casts it, or its gemm reads it as is
    FORWARD_CAST = "forward_cast"  # the output gemm's float8 input (axiswise: re-scaled later)
    GRAD_WEIGHT_CAST = "grad_weight_cast"  # cast in forward as the grad_weight gemm casts it


@dataclass(frozen=True)
class CastSpecs:
    """The six :class:`CastSpec` of one linear, by ``(gemm, operand)``: what Float8Linear
    computes once from its config. Hashable (compile-time constant of the float8 matmul)."""

    specs: Tuple[CastSpec, ...]
    # what the forward keeps of the input for backward's grad_weight gemm (see [Note: what the
    # matmul keeps for backward] in f8dist/linear.py)
    saved_input: SavedInput = SavedInput.HIGH_PRECISION
    # backward casts grad_output once for both of its gemms (tensorwise: the same bytes)
    cast_grad_output_once: bool = False
    # backward's weight cast takes its amax from the forward's weight cast instead of reading the
    # weight again (see [Note: what the matmul keeps for backward] in f8dist/linear.py)
    weight_amax_from_forward: bool = False
    # the weight casts to the same float8 bytes for the output and grad_input gemms (tensorwise,
    # or square blocks: [Note: block scales]), so a float8 weight serves both as it is
    weight_same_bytes: bool = False
    # the forward keeps its float8 weight for the grad_input gemm (weight_same_bytes, with
    # Float8LinearConfig.float8_weight_for_backward): see [Note: what the matmul keeps for
    # backward] in f8dist/linear.py
    save_float8_weight: bool = False
    # how the activations that produce this linear's input keep what their backward reads
    # (SwiGLU's inputs before an FFN's w2, f8dist/swiglu.py); None: in high precision
    activation: Optional[CastSpec] = None
    # how the grad_weight gemm gets an operand a tensor-parallel style gathers in float8 ([Note:
    # the grad_weight operand of a gathered tensor])
    sp_grad_weight: SPGradWeight = SPGradWeight.FORWARD_GATHER

    def __getitem__(self, cell: Tuple[Gemm, Operand]) -> CastSpec:
        gemm, operand = cell
        return self.specs[_CELLS.index((gemm, operand))]

    @property
    def save_float8_input(self) -> bool:
        """Whether the forward casts the input once, for the output gemm and for backward."""
        return self.saved_input is SavedInput.FORWARD_CAST

    def gemm_in_float8(self, gemm: Gemm) -> bool:
        return self[gemm, gemm.operands[0]].enabled

    def own_grad_weight_operand(self, operand: Operand) -> bool:
        """Whether the grad_weight gemm reads ``operand`` (the input, or grad_output) otherwise
        than the float8 cast a tensor-parallel style communicates of it (the output gemm's, or
        the grad_input gemm's): in high precision, or in token blocks where that cast has row
        blocks. Then it needs its own operand sent along, kept, or re-cast ([Note: the grad_weight
        operand of a gathered tensor]); otherwise it reads or re-scales the communicated bytes."""
        sent = self[_COMMUNICATED[Operand(operand)], operand]
        gw = self[Gemm.GRAD_WEIGHT, operand]
        return sent.enabled and (not gw.enabled or (
            gw.blockwise and gw.block_shape(2) != sent.block_shape(2)))

    def __iter__(self):
        return iter(self.specs)


_CELLS = tuple(_CONTRACTION_AXIS)
# the gemm whose cast of an operand a tensor-parallel style communicates (f8dist/tp/style.py)
_COMMUNICATED = {Operand.INPUT: Gemm.OUTPUT, Operand.GRAD_OUTPUT: Gemm.GRAD_INPUT}


def _same_bytes(specs: CastSpecs, operand: Operand, a: Gemm, b: Gemm) -> bool:
    """Whether ``operand`` casts to the same float8 bytes in gemms ``a`` and ``b``: a tensorwise
    cast, or a blockwise one whose block is the same in the operand's layout (square), with the
    same dtype, scaling and rounding (only the gemm options may differ)."""
    sa, sb = specs[a, operand], specs[b, operand]
    return sa.enabled and not sa.axiswise and sa.block_shape(2) == sb.block_shape(2) and (
        dataclasses.replace(sb, gemm=sa.gemm, axis=sa.axis, mm_config=sa.mm_config) == sa)


def _amax_follows(specs: CastSpecs, operand: Operand, a: Gemm, b: Gemm) -> bool:
    """Whether ``operand``'s amax in gemm ``b`` follows from its amax in gemm ``a`` (the same
    tensor): both casts compute their amax, and ``b``'s is tensorwise, the max of ``a``'s amaxes
    whatever ``a``'s granularity."""
    sa, sb = specs[a, operand], specs[b, operand]
    return (sa.scaling_type is sb.scaling_type is ScalingType.DYNAMIC and not sb.axiswise
            and not sa.blockwise and not sb.blockwise)


def _check_block_gemm(gemm: Gemm, a: CastConfig, b: CastConfig) -> None:
    """A float8 gemm with block scales: both operands blockwise, one contraction block, one
    scale dtype ([Note: block scales])."""
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


def _mx(block_size: Tuple[int, int] = (1, 32)) -> CastConfig:
    """An MXFP8 cast: e4m3 with one e8m0 scale per ``block_size`` block (RCEIL)."""
    return CastConfig(scaling_granularity=ScalingGranularity.BLOCKWISE, target_dtype=E4M3,
                      block_size=block_size, scale_dtype=E8M0)


def _deepseek(block_size: Tuple[int, int]) -> CastConfig:
    """A DeepSeek-V3 blockwise cast: e4m3 with one float32 scale per ``block_size`` block."""
    return CastConfig(scaling_granularity=ScalingGranularity.BLOCKWISE, target_dtype=E4M3,
                      block_size=block_size)


class Float8LinearRecipeName(enum.Enum):
    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    ROWWISE_WITH_GW_HP = "rowwise_with_gw_hp"
    DELAYED = "delayed"
    MXFP8 = "mxfp8"  # 1x32 blocks, e8m0 scales, e4m3 everywhere ([Note: block scales])
    MXFP8_WGRAD_WITH_HP = "mxfp8_wgrad_with_hp"  # mxfp8, grad_weight gemm in high precision
    MXFP8_SQUARE_WEIGHTS = "mxfp8_square_weights"  # mxfp8 with 32x32 weight blocks
    BLOCKWISE = "blockwise"  # DeepSeek-V3: 1x128 activations and gradients, 128x128 weights


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
    # backward, exact): [Note: the grad_weight operand of a gathered tensor]. Beside
    # axiswise_requantize_input_for_grad_weight, which is about what a linear keeps, not what
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
        ([Note: the grad_weight operand of a gathered tensor])."""
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
        ``grouped=True`` ([Note: grouped casts]). The flags a linear derives from its options
        (``saved_input``, ``save_float8_weight``, ...) keep their defaults: experts keep their
        own way, and refuse the options that would change it ([Note: options of grouped
        experts] in f8dist/grouped.py).

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

        # [Note: block scales]: e4m3 everywhere (a scale per 32 or 128 elements leaves e5m2's
        # range nothing to do), every operand re-cast from high precision per gemm
        if recipe_name is Float8LinearRecipeName.MXFP8:
            return Float8LinearConfig(
                cast_config_input=_mx(), cast_config_weight=_mx(), cast_config_grad_output=_mx())

        if recipe_name is Float8LinearRecipeName.MXFP8_WGRAD_WITH_HP:
            disabled = CastConfig(scaling_type=ScalingType.DISABLED)
            return Float8LinearConfig(
                cast_config_input=_mx(), cast_config_weight=_mx(), cast_config_grad_output=_mx(),
                cast_config_input_for_grad_weight=disabled,
                cast_config_grad_output_for_grad_weight=disabled,
            )

        if recipe_name is Float8LinearRecipeName.MXFP8_SQUARE_WEIGHTS:
            # 32x32 weight blocks: one float8 weight serves the output and grad_input gemms
            return Float8LinearConfig(
                cast_config_input=_mx(), cast_config_weight=_mx((32, 32)),
                cast_config_grad_output=_mx())

        if recipe_name is Float8LinearRecipeName.BLOCKWISE:
            # DeepSeek-V3: 1x128 tiles for activations and gradients, 128x128 weight blocks
            return Float8LinearConfig(
                cast_config_input=_deepseek((1, 128)), cast_config_weight=_deepseek((128, 128)),
                cast_config_grad_output=_deepseek((1, 128)))

        raise AssertionError(recipe_name)
