"""Scale math: pure functions of tensors, nothing else.

Conventions (see docs/design.md):

* ``scale`` multiplies into float8: ``x_fp8 = saturate(x * scale)``; dequantizing divides it back
  out, and ``torch._scaled_mm`` is handed the reciprocals.
* ``scale = min(fp8_max / amax, MAX_SCALE)``, computed in float32, optionally rounded *down* to a
  power of 2 so that rescaling is exact ([Note: tiny magnitudes]).
* A cast saturates: values beyond the format's max are clamped to it (448 for e4m3, 57344 for e5m2).

[Note: tiny magnitudes]
The scale maps amax onto the format's max, up to MAX_SCALE = 2**126: the largest power of 2 whose
reciprocal (what the gemm multiplies by) is a normal float32, so the cap survives power-of-2
rounding and a kernel that flushes subnormals. Every amax from 448 * 2**-126 (5.3e-36; 6.7e-34
for e5m2) up maps onto the max exactly; a smaller one, 0 included, gets the cap, which still puts
any normal float32 amax (>= 2**-126) at a normal float8 value (>= 1, full precision). Only a
subnormal float32 amax lands in float8's subnormals (e4m3 flushes values below 2**-136 to zero).
A floor of 1e-12 on the amax (torchao's) would flush every e4m3 tensor with amax < 2e-18 to zero.

[Note: non-finite values]
An inf or NaN in the tensor makes its amax inf or NaN, its scale 0 or NaN, and the cast values NaN.
Nothing is clamped into a finite number: the gemm output turns NaN (all of it for a tensorwise
scale, the affected rows or columns for an axiswise one), so a diverging run fails loudly, as it
would in high precision, rather than training on silently clipped numbers. A delayed cast, whose
scale comes from a history, takes the non-finite amax's scale too ([Note: out of range] in
f8dist/policy/delayed/scale.py), or, where it keeps the history's scale, casts ``keep_non_finite``: each
inf or NaN element to NaN, in the same pass (``x - x`` is 0 for a finite ``x``, NaN otherwise), so
the output's rows and columns that touch it turn non-finite, as in high precision.

[Note: a cast that waits for its amax]
A dynamically scaled cast reads its tensor twice: once for the amax, and once for the cast, which
needs the amax of the whole tensor first (so does a delayed cast that may re-scale). Inductor
inlines a cheap pointwise tensor into every pass that reads it rather than storing it, so both
passes recompute it from its inputs. In SwiGLU's backward that is expensive: the gradients of the
gate and up projections are expressions of three [tokens, hidden] tensors, and inductor's CPU
backend stores the reused ``sigmoid`` in float32, so each pass reads 10 bytes per element, where a
stored bf16 gradient costs one write of 2 and reads of 2. :func:`in_memory` makes inductor store
the tensor: an ``as_strided`` view with the tensor's own size and strides is the identity, but
inductor's ``as_strided`` lowering realizes the tensor it views, for all of its users. The amax
pass can then fuse into the producer's kernel.

The same holds for float8 bytes that serve two gemms (a tensorwise input in forward and in the
grad_weight gemm, a tensorwise grad_output in both backward gemms: ``cast_to_float8(...,
store=True)``). Unstored, the transposed copy the second gemm needs re-casts from the
high-precision tensor (2 bytes read per element) instead of reading the float8 bytes (1).

Measured with scripts/bench_bytes.py on the CPU (docs/bench/history.md, Bytes): every recipe of a LLaMA
block moves fewer bytes; the attention half alone moves a little more (its norm output, cheap to
recompute, is now stored). Triton recomputes ``sigmoid`` rather than storing it, and the H100
figures were taken before these views, so off the CPU the choice stays inductor's until measured
there (``PARTS=bytes bash scripts/gpu_check.sh``). A delayed cast that does not re-scale needs no
amax before it: its amax is recorded in the cast's own pass, and its tensor stays inlined
([Note: record after the cast] in f8dist/policy/delayed/scale.py).

This module has no distributed imports. The reductions are plain torch ops, so when
the tensor is a DTensor they yield a Partial(max) placement and the caller decides which mesh axes
to reduce over (``[Note: amax]`` in f8dist/core/placement.py).
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = [
    "MAX_SCALE",
    "FP8_MAX",
    "fp8_max",
    "tensor_amax",
    "in_memory",
    "amax_to_scale",
    "round_scale_down_to_power_of_2",
    "saturated_cast",
    "dequantize",
    "group_ids",
    "group_positions",
    "group_amax",
    "block_amax",
    "block_scale",
    "block_cast",
    "expand_blocks",
    "stored_scale",
    "E8M0_MIN_EXP",
    "E8M0_MAX_EXP",
    "E2M1",
    "round_to_e2m1",
    "e2m1_pack",
    "e2m1_unpack",
    "counter_uniform",
    "stochastic_round_to_e2m1",
    "hadamard_signs",
    "random_hadamard",
    "nvfp4_cast",
    "nvfp4_dequantize",
]

# The largest scale: an all-zero tensor gets it ([Note: tiny magnitudes])
MAX_SCALE = 2.0 ** 126

E2M1 = torch.float4_e2m1fn_x2  # NVFP4's elements ([Note: NVFP4] in f8dist/config/cells.py)

FP8_MAX = {
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
    E2M1: 6.0,
}


def fp8_max(dtype: torch.dtype) -> float:
    try:
        return FP8_MAX[dtype]
    except KeyError:
        raise ValueError(f"{dtype} is not a supported float8 dtype; use one of {list(FP8_MAX)}")


Dim = Optional[Union[int, tuple]]


def tensor_amax(x: torch.Tensor, dim: Dim = None) -> torch.Tensor:
    """max(|x|) in float32: a 0-dim tensor if ``dim`` is None, else reduced over ``dim`` with
    ``keepdim=True`` (one amax per row or column, shaped to broadcast against ``x``).

    An empty tensor (e.g. a rank's empty shard of an unevenly sharded weight, an empty batch) has
    amax 0, the identity of max over magnitudes, instead of raising.
    """
    if dim is None:
        if x.numel() == 0:
            return torch.zeros((), dtype=torch.float32, device=x.device)
        amax = torch.max(torch.abs(x))  # []
    elif x.numel() == 0:  # torch.amax may raise; the sum of no magnitudes is the same 0s
        amax = torch.abs(x).sum(dim=dim, keepdim=True)  # x.shape with 1 at dim
    else:
        amax = torch.amax(torch.abs(x), dim=dim, keepdim=True)  # x.shape with 1 at dim
    return amax.to(torch.float32)


def in_memory(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself, as a view that makes a compiled graph store ``x`` once instead of recomputing
    it in every pass that reads it: for a tensor whose cast waits for its amax ([Note: a cast that
    waits for its amax]). Eagerly a free view; a wrapper subclass (a DTensor, a Float8Tensor), a
    parameter and a tensor off the CPU come back as they are. The stand-ins of plain tensors that
    tracing uses below dynamo (fake and functional tensors) get the view.
    """
    if (x.device.type != "cpu" or isinstance(x, torch.nn.Parameter)
            or is_traceable_wrapper_subclass(x)):
        return x
    return x.as_strided(x.size(), x.stride())


def round_scale_down_to_power_of_2(scale: torch.Tensor) -> torch.Tensor:
    """The largest power of 2 not above ``scale`` (float32), by clearing the mantissa bits.

    Bit arithmetic rather than ``exp2(floor(log2(s)))`` so that eager and compiled code agree to
    the bit. inf stays inf; NaN stays NaN.
    """
    assert scale.dtype == torch.float32, scale.dtype
    # a Python scalar, not a tensor constant: the casts of one tensor stay identical subgraphs,
    # which a compiled graph merges ([Note: one cast per input] in f8dist/core/cast.py)
    bits = scale.view(torch.int32) & -8388608
    rounded = bits.view(torch.float32)  # 0xFF800000 keeps sign and exponent
    return torch.where(torch.isnan(scale), scale, rounded)


def amax_to_scale(
    amax: torch.Tensor, float8_dtype: torch.dtype, *, round_to_power_of_2: bool = False
) -> torch.Tensor:
    """The float32 scale that maps ``amax`` onto the float8 format's max.

    Capped at ``MAX_SCALE`` ([Note: tiny magnitudes]): ``amax == 0`` gives the finite scale
    ``MAX_SCALE``, never inf.
    """
    amax = amax.to(torch.float32)
    scale = torch.clamp(fp8_max(float8_dtype) / amax, max=MAX_SCALE)  # NaN stays NaN
    if round_to_power_of_2:
        scale = round_scale_down_to_power_of_2(scale)
    return scale


def saturated_cast(
    x: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype, *, keep_non_finite: bool = False
) -> torch.Tensor:
    """``clamp(x * scale, -max, max)`` in float8; ``scale`` broadcasts against ``x``.

    ``keep_non_finite``: an inf or NaN in ``x`` casts to NaN whatever the scale, for a scale that
    does not follow the tensor's own amax ([Note: non-finite values]); other values are unchanged.
    """
    limit = fp8_max(float8_dtype)
    x32 = x.to(torch.float32)
    scaled = (x32 * scale).clamp_(min=-limit, max=limit)  # a fresh float32 tensor: clamp in place
    if keep_non_finite:
        scaled.add_(x32 - x32)  # 0 where x is finite (exactly), NaN where it is inf or NaN
    return scaled.to(float8_dtype)


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The high-precision value a float8 tensor stands for: ``data / scale`` in ``dtype``."""
    return (data.to(torch.float32) / scale).to(dtype)


# ---------------------------------------------------------------------------------------------
# Block scales ([Note: block scales] and [Note: e8m0 rounding] in f8dist/config/cells.py)
# ---------------------------------------------------------------------------------------------

# e8m0 holds 2**e for e in [-127, 127] (and NaN); a quantizing scale 2**-e fits the same range
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127
_MANTISSA_BITS = 23
_F32_EXP_BIAS = 127


def _blocks(shape, block):
    """(rows, cols) of blocks of a [R, C] tensor: a block cut short by the edge still counts."""
    return tuple(-(-n // b) for n, b in zip(shape, block))


# [Note: blocks of expert weights]
# A 3-D tensor [E, R, C] (the experts' weights of a grouped gemm, [Note: grouped casts] in
# f8dist/config/specs.py) is blocked per expert: matrix e has its own [ceil(R / rows), ceil(C / cols)]
# grid, so the grid is [E, ceil(R / rows), ceil(C / cols)] and no block spans two experts. The
# functions below take it as the 2-D [E * R', C] stack of the matrices, each zero-padded to
# R' = ceil(R / rows) * rows rows (exact, as the edge padding of a 2-D tensor is).


def _stacked(x: torch.Tensor, block: tuple) -> torch.Tensor:
    """A 3-D ``x`` [E, R, C] as the 2-D [E * R', C] stack of [Note: blocks of expert weights]."""
    e, r, c = x.shape
    rows = -(-r // block[0]) * block[0]
    if rows != r:
        x = torch.nn.functional.pad(x, (0, 0, 0, rows - r))  # [E, R', C]
    return x.reshape(e * rows, c)


def _unstacked(grid: torch.Tensor, e: int) -> torch.Tensor:
    """A [E * nr, nc] grid (or data) of :func:`_stacked` as [E, nr, nc]."""
    return grid.reshape(e, grid.shape[0] // max(e, 1), grid.shape[1])


def block_amax(x: torch.Tensor, block: tuple) -> torch.Tensor:
    """max(|x|) of each ``block = (rows, cols)`` block of the 2-D ``x``, in float32:
    [ceil(R / rows), ceil(C / cols)]. A block cut short by the edge is zero-padded (zeros raise
    no amax), so any R and C work; an empty ``x`` gives an empty (or all-zero) grid. A 3-D ``x``
    is blocked per matrix ([Note: blocks of expert weights]): [E, ceil(R / rows), ceil(C / cols)]."""
    if x.dim() == 3:
        return _unstacked(block_amax(_stacked(x, block), block), x.shape[0])
    (r, c), (br, bc) = x.shape, block
    nr, nc = _blocks((r, c), block)
    x = torch.abs(x)
    if nr * br != r or nc * bc != c:
        x = torch.nn.functional.pad(x, (0, nc * bc - c, 0, nr * br - r))  # [nr*br, nc*bc]
    x = x.reshape(nr, br, nc, bc)
    if x.numel() == 0:  # torch.amax of an empty reduction raises; no magnitudes give 0
        return x.sum(dim=(1, 3)).to(torch.float32)  # [nr, nc]
    return torch.amax(x, dim=(1, 3)).to(torch.float32)  # [nr, nc]


def _exponent(x: torch.Tensor, *, ceil: bool) -> torch.Tensor:
    """floor(log2(x)) (``ceil``: ceil(log2(x))) of positive float32 ``x`` from its bits, as
    int32: eager and compiled agree to the bit (0 gives the exponent field's -127)."""
    bits = x.view(torch.int32)
    exp = torch.bitwise_right_shift(bits, _MANTISSA_BITS) - _F32_EXP_BIAS  # sign bit is 0
    if ceil:
        exp = exp + ((bits & ((1 << _MANTISSA_BITS) - 1)) != 0).to(torch.int32)
    return exp


def _pow2(exp: torch.Tensor) -> torch.Tensor:
    """2**exp in float32 for int32 exp in [-126, 127], built from its bits; -127 gives 2**-127
    (a float32 subnormal) through a halving, exact."""
    normal = torch.clamp(exp, min=-126)
    out = torch.bitwise_left_shift(normal + _F32_EXP_BIAS, _MANTISSA_BITS).view(torch.float32)
    return torch.where(exp < -126, out * 0.5, out)


def stored_scale(scale: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """Block scales of :func:`block_scale` (float32 values that ``scale_dtype`` holds exactly) in
    ``scale_dtype``, the dtype a Float8Tensor keeps them in. e8m0 is the float32 exponent field,
    taken from the bits ([Note: e8m0 from bits]): 2**-127 (a float32 subnormal) gives 0, NaN 255,
    as ``scale.to(torch.float8_e8m0fnu)`` does for these values."""
    if scale_dtype != torch.float8_e8m0fnu:
        return scale.to(scale_dtype)
    biased = torch.bitwise_right_shift(scale.view(torch.int32), _MANTISSA_BITS) & 0xFF
    return in_memory(biased.to(torch.uint8)).view(torch.float8_e8m0fnu)


def _e8m0_scale(amax: torch.Tensor, float8_dtype: torch.dtype, rounding: str) -> torch.Tensor:
    """The quantizing power-of-2 scale of each block amax ([Note: e8m0 rounding]), float32."""
    fmax = fp8_max(float8_dtype)
    if rounding == "rceil":  # dequantizing 2**ceil(log2(amax / fmax))
        exp = _exponent(amax / fmax, ceil=True)
    elif rounding == "floor":  # dequantizing 2**(floor(log2(amax)) - emax)
        exp = _exponent(amax, ceil=False) - (math.frexp(fmax)[1] - 1)  # emax: 8 e4m3, 15 e5m2
    else:
        raise ValueError(f"unknown e8m0 rounding {rounding!r}; use 'rceil' or 'floor'")
    exp = torch.clamp(exp, min=E8M0_MIN_EXP, max=E8M0_MAX_EXP)
    return _pow2(-exp)


def block_scale(
    amax: torch.Tensor, float8_dtype: torch.dtype, *, scale_dtype: torch.dtype = torch.float32,
    rounding: str = "rceil", round_to_power_of_2: bool = False,
) -> torch.Tensor:
    """The quantizing scale of each block from its amax, in float32 values that ``scale_dtype``
    holds exactly (the cast multiplies by them; a Float8Tensor stores them in ``scale_dtype``).

    float32: ``amax_to_scale`` per block (DeepSeek-V3), capped at ``MAX_SCALE``.
    ``float8_e8m0fnu``: a power of 2, rounded as ``rounding`` says ([Note: e8m0 rounding]); an
    all-zero block gets 2**127. A non-finite amax gives a NaN scale either way, so the block's
    values turn NaN ([Note: non-finite values]).
    """
    amax = amax.to(torch.float32)
    if scale_dtype == torch.float32:
        return amax_to_scale(amax, float8_dtype, round_to_power_of_2=round_to_power_of_2)
    scale = _e8m0_scale(amax, float8_dtype, str(rounding))
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def expand_blocks(scale: torch.Tensor, block: tuple, shape) -> torch.Tensor:
    """A grid of scales as float32 scales that broadcast against a ``shape`` tensor, one per
    element (what a cast multiplies and a dequantization divides by): ``block`` holds the block
    length along each dim, or None for a whole dim (the grid has size 1 there, and so has the
    result); a ``block`` shorter than ``shape`` is that of its last dims, 1 along the others
    ([Note: one scale layout] in f8dist/core/tensor.py). E.g. scales [ceil(R / rows), ceil(C / cols)]
    of ``block = (rows, cols)`` blocks of an [R, C] tensor; [..., ceil(C / cols)] of an N-D one
    in row blocks ([Note: row blocks of N-D activations] in f8dist/config/specs.py); [E, nr, nc] of a
    ``shape = [E, R, C]`` in larger blocks ([Note: blocks of expert weights]); a 0-dim scale as
    it is."""
    full = scale.to(torch.float32)
    if full.dim() == 0:
        return full
    block = (1,) * (len(shape) - len(block)) + tuple(block)
    lengths = [1 if b is None else b for b in block]
    # [n0, b0, n1, b1, ...]: each scale repeated over its block, then cut at the tensor's edge
    full = full[(slice(None), None) * full.dim()]
    full = full.expand(*[x for n, b in zip(full.shape[::2], lengths) for x in (n, b)])
    full = full.reshape([n * b for n, b in zip(full.shape[::2], lengths)])
    return full[tuple(slice(None) if b is None else slice(0, n) for b, n in zip(block, shape))]


# [Note: a block cast in one pass]
# A cast in row blocks takes the amax of each row of the [R * C / cols, cols] view and casts the
# same row with it: inductor's CPU backend fuses the two into one kernel that reads the tensor
# once (an outer loop over the view's rows, the reduction then the cast), as it fuses a rowwise
# cast, but only if the cast is realized in the view's shape. Reshaped back to [R, C] before it is
# stored (for the gemm), the cast reads the amax at ``C / cols * r + c // cols`` over [R, C] where
# the reduction wrote it at ``i`` over [R * C / cols]; the scheduler fuses a consumer only where
# the indices match ("memory deps did not match" under TORCH_LOGS=fusion), so the amax and the
# cast were two kernels, each reading the tensor (torch 2.13: GPU backends re-index such a
# pointwise to the reduction's loops, ``Scheduler._try_reindex_pointwise_for_reduction``, which
# is off for the CPU). :func:`in_memory` makes inductor store the cast in the view's shape; the
# [R, C] tensor is a view of those bytes, the same bytes in the same order. The scales leave the
# kernel as they are stored: an e8m0 scale is its exponent byte ([Note: e8m0 from bits]).
# Square blocks (32 x 32, 128 x 128) stay two passes on the CPU: the block amax loops over
# [R / rows, C / cols] blocks, the row-major cast over [R / rows, rows, C / cols, cols], and
# inductor fuses a reduction with a pointwise consumer only when all the reduction's outer loops
# lead the consumer's (``CppScheduling._get_outer_loop_fusion_depth``). Casting in the block-major
# order that would fuse ([R / rows, C / cols, rows, cols]) stores the bytes block-major, and the
# gemm's row-major copy of them then costs what the second read saves (1 byte read and 1 written
# per element, against the 2 bytes of reading the bf16 weight again), so a square weight is read
# twice in forward. Backward casts it
# again from the bf16 weight (compiled: from the weight and the saved block amaxes), unless
# ``float8_weight_for_backward`` keeps the forward's bytes ([Note: what the matmul keeps for
# backward] in f8dist/nn/linear.py).
#
# [Note: e8m0 from bits]
# Inductor's CPU backend has no e8m0 type: ``.to(torch.float8_e8m0fnu)`` runs as an eager
# kernel after the cast (reading the float32 scales, writing the bytes), and a generated kernel
# cannot take an e8m0 buffer. :func:`stored_scale` writes the exponent byte as uint8 in the cast's
# kernel and views it as e8m0 (a free reinterpretation of stored bytes). Reading e8m0 scales back
# (the gemm's ``.to(torch.float32)``) stays the eager conversion, for the same reason. Rebuilding
# 2**(byte - 127) from the byte in the graph instead (``scale.view(torch.uint8)``, then the bit
# arithmetic of :func:`_pow2`) fuses the read-back and its reciprocal into the cast's kernel
# (fewer bytes on scripts/bench_bytes.py's --small MXFP8 linear: docs/bench/history.md, Bytes)
# but breaks a graph whose input is an e8m0 tensor (a weight gathered in float8 by FSDP2, a
# Float8Tensor made outside the compiled region): inductor lowers the uint8 view of an input
# buffer as a reinterpretation and hands the kernel the e8m0 buffer, which the CPU backend has no
# C++ type for (``KeyError: torch.float8_e8m0fnu``). It needs the scales kept as uint8 in the
# Float8Tensor, which dynamo must then see as an inner tensor.


def block_cast(
    x: torch.Tensor, block: tuple, float8_dtype: torch.dtype, *,
    scale_dtype: torch.dtype = torch.float32, rounding: str = "rceil",
    round_to_power_of_2: bool = False,
) -> tuple:
    """``(data, scale)``: the 2-D ``x`` cast to float8 with one scale per ``block`` (float32
    values, see :func:`block_scale`), [ceil(R / rows), ceil(C / cols)]; an N-D ``x`` in row
    blocks gives scales [..., ceil(C / cols)].

    A block that is one row of ``x`` (or one column) is cast as rows of a [R * C / cols, cols] view
    (of ``x.t()``): the amax of a row then the cast of the same row, which a compiled graph fuses
    into one pass over ``x``, as it fuses a rowwise cast ([Note: a block cast in one pass]).
    Other blocks (squares, and rows that do not divide ``x``) take the grid of
    :func:`block_amax`. A 3-D ``x`` [E, R, C] is cast per
    matrix ([Note: blocks of expert weights]): data [E, R, C], scales [E, nr, nc].
    """
    kw = dict(scale_dtype=scale_dtype, rounding=rounding, round_to_power_of_2=round_to_power_of_2)
    if x.dim() != 2 and block[0] == 1:  # [..., C] in row blocks: rows of its [prod(...), C] view
        data, scale = block_cast(x.reshape(-1, x.shape[-1]), block, float8_dtype, **kw)
        return data.reshape(x.shape), scale.reshape(*x.shape[:-1], scale.shape[-1])
    if x.dim() > 3 and block[1] == 1:  # token blocks of [..., S, K]: per sequence
        data, scale = block_cast(x.reshape(-1, *x.shape[-2:]), block, float8_dtype, **kw)
        return data.reshape(x.shape), scale.reshape(*x.shape[:-2], *scale.shape[-2:])
    if x.dim() == 3:  # [E, R, C] per matrix; [B, S, K] in token blocks per sequence, the same
        e, r = x.shape[:2]
        data, scale = block_cast(_stacked(x, block), block, float8_dtype, **kw)
        return _unstacked(data, e)[:, :r], _unstacked(scale, e)
    (r, c), (br, bc) = x.shape, block
    if br == 1 and c % bc == 0:
        rows = x.reshape(r * (c // bc), bc)  # [R * C / cols, cols]
        scale = block_scale(tensor_amax(rows, -1), float8_dtype, **kw)  # [R * C / cols, 1]
        data = in_memory(saturated_cast(rows, scale, float8_dtype))  # stored as rows: the Note
        return data.reshape(r, c), scale.reshape(r, c // bc)
    if bc == 1 and br > 1 and r % br == 0:
        data_t, scale_t = block_cast(x.t(), (1, br), float8_dtype, **kw)
        return data_t.t(), scale_t.t()  # [R, C] column-major, [R / rows, C]
    scale = block_scale(block_amax(x, block), float8_dtype, **kw)
    return saturated_cast(x, expand_blocks(scale, block, x.shape), float8_dtype), scale


# ---------------------------------------------------------------------------------------------
# NVFP4: e2m1 elements, e4m3 block scales, a float32 tensor scale ([Note: NVFP4] in
# f8dist/config/cells.py), NVIDIA's two-level math as torchao's ``nvfp4_quantize`` computes it
# ---------------------------------------------------------------------------------------------

_E4M3_MAX = FP8_MAX[torch.float8_e4m3fn]
_E2M1_MAX = FP8_MAX[E2M1]
_F32 = torch.finfo(torch.float32)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` in [-6, 6] rounded to the nearest e2m1 value, ties to even: e2m1 is spaced
    0.5 below 2, 1 below 4 and 2 up to 6, and an even multiple of the spacing has an even
    mantissa, so ``torch.round`` (half to even) of ``x / spacing`` is the rounding."""
    mag = x.abs()
    spacing = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    return torch.round(x / spacing) * spacing  # a power of 2 divides and multiplies exactly


# [Note: stochastic rounding]
# Gradients in e2m1 round stochastically (NVIDIA's NVFP4 recipe): a value between two
# neighbouring e2m1 values ``lo < v < hi`` goes up with probability ``(v - lo) / (hi - lo)``, so
# the rounding is unbiased in expectation. The uniform draw of an element is a counter-based
# generator of (key, the element's flat position in the logical tensor; a grouped gemm's tokens:
# their place in their group, [Note: positions in token groups]): SplitMix64's output
# number ``position`` of the stream ``key`` (its state after ``position + 1`` steps, mixed), in
# int64 ops that wrap as uint64's do. No generator state moves, so a rank's shard draws exactly
# the numbers one device draws for those elements ([Note: global positions] in
# f8dist/core/placement.py), and the same (key, position) always rounds alike. The key (seed,
# site, draw) comes from ``f8dist.core.cast.stochastic_rounding``.

_GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15, SplitMix64's increment, as an int64
_MIX = (-0x40A7B892E31B1A47, -0x6B2FB644ECCEEE15)  # 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """uint64's ``z >> s`` of an int64 ``z`` (torch shifts int64 arithmetically)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def counter_uniform(positions: torch.Tensor, key) -> torch.Tensor:
    """A float32 in [0, 1) (24 random bits) per element of the int64 ``positions``: SplitMix64
    of the stream ``key`` (an int, or the int64 tensor [] of its bits) at those counters
    ([Note: stochastic rounding])."""
    if not isinstance(key, torch.Tensor):
        key = torch.tensor((key + 2**63) % 2**64 - 2**63, dtype=torch.int64)  # its bits
    # [Note: SplitMix64 compiled]: inductor folds integer arithmetic on an arange into an index
    # expression, which does not wrap at 64 bits (OverflowError at codegen, torch 2.13); it does
    # not fold ``^``, so the product stays an int64 multiply that wraps as in eager
    z = (positions ^ 0) * _GOLDEN + (key + _GOLDEN)  # after position + 1 steps (wraps as uint64)
    z = (z ^ _shr(z, 30)) * _MIX[0]
    z = (z ^ _shr(z, 27)) * _MIX[1]
    z = z ^ _shr(z, 31)
    return _shr(z, 40).to(torch.float32) * 2.0**-24  # the top 24 bits, exact in float32


def stochastic_round_to_e2m1(x: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` in [-6, 6] rounded to one of its two neighbouring e2m1 values, up (away
    from 0) where ``uniform`` (a float32 in [0, 1) per element) is below the distance to the
    lower one in units of the spacing: unbiased ([Note: stochastic rounding])."""
    mag = x.abs()
    spacing = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    lo = torch.floor(mag / spacing) * spacing  # exact: spacing is a power of 2
    up = uniform < (mag - lo) / spacing
    return torch.copysign(torch.where(up, lo + spacing, lo), x)


# [Note: random Hadamard transform]
# NVIDIA's NVFP4 recipe multiplies both operands of the grad_weight gemm by one orthogonal
# block-diagonal matrix along the gemm's contraction dim (the tokens), each 16-block by
# ``H16 @ diag(signs) / 4`` (H16 the Sylvester Hadamard matrix, ``signs`` random +-1): since
# ``(Q G)^T (Q X) = G^T Q^T Q X = G^T X`` the product is unchanged in exact arithmetic, while an
# outlier token is spread over its block (NVIDIA's reason: the other tokens of its block are not
# flushed to 0 under its scale; scripts/nvfp4_rounding.py measures what it does to the gemm).
# The blocks are those of the token-block cast (within each sequence of an N-D operand), a
# sequence's last partial block left as it is (the identity is orthogonal too). The signs come
# from the seed alone, the same on every rank; a shard transforms its own blocks, one device's
# where shards hold whole 16-blocks, which the block cast of a DTensor requires anyway ([Note:
# shards on block boundaries] in f8dist/core/placement.py).

_HADAMARD = 16


def hadamard_signs(key: int) -> torch.Tensor:
    """The random signs (+-1, float32 [16]) of the transform of ``key`` ([Note: random Hadamard
    transform])."""
    return torch.where(counter_uniform(torch.arange(_HADAMARD), key) < 0.5, -1.0, 1.0)


def random_hadamard(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``x`` [..., S, C] with each 16-block of tokens along dim -2 multiplied by
    ``H16 @ diag(signs) / 4`` ([Note: random Hadamard transform]): the blocks of its token-block
    cast ([Note: token blocks of N-D activations] in f8dist/config/specs.py), each sequence's
    last partial block left as it is; float32 or wider."""
    h = torch.ones(1, 1)
    while h.shape[0] < _HADAMARD:  # Sylvester: [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    dtype = torch.promote_types(x.dtype, torch.float32)
    q = (h * signs.to(h.device)[None, :] / 4).to(device=x.device, dtype=dtype)  # [16, 16], exact
    s, c = x.shape[-2:]
    seqs = x.reshape(math.prod(x.shape[:-2]), s, c).to(dtype)  # [B, S, C]; S may be 0
    whole = s - s % _HADAMARD
    blocks = seqs[:, :whole].reshape(seqs.shape[0], -1, _HADAMARD, c)  # [B, S / 16, 16, C]
    out = torch.cat([torch.matmul(q, blocks).reshape(seqs.shape[0], whole, c), seqs[:, whole:]], 1)
    return out.view(x.shape)  # [..., S, C]


def _grid_amax(x: torch.Tensor, block: tuple) -> torch.Tensor:
    """max(|x|) of each block of an N-D ``x``, ``block`` one length per dim (None: the whole
    dim), float32 [ceil(n / b) per dim]; edge blocks zero-padded."""
    lengths = [n if b is None else b for n, b in zip(x.shape, block)]
    pad = [p for n, b in reversed(list(zip(x.shape, lengths))) for p in (0, -n % max(b, 1))]
    x = torch.nn.functional.pad(torch.abs(x), pad)
    x = x.reshape([v for n, b in zip(x.shape, lengths) for v in (n // max(b, 1), b)])
    dims = tuple(range(1, x.dim(), 2))
    if x.numel() == 0:  # torch.amax of an empty reduction raises; no magnitudes give 0
        return x.sum(dim=dims).to(torch.float32)
    return torch.amax(x, dim=dims).to(torch.float32)


# [Note: NVFP4 row blocks]
# 1x16 blocks of an [R, C] tensor are cast as the rows of its [R * C / 16, 16] view, stored in
# that shape (:func:`in_memory`), as :func:`block_cast` casts row blocks ([Note: a block cast in
# one pass]): the same bytes and scales. Cast over [R, C], each element read its block's scale at
# ``c // 16``, and compiling a layer's backward failed (torch 2.13): inductor's CPU backend fused
# that cast of the output gradient with its grad_weight cast (16x1 blocks, read transposed) and
# split both kernels' loops at the division by 16, which their different loop sizes do not
# allow (an AssertionError in ``CppScheduling.try_loop_split``).


def nvfp4_cast(x: torch.Tensor, block: tuple, amax: torch.Tensor,
               uniform: Optional[torch.Tensor] = None) -> tuple:
    """``(data, block_scales, tensor_scale)``: ``x`` in NVFP4 ([Note: NVFP4] in
    f8dist/config/cells.py) from ``amax``, the logical tensor's (a 0-dim float32). ``block``: a
    length per dim of ``x`` (None: whole). The decode scales: ``tensor_scale = amax / (448 * 6)``
    (float32, []); each block's ``amax_block / 6 / tensor_scale`` in e4m3 (clamped to e4m3's
    range). The data: ``x * (1 / tensor_scale) / block_scale``, clamped to 6, rounded to e2m1 and
    packed two a byte along the last dim ([Note: packed e2m1]). torchao's ``nvfp4_quantize`` to
    the bit, but that a tensor scale below float32's smallest normal (amax < 2688 * 2**-126,
    all-zero tensors included) is raised to it, so nothing divides by 0. ``uniform`` (float32 in
    [0, 1), ``x``'s shape): round stochastically with these draws ([Note: stochastic rounding])
    instead of to nearest.
    """
    if x.dim() == 2 and block[0] == 1 and block[1] and x.shape[1] % block[1] == 0:
        (r, c), cols = x.shape, block[1]  # row blocks as rows: [Note: NVFP4 row blocks]
        rows = None if uniform is None else uniform.reshape(r * c // cols, cols)
        data, scale, tensor_scale = nvfp4_cast(x.reshape(r * c // cols, cols), (1, None), amax,
                                               rows)
        data = in_memory(data).reshape(r, c // cols * data.shape[1])  # [R, C / 2] packed pairs
        return data, scale.reshape(r, c // cols), tensor_scale
    tensor_scale = torch.clamp(amax.to(torch.float32) / (_E4M3_MAX * _E2M1_MAX), min=_F32.tiny)
    block_amax = _grid_amax(x, block)  # [ceil(n / b) per dim]
    block_scale = torch.clamp(block_amax / _E2M1_MAX / tensor_scale,
                              min=torch.finfo(torch.float8_e4m3fn).tiny, max=_E4M3_MAX)
    block_scale = block_scale.to(torch.float8_e4m3fn)  # e4m3 decode scales
    encode = torch.clamp((1.0 / tensor_scale) / block_scale.to(torch.float32), max=_F32.max)
    scaled = x.to(torch.float32) * expand_blocks(encode, block, x.shape)
    scaled = scaled.clamp_(min=-_E2M1_MAX, max=_E2M1_MAX)
    data = (round_to_e2m1(scaled) if uniform is None
            else stochastic_round_to_e2m1(scaled, uniform))
    return e2m1_pack(data), block_scale, tensor_scale


def nvfp4_dequantize(data: torch.Tensor, block_scale: torch.Tensor, block: tuple,
                     tensor_scale: torch.Tensor, dtype: torch.dtype,
                     packed_dim: int = -1) -> torch.Tensor:
    """The value of NVFP4 ``data`` (:func:`nvfp4_cast`; e2m1 pairs packed along ``packed_dim``,
    or e2m1 values one a byte): ``data * (tensor_scale * block_scale)`` in float32 (torchao's
    order), then ``dtype``."""
    values = e2m1_unpack(data, packed_dim) if data.dtype == E2M1 else data.to(torch.float32)
    decode = tensor_scale * expand_blocks(block_scale, block, values.shape)
    return (values * decode).to(dtype)


# [Note: packed e2m1]
# NVFP4's data is ``torch.float4_e2m1fn_x2``: two e2m1 codes a byte, neighbours along one dim of
# the tensor (its packed dim), the first in the low nibble: torchao's ``pack_uint4`` order, the
# layout of its NVFP4Tensor and of torch's NVFP4 ``scaled_mm``. A code is a sign bit (8) over 3
# bits indexing 0, 0.5, 1, 1.5, 2, 3, 4, 6 (-0 keeps its sign). :func:`nvfp4_cast` packs along
# the last dim, whose length is even (a feature dim: a multiple of 16, or a clear error at the
# config); a transpose moves the packed dim with the bytes, as torchao's ``qdata.t()`` does
# (Float8Tensor's ``_packed_dim``, [Note: two-level scales] in f8dist/core/tensor.py). These two
# functions are the only ones that read or write the nibbles.

_E2M1_CODES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# [Note: float4 in a compiled graph]
# Inductor's CPU backend has no C++ type for float4_e2m1fn_x2 (torch 2.13): a kernel that packs
# the codes and bitcasts them to float4 in one loop fails at codegen (it did once the stochastic
# rounding key, an opaque op's output, changed how the cast fused). :func:`e2m1_pack` stores the
# bytes as uint8 (:func:`in_memory`) and views that buffer as float4, which no kernel computes.


def e2m1_pack(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """e2m1 values ``x`` (float32, as :func:`round_to_e2m1` gives them) packed two a byte along
    ``dim`` ([Note: packed e2m1]): float4_e2m1fn_x2, ``x``'s shape with ``dim`` halved."""
    n = x.shape[dim]
    if n % 2:
        raise ValueError(f"e2m1 data packs two values a byte along dim {dim}, whose length {n} "
                         "is odd: make it a multiple of 16 (NVFP4's block) ([Note: packed e2m1] "
                         "in f8dist/core/scaling.py)")
    x = x.movedim(dim, -1)  # [..., n]
    twice = x.abs() * 2  # 0, 1, 2, 3, 4, 6, 8, 12
    index = torch.where(twice < 4, twice, torch.where(twice < 8, twice / 2 + 2, twice / 4 + 4))
    code = index.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)  # [..., n]
    pairs = code.reshape(*code.shape[:-1], n // 2, 2)  # [..., n / 2, 2]
    packed = pairs[..., 0] | (pairs[..., 1] << 4)  # [..., n / 2]
    return in_memory(packed).view(E2M1).movedim(-1, dim)  # [Note: float4 in a compiled graph]


def e2m1_unpack(data: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The float32 e2m1 values of ``data`` (float4_e2m1fn_x2) packed along ``dim`` ([Note:
    packed e2m1]): ``data``'s shape with ``dim`` doubled."""
    table = torch.tensor(_E2M1_CODES + tuple(-v for v in _E2M1_CODES), device=data.device)
    byte = data.view(torch.uint8).movedim(dim, -1)  # [..., n / 2]
    code = torch.stack([byte & 15, byte >> 4], dim=-1).flatten(-2)  # [..., n]
    return table[code.long()].movedim(-1, dim)


# [Note: token groups]
# A grouped gemm runs one gemm per expert over the expert's rows of a [M, C] token tensor,
# the rows sorted by expert. ``offsets`` ([E] int32, torch._grouped_mm's convention) holds the
# cumulative end row of each group: group e is rows [offsets[e-1], offsets[e]). A group may be
# empty (an expert that got no tokens); rows past offsets[-1] (padding) belong to no group.


def group_ids(offsets: torch.Tensor, m: int) -> torch.Tensor:
    """The group of each of ``m`` rows ([m] int64, [Note: token groups]); rows past the last
    offset get ``len(offsets)``."""
    rows = torch.arange(m, device=offsets.device, dtype=offsets.dtype)  # [M]
    return torch.searchsorted(offsets, rows, right=True)  # [M]


# [Note: positions in token groups]
# A stochastically rounded token operand of a grouped gemm ([Note: stochastic rounding]) draws
# by each element's place in its group, not in the [M, C] tensor: the flat index of (group, row
# in the group, column) in a logical [groups, 2**32, C] tensor (int64, wrapping: distinct while
# groups * C <= 2**32). Under expert parallelism a rank holds its experts' groups, each in one
# device's row order ([Note: expert parallelism] in f8dist/parallel/ep/dispatch.py), at rows
# that depend on the other experts' counts; the group's global index and the row within it do
# not, so each rank draws one device's numbers with no collective, padded groups too (their
# real rows keep their place, [Note: block grouped gemms] in f8dist/nn/grouped.py).


def group_positions(offsets: torch.Tensor, m: int, c: int, first_group: int = 0) -> torch.Tensor:
    """The position of each element of a [m, c] token tensor in groups ``offsets`` whose first
    group is group ``first_group`` of the logical layer ([Note: positions in token groups]):
    [m, c] int64. Rows past the last offset count as one more group."""
    ids = group_ids(offsets, m)  # [M]
    starts = torch.cat([offsets.new_zeros(1), offsets]).long()  # [E + 1]
    rows = torch.arange(m, device=offsets.device) - starts[ids]  # [M] row in its group
    place = (ids + first_group) * 2**32 + rows  # [M]
    return place[:, None] * c + torch.arange(c, device=offsets.device)  # [M, C]


def group_amax(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """max(|x|) of each column over each token group: ``[E, C]`` float32 for ``x`` [M, C] with
    ``offsets`` [E] ([Note: token groups]). An empty group's amax is 0. The amax a grouped gemm
    that contracts over the tokens (grad_weight, per expert) scales its operands by."""
    e = offsets.shape[0]
    ids = group_ids(offsets, x.shape[0])  # [M]
    out = torch.zeros((e + 1, x.shape[1]), dtype=torch.float32, device=x.device)  # [E + 1, C]
    index = ids[:, None].expand(x.shape)  # [M, C]
    out = out.scatter_reduce(0, index, torch.abs(x).to(torch.float32), "amax", include_self=True)
    return out[:e]  # [E, C]: the extra row collected rows past the last group
