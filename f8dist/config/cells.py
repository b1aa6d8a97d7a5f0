"""The gemm x operand table of a linear layer: its rows (:class:`Gemm`), columns
(:class:`Operand`), the contraction axis of each cell, the names a cell's cast is described by
(:class:`ScalingType`, :class:`ScalingGranularity`, :class:`ScaleRounding`), and
:class:`CastConfig`, the config of one cell::

    gemm          left operand                    right operand
    output        input                           weight (transposed)
    grad_input    grad_output                     weight  (cast_config_weight_for_grad_input)
    grad_weight   grad_output (transposed)        input   (cast_config_*_for_grad_weight)

(``[Note: gemms]`` in ``f8dist/nn/linear.py``.) The one place the table's names and axes live.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

__all__ = [
    "ScalingType", "ScalingGranularity", "ScaleRounding", "Gemm", "Operand", "CastConfig",
    "SavedInput", "SPGradWeight", "E4M3", "E5M2", "E8M0", "E2M1",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E2M1 = torch.float4_e2m1fn_x2  # NVFP4's elements ([Note: NVFP4])
_FLOAT8_DTYPES = (E4M3, E5M2, E2M1)
E8M0 = torch.float8_e8m0fnu  # a power of 2 per byte: MX block scales
_SCALE_DTYPES = (torch.float32, E8M0, E4M3)
# NVFP4's blocks (outer, inner): 1x16 activations and gradients, 16x16 weights
_NVFP4_BLOCKS = ((1, 16), (16, 16))


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
    """One of the three gemms of a linear layer ([Note: gemms] in f8dist/nn/linear.py)."""

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

# each cell's contraction dim in the operand's layout (input [M, K], weight [N, K], grad_output
# [M, N]): an axiswise cast takes its amax over it
_CONTRACTION_AXIS = {
    (Gemm.OUTPUT, Operand.INPUT): -1,  # K
    (Gemm.OUTPUT, Operand.WEIGHT): -1,  # K
    (Gemm.GRAD_INPUT, Operand.GRAD_OUTPUT): -1,  # N
    (Gemm.GRAD_INPUT, Operand.WEIGHT): 0,  # N
    (Gemm.GRAD_WEIGHT, Operand.GRAD_OUTPUT): 0,  # M
    (Gemm.GRAD_WEIGHT, Operand.INPUT): 0,  # M
}

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
# A BLOCKWISE cast scales each ``CastConfig.block_size = (outer, inner)`` block by its own amax,
# ``inner`` along the gemm's contraction dim, so one config serves both gemms of an operand (e.g.
# MXFP8's (1, 32) along K, then along M), each cast from high precision. Both operands of a gemm
# must agree on ``inner`` (one scale pair per block product). A square block is the same in both
# gemms, so one float8 weight serves forward and backward (``CastSpecs.weight_same_bytes``).
# Scales are float32 or e8m0 ([Note: e8m0 rounding]). Edge blocks are zero-padded (amax and
# products unchanged), so M may be anything; K and N must divide into blocks (or pad_inner_dim).
# [Note: the grad_weight operand of a gathered tensor]
# A sequence-parallel style gathers an activation in the output gemm's row blocks; the grad_weight
# gemm wants token blocks (or high precision), which the row-block bytes cannot give without a
# second rounding. ``Float8LinearConfig.sp_grad_weight`` chooses, for block recipes and
# high-precision grad_weight gemms (rule: [Note: the grad_weight gemm under sequence parallelism]
# in f8dist/parallel/tp/style.py):
#
#   FORWARD_GATHER (default)  both casts cross in the forward all-gather (or high precision):
#                             exact, no extra collective; the linear keeps the token-block cast
#   RECAST                    the row-block cast only; grad_weight re-casts it: fewer bytes, not
#                             one device's weight gradients
#   BACKWARD_GATHER           the style keeps the shard's token-block cast and the linear
#                             all-gathers it in backward (Transformer Engine's way): exact, 1 / tp
#                             of it kept; token-block grad_weight gemms only
#   DERIVE                    the row-block cast only, and every Float8Linear, on one device too,
#                             derives the grad_weight gemm's token blocks from the other gemms'
#                             row blocks (dequantize, re-cast: DeepSeek-V3's way): one device's
#                             numbers under this choice, at RECAST's bytes; other numbers than
#                             the direct cast's (scripts/sp_grad_weight_sqnr.py)
#
# Byte figures: docs/performance.md. Linears sharing one input (``PrepareFloat8ModuleInput``) get
# its named linear's cast; one whose config finds no fitting grad_weight operand raises.
#
# [Note: NVFP4]
# ``target_dtype=E2M1`` (torch.float4_e2m1fn_x2, NVIDIA's NVFP4): e2m1 values (0, 0.5, 1, 1.5, 2,
# 3, 4, 6 and their negatives) in 1x16 blocks (16x16 for weights), each block with an e4m3 scale,
# and one float32 scale for the whole tensor under them (two levels: a block's e4m3 scale is
# amax_block / 6 / tensor_scale, the tensor scale amax / (448 * 6), so the block scales use
# e4m3's range). Both scales are decode scales (what dequantizing multiplies by: 1 / e4m3 is no
# e4m3), the tensor scale read from the logical tensor's amax ([Note: amax]). E2M1 goes with
# block scales in e4m3 only, and e4m3 block scales with E2M1 only; the scale math is
# ``nvfp4_cast`` in f8dist/core/scaling.py, the gemm ``[Note: the NVFP4 gemm]`` in
# f8dist/core/gemm.py. The data is packed two values a byte ([Note: packed e2m1] in
# f8dist/core/scaling.py).
#
# [Note: e8m0 rounding]
# RCEIL (default; NVIDIA's cvt.rp.satfinite.ue8m0, cuBLAS, Transformer Engine, torchao) picks
# 2**ceil(log2(amax / fp8_max)), so no element saturates. FLOOR (OCP MX v1.0) is
# 2**(floor(log2(amax)) - emax): one more power of 2 of resolution for some blocks, but the top
# elements may clamp. scripts/sqnr_table.py compares the two.


@dataclass(frozen=True, kw_only=True)
class CastConfig:
    """How one gemm operand is cast to float8 (``target_dtype=None``: the operand's default)."""

    scaling_type: ScalingType = ScalingType.DYNAMIC
    scaling_granularity: ScalingGranularity = ScalingGranularity.TENSORWISE
    target_dtype: Optional[torch.dtype] = None
    # BLOCKWISE only ([Note: block scales])
    block_size: Optional[Tuple[int, int]] = None
    scale_dtype: torch.dtype = torch.float32
    scale_rounding: ScaleRounding = ScaleRounding.RCEIL
    # NVFP4 only: round e2m1 values stochastically ([Note: stochastic rounding] in
    # f8dist/core/scaling.py), as NVIDIA's recipe rounds gradients
    stochastic_rounding: bool = False
    # NVFP4 grad_weight operands only: transform the tokens first ([Note: random Hadamard
    # transform] in f8dist/core/scaling.py), as NVIDIA's recipe does
    random_hadamard: bool = False

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
                f"(or torch.float4_e2m1fn_x2 for NVFP4 blocks, or None for the operand's "
                f"default), got {self.target_dtype}"
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
        dtype = {None: "dflt", E4M3: "e4m3", E5M2: "e5m2", E2M1: "e2m1"}[self.target_dtype]
        gran = self.scaling_granularity.short_str()
        if self.blockwise:
            scale = {E8M0: "e8m0", E4M3: "e4m3"}.get(self.scale_dtype, "f32")
            gran = f"{gran}{self.block_size[0]}x{self.block_size[1]}{scale}"
        extra = "_sr" * self.stochastic_rounding + "_rht" * self.random_hadamard
        return f"{self.scaling_type.short_str()}_{gran}_{dtype}{extra}"


def _check_block(cc: "CastConfig") -> None:
    """The block fields of a CastConfig ([Note: block scales]), with the fix in each message."""
    object.__setattr__(cc, "scale_rounding",
                       ScaleRounding.coerce(cc.scale_rounding, "CastConfig.scale_rounding"))
    _check_nvfp4(cc)
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
            f"CastConfig.scale_dtype must be torch.float32, torch.float8_e8m0fnu or (NVFP4) "
            f"torch.float8_e4m3fn, got {cc.scale_dtype}"
        )
    if cc.scale_rounding is not ScaleRounding.RCEIL and cc.scale_dtype != E8M0:
        raise ValueError(
            f"CastConfig.scale_rounding={cc.scale_rounding} rounds e8m0 scales; float32 scales "
            "are exact (set Float8LinearConfig.round_scales_to_power_of_2 for powers of 2): "
            "use scale_dtype=torch.float8_e8m0fnu or leave scale_rounding at RCEIL"
        )


def _check_nvfp4(cc: "CastConfig") -> None:
    """NVFP4's combination of fields ([Note: NVFP4]): e2m1 data with e4m3 block scales in
    1x16 / 16x16 blocks, and e4m3 block scales with e2m1 data only."""
    nvfp4 = dict(scaling_granularity=ScalingGranularity.BLOCKWISE, target_dtype=E2M1,
                 scale_dtype=E4M3)
    fix = (f"NVFP4 is CastConfig(scaling_granularity=ScalingGranularity.BLOCKWISE, "
           f"target_dtype=torch.float4_e2m1fn_x2, block_size=(1, 16) or (16, 16), "
           f"scale_dtype=torch.float8_e4m3fn) (the 'nvfp4' recipe)")
    for name, what in (("stochastic_rounding", "rounds NVFP4's e2m1 values"),
                       ("random_hadamard", "transforms NVFP4 operands")):
        value = getattr(cc, name)
        if not isinstance(value, bool):
            raise TypeError(f"CastConfig.{name} must be a bool, got {value!r}")
        if value and cc.target_dtype != E2M1:
            raise ValueError(f"CastConfig.{name}=True {what}, got target_dtype="
                             f"{cc.target_dtype}: set target_dtype=torch.float4_e2m1fn_x2 "
                             f"({fix}) or leave {name}=False")
    if cc.target_dtype == E2M1:
        bad = [f"{k}={getattr(cc, k)}" for k, v in nvfp4.items() if getattr(cc, k) != v]
        if cc.block_size not in _NVFP4_BLOCKS:
            bad.append(f"block_size={cc.block_size}")
        if bad:
            raise ValueError(f"CastConfig.target_dtype=torch.float4_e2m1fn_x2 takes NVFP4's "
                             f"block scales only, got {', '.join(bad)}: {fix}")
    elif cc.scale_dtype == E4M3:
        raise ValueError(f"CastConfig.scale_dtype=torch.float8_e4m3fn is NVFP4's block scale, "
                         f"for e2m1 data only, got target_dtype={cc.target_dtype}: {fix}")


class SPGradWeight(_Name):
    """How the grad_weight gemm gets a sequence-parallel operand that a tensor-parallel style
    all-gathers in float8 ([Note: the grad_weight operand of a gathered tensor])."""

    FORWARD_GATHER = "forward_gather"  # both casts cross in forward: exact
    RECAST = "recast"  # the row-block cast only, re-cast for grad_weight: not exact
    BACKWARD_GATHER = "backward_gather"  # token-block shard kept, gathered in backward: exact
    DERIVE = "derive"  # the row-block cast only, re-cast for grad_weight on one device too: exact

    @property
    def sends_one_cast(self) -> bool:
        """Whether a style sends the row-block cast only and the grad_weight gemm re-casts it."""
        return self in (SPGradWeight.RECAST, SPGradWeight.DERIVE)

class SavedInput(_Name):
    """What a linear keeps of its input for the grad_weight gemm ([Note: what the matmul keeps for
    backward] in f8dist/nn/linear.py)."""

    HIGH_PRECISION = "high_precision"  # the input; backward casts it, or its gemm reads it as is
    FORWARD_CAST = "forward_cast"  # the output gemm's float8 input (axiswise: re-scaled later)
    GRAD_WEIGHT_CAST = "grad_weight_cast"  # cast in forward as the grad_weight gemm casts it


_CELLS = tuple(_CONTRACTION_AXIS)
