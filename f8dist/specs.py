"""The resolved cast table: one frozen :class:`CastSpec` per cell of a linear's gemm x operand
table (f8dist/cells.py), everything a cast needs (float8 dtype, granularity, contraction axis,
power-of-2 rounding, gemm options, scaling type), and :class:`CastSpecs`, a linear's six with the
flags derived from them. ``Float8LinearConfig.cast_spec(gemm, operand)`` and ``.cast_specs(fqn)``
(f8dist/config.py) make them; ``f8dist.cast.cast_to_float8(t, spec)`` is the cast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from f8dist.cells import (
    _CELLS, _FLOAT8_DTYPES, E4M3, CastConfig, Gemm, Operand, SavedInput, ScaleRounding,
    ScalingGranularity, ScalingType, SPGradWeight,
)

__all__ = ["ScaledMMConfig", "CastSpec", "CastSite", "CastSpecs"]

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
#   * blockwise ([Note: block scales] in f8dist/cells.py): the weight blocked per expert
#     ([E, N/bn, K/bk] scales, [Note: blocks of expert weights] in f8dist/scaling.py); tokens
#     blocked along the row (output, grad_input: 1 x inner blocks, local to a token) or, in grad_weight, along the
#     tokens within each expert's group: the gemm pads every group to a multiple of the block
#     first (zero rows, exact), so that no block holds tokens of two experts ([Note: block
#     grouped gemms] in f8dist/grouped.py).
# All are e4m3: torch._scaled_grouped_mm takes no e5m2 operand.

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
    # BLOCKWISE: (outer, inner) of [Note: block scales] in f8dist/cells.py, the scales' dtype and
    # e8m0 rounding
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
    # or square blocks: [Note: block scales] in f8dist/cells.py), so a float8 weight serves both
    # as it is
    weight_same_bytes: bool = False
    # the forward keeps its float8 weight for the grad_input gemm (weight_same_bytes, with
    # Float8LinearConfig.float8_weight_for_backward): see [Note: what the matmul keeps for
    # backward] in f8dist/linear.py
    save_float8_weight: bool = False
    # how the activations that produce this linear's input keep what their backward reads
    # (SwiGLU's inputs before an FFN's w2, f8dist/swiglu.py); None: in high precision
    activation: Optional[CastSpec] = None
    # how the grad_weight gemm gets an operand a tensor-parallel style gathers in float8 ([Note:
    # the grad_weight operand of a gathered tensor] in f8dist/cells.py)
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
        operand of a gathered tensor] in f8dist/cells.py); otherwise it reads or re-scales the
        communicated bytes."""
        sent = self[_COMMUNICATED[Operand(operand)], operand]
        gw = self[Gemm.GRAD_WEIGHT, operand]
        return sent.enabled and (not gw.enabled or (
            gw.blockwise and gw.block_shape(2) != sent.block_shape(2)))

    def __iter__(self):
        return iter(self.specs)

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
