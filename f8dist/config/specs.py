"""The resolved cast table: one frozen :class:`CastSpec` per cell of a linear's gemm x operand
table (f8dist/config/cells.py), everything a cast needs, and :class:`CastSpecs`, a linear's six with the
flags derived from them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from f8dist.config.cells import (
    _CELLS, _FLOAT8_DTYPES, E4M3, CastConfig, Gemm, Operand, SavedInput, ScaleRounding,
    ScalingGranularity, ScalingType, SPGradWeight,
)

__all__ = ["ScaledMMConfig", "CastSpec", "CastSite", "CastSpecs"]

# [Note: any token count]
# The grad_weight gemm contracts over M, the token count, which the batch decides, so any M must
# train. Zero-padding M to a multiple of 16 is exact and changes no scale (zeros raise no amax),
# so its ScaledMMConfig has pad_k: the gemm pads M in the layout copy it makes anyway. The
# layer's own K and N still need pad_inner_dim.

# [Note: grouped casts]
# An expert's gemms (f8dist/nn/grouped.py) use a linear's table with ``CastSpec.grouped``: the weight
# is [experts, out, in] and the token operands are jagged groups of rows, one per expert ([Note:
# token groups] in f8dist/core/scaling.py). Granularities mean, per expert: axiswise, one scale per
# token and per expert row (or column) of the weight, or over the tokens of each group
# (grad_weight); tensorwise, one per expert weight and per token group; blockwise, the weight
# blocked per expert ([Note: blocks of expert weights] in f8dist/core/scaling.py) and tokens blocked
# along the row or, in grad_weight, within each group padded to whole blocks ([Note: block
# grouped gemms] in f8dist/nn/grouped.py). All are e4m3: torch._scaled_grouped_mm takes no e5m2.

# [Note: row blocks of N-D activations]
# A 1 x inner block along the last dim is local to one token, so an N-D activation [B, S, K] takes
# the row blocks of its [B * S, K] view, scales [B, S, ceil(K / inner)]. They follow the data
# through reshapes keeping the last dim and through splits, cats and all-gathers of other dims, so
# a cast before an all-gather equals one after it, bit for bit.
#
# [Note: token blocks of N-D activations]
# The grad_weight gemm blocks along the tokens: (inner, 1) blocks of the [M, K] view. A sequence
# shard [B, S / tp, K] is blocked along dim -2 within each sequence, scales [B, ceil(S / inner),
# K]; these are the [M, K] view's blocks, and the logical tensor's, exactly when every sequence
# and every sequence shard holds whole blocks: ``blocks_split_by_shards`` (f8dist/core/placement.py),
# by which the TP style falls back to a high-precision all-gather.

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
    :class:`Float8LinearConfig` for the linear ``fqn`` (``Float8LinearConfig.cast_spec``).

    ``axis``: the gemm's contraction dim in the operand's layout, which an axiswise amax reduces
    over. ``scaling_type`` DISABLED: the operand and gemm stay in high precision.

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
    # BLOCKWISE only: [Note: block scales] in f8dist/config/cells.py
    block_size: Optional[Tuple[int, int]] = None
    scale_dtype: torch.dtype = torch.float32
    scale_rounding: ScaleRounding = ScaleRounding.RCEIL
    # a cast for a grouped (expert) gemm: [Note: grouped casts]
    grouped: bool = False
    # NVFP4 only: [Note: stochastic rounding] in f8dist/core/scaling.py
    stochastic_rounding: bool = False
    # NVFP4 grad_weight operands only: [Note: random Hadamard transform] in f8dist/core/scaling.py
    random_hadamard: bool = False

    def __post_init__(self):
        object.__setattr__(self, "gemm", Gemm.coerce(self.gemm, "CastSpec.gemm"))
        object.__setattr__(self, "operand", Operand.coerce(self.operand, "CastSpec.operand"))
        if self.dtype not in _FLOAT8_DTYPES:
            raise ValueError(f"CastSpec.dtype must be a float8 dtype {_FLOAT8_DTYPES}, got {self.dtype}")
        if not isinstance(self.axis, int):
            raise TypeError(f"CastSpec.axis must be an int (a dim of the operand), got {self.axis!r}")
        # the rest is validated where it comes from (CastConfig)
        CastConfig(scaling_type=self.scaling_type, scaling_granularity=self.granularity,
                   target_dtype=self.dtype, block_size=self.block_size,
                   scale_dtype=self.scale_dtype, scale_rounding=self.scale_rounding,
                   stochastic_rounding=self.stochastic_rounding,
                   random_hadamard=self.random_hadamard)

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
        """The block in the operand's own layout (``block_size``'s inner along ``axis``); None
        unless blockwise. Defined for 2-D operands, grouped 3-D weights ([Note: grouped casts])
        and N-D operands in row or token blocks ([Note: row blocks of N-D activations], [Note:
        token blocks of N-D activations])."""
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
    """Where a cast happens: module FQN, gemm and operand (telemetry's key); the enums compare
    like their strings."""

    fqn: str
    gemm: Gemm
    operand: Operand

    def __str__(self):
        return f"{self.fqn or '<root>'}:{self.gemm}:{self.operand}"


@dataclass(frozen=True)
class CastSpecs:
    """The six :class:`CastSpec` of one linear, by ``(gemm, operand)``: what Float8Linear
    computes once from its config. Hashable (compile-time constant of the float8 matmul)."""

    specs: Tuple[CastSpec, ...]
    # [Note: what the matmul keeps for backward] in f8dist/nn/linear.py
    saved_input: SavedInput = SavedInput.HIGH_PRECISION
    # backward casts grad_output once for both of its gemms (tensorwise: the same bytes)
    cast_grad_output_once: bool = False
    # backward's weight cast reuses the forward's weight amax
    weight_amax_from_forward: bool = False
    # the weight casts to the same bytes for the output and grad_input gemms (see _same_bytes)
    weight_same_bytes: bool = False
    # the forward keeps its float8 weight for the grad_input gemm
    save_float8_weight: bool = False
    # how the activations producing this input save for backward (f8dist/nn/swiglu.py); None: hp
    activation: Optional[CastSpec] = None
    # [Note: the grad_weight operand of a gathered tensor] in f8dist/config/cells.py
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
        """Whether the grad_weight gemm cannot read ``operand`` from the float8 cast a TP style
        communicates (it wants high precision, or other blocks): [Note: the grad_weight operand of
        a gathered tensor] in f8dist/config/cells.py."""
        sent = self[_COMMUNICATED[Operand(operand)], operand]
        gw = self[Gemm.GRAD_WEIGHT, operand]
        return sent.enabled and (not gw.enabled or (
            gw.blockwise and gw.block_shape(2) != sent.block_shape(2)))

    def derives_grad_weight_operand(self, operand: Operand) -> bool:
        """Whether the grad_weight gemm re-casts ``operand`` from the other gemm's float8 cast, on
        one device too (``SPGradWeight.DERIVE``)."""
        return (self.sp_grad_weight is SPGradWeight.DERIVE and self.gemm_in_float8(Gemm.GRAD_WEIGHT)
                and self.own_grad_weight_operand(operand))

    def __iter__(self):
        return iter(self.specs)

# the gemm whose cast of an operand a tensor-parallel style communicates (f8dist/parallel/tp/style.py)
_COMMUNICATED = {Operand.INPUT: Gemm.OUTPUT, Operand.GRAD_OUTPUT: Gemm.GRAD_INPUT}


def _same_bytes(specs: CastSpecs, operand: Operand, a: Gemm, b: Gemm) -> bool:
    """Whether ``operand`` casts to the same float8 bytes in gemms ``a`` and ``b`` (tensorwise, or
    square blocks; only the gemm options may differ)."""
    sa, sb = specs[a, operand], specs[b, operand]
    return sa.enabled and not sa.axiswise and sa.block_shape(2) == sb.block_shape(2) and (
        dataclasses.replace(sb, gemm=sa.gemm, axis=sa.axis, mm_config=sa.mm_config) == sa)


def _amax_follows(specs: CastSpecs, operand: Operand, a: Gemm, b: Gemm) -> bool:
    """Whether ``operand``'s tensorwise amax in gemm ``b`` is the max of its amaxes in gemm ``a``."""
    sa, sb = specs[a, operand], specs[b, operand]
    return (sa.scaling_type is sb.scaling_type is ScalingType.DYNAMIC and not sb.axiswise
            and not sa.blockwise and not sb.blockwise)
