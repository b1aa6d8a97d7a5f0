"""The float8 gemms: ``torch._scaled_mm`` and ``torch._scaled_grouped_mm`` with the layout,
padding and dtype rules they need, and an exact CPU kernel for each kind.

``float8_mm(a_data, a_scale, a_block, b_data, b_scale, b_block, offs, ...)`` computes
``a_hp @ b_hp`` for float8 data with their scales, where ``x_hp = x_data / x_scale``: dense,
``a`` [M, K] and ``b`` [K, N], or grouped over token groups ``offs``; per-tensor, per-row or
block scales ([Note: one gemm entry]). It is what ``aten.mm`` and ``aten._grouped_mm`` on two
Float8Tensors run (the op table in f8dist/core/tensor.py); it knows nothing of Float8Tensor.

The grouped gemms (an expert's) are rows of the same table. Two shapes of problem, both over jagged token groups (``offsets``, [Note: token groups] in
f8dist/core/scaling.py), as in ``torch._grouped_mm``::

    2d x 3d   out[rows of e] = a[rows of e] @ b[e]     a [M, K], b [E, K, N]  -> [M, N]
              (the output and grad_input gemms of an expert; scales [M] and [E, N])
    2d x 2d   out[e] = a[:, cols of e] @ b[rows of e]  a [N, M], b [M, K]     -> [E, N, K]
              (the grad_weight gemm, contracting each expert's tokens; scales [E, N] and [E, K])

Scales are dequantizing factors here (what the kernel multiplies by), one per output row and
column, so each product is ``(a8 @ b8) * scale_a * scale_b``: exact, since a scale only
multiplies a whole dot product.

[Note: grouped gemm constraints]
CUDA's kernel (sm90+) wants both operands e4m3, ``a`` row-major and ``b`` column-major, 16-byte
aligned strides (K, N multiples of 16), int32 offsets, float32 per-row scales and a bfloat16
output (so an expert gemm rounds its output to bfloat16 before it becomes the model's dtype,
also in a float32 model). Peers pad every token group to a multiple of 16 rows before calling it; so does
:func:`scaled_grouped_mm`, inside, with zero rows (exact: a zero row adds no product, and a
padded output row is dropped). The padded layout has a static size, M (rounded up to 16) + 16 E rows, so no
host sync decides it. Experts with no tokens are groups of size 0: their output rows do not exist
(2d x 3d) or their gradient is zero (2d x 2d).

[Note: the CPU grouped kernel]
torch 2.13 has no CPU kernel for ``torch._scaled_grouped_mm``. ``f8dist::cpu_scaled_grouped_mm``
takes its arguments, checks CUDA's constraints above (so CI on the CPU proves them), and computes
the exact float8 products with ``torch._grouped_mm`` in float32, scaled afterwards, then rounded
to bfloat16 as CUDA's output is. Being one custom op, it is opaque to compiled graphs.

[Note: scaled_mm constraints]
CUDA's kernels want ``a`` row-major and ``b`` column-major, K and N multiples of 16, float32
scales of shape [] or [M, 1] / [1, N], and (for per-row scales) a bfloat16 output. We honour
these rules on every device, so a program that runs on the CPU runs on a GPU too:

* K or N not a multiple of 16: raise (``check_gemm_shape``), or with ``pad_inner_dim`` zero-pad
  them and slice the result, which is exact. ``pad_k`` zero-pads K alone, without asking: the
  grad_weight gemm's K is the number of tokens ([Note: any token count] in f8dist/config/specs.py).
  The padding is the copy that puts an operand in the layout the kernel wants (which the
  grad_weight gemm's operands, transposed views, need anyway), so an aligned gemm pays nothing.
* an empty gemm (M, K or N = 0): zeros, without a kernel.
* axiswise scales with an output other than bfloat16 (float32; float16, from an fp16 model or an
  fp16 autocast): CUDA's per-row kernel (``f8f8bf16_rowwise`` in torch 2.11-2.13) writes
  bfloat16 only. Run the gemm with unit scales (the tensorwise kernel, which takes any output
  dtype) in float32, apply the scales to the float32 result and cast to ``out_dtype``. Exact up
  to that last rounding, since a scale only multiplies the whole dot product; torchao instead
  takes the bfloat16 output and casts it, which rounds an fp16 result to bf16's 8 bits first.

[Note: the CPU kernel]
On the CPU, ``torch._scaled_mm`` is oneDNN's float8 matmul, which on CPUs without float8
hardware (e.g. those with AMX-bf16) is its reference implementation, orders of magnitude slower
than the bf16 matmul of the same shape (docs/bench/history.md, Figures moved from f8dist's notes):
enough to turn a one-minute test run into an hour. No CPU
gemm gains from float8 anyway, so on the CPU the gemm is ``f8dist::cpu_scaled_mm``: a custom op
that checks CUDA's constraints above (so CI on the CPU proves them) and computes the exact
float8 products in a float32 matmul, scaled afterwards. Being one opaque op, it leaves compiled
graphs with the structure a GPU graph has (one extern gemm kernel reading float8 bytes).

[Note: operands in their kernel layout]
An axiswise cast whose scales run along the gemm's contraction dim of a column-major operand (the
weight in grad_input, grad_output and input in grad_weight) reduces over columns of its tensor
and writes its bytes transposed. Inductor's CPU backend fuses that amax with the cast when the
cast iterates column by column too, i.e. when it computes the transposed copy as a buffer of its
own; as the input of the extern gemm kernel, the copy instead follows the view the kernel is
handed, row by row, and the tensor is read twice (5 bytes an element instead of 3). So an operand
with per-row or per-column scales is handed over as a stored copy (``in_memory``, [Note: a cast
that waits for its amax] in f8dist/core/scaling.py). A tensorwise operand is not: its transposed copy
fuses into the kernel that casts it, which then writes both layouts. Measured with
scripts/bench_bytes.py on the CPU (docs/performance.md).

[Note: the block-scaled gemm]
With block scales ([Note: block scales] in f8dist/config/cells.py) ``a`` [M, K] has one scale per
(bm, bk) block, ``b`` [K, N] one per (bk, bn) block, the same bk along K. The gemm is

    out[m, n] = sum over k-blocks j of  (sum_{k in j} a[m, k] * b[k, n]) / (sa[m/bm, j] * sb[j, n/bn])

On the CPU, ``f8dist::cpu_block_scaled_mm``: each block's float8 products summed in float32 (a
batched matmul over the k-blocks, exact products), each block sum multiplied by its two
dequantizing scales, the blocks summed in float32. A K that is not a multiple of bk (the
grad_weight gemm's tokens) is zero-padded, exact.

On CUDA, ``_cuda_block_scaled_mm`` runs ``torch.nn.functional.scaled_mm`` with the arguments of
``cuda_block_args`` where ``cuda_block_problem`` finds a kernel for the device, and otherwise
raises naming what to use instead (another recipe, or ``Float8LinearConfig(emulate=True)``:
dequantize, then a high-precision matmul):

* DeepSeek's blocks on sm90 (torch >= 2.10): per-token 1x128 x 128x128 weight blocks (the output
  and grad_input gemms of ``"blockwise"``) and 1x128 x 1x128 (its grad_weight gemm, blocks along
  the tokens). The operand ``a`` [M, K] with ``(1, 128)`` blocks is ``BlockWise1x128`` with scales
  [M, K/128] outer-dim-major (stride (1, M)); ``(128, 128)`` is ``BlockWise128x128`` with scales
  [round_up(K/128, 4), M/128], stride (1, round_up(K/128, 4)). ``b`` [K, N] is described by its
  transpose ``b.t()`` [N, K] the same way (its ``(128, 1)`` blocks are ``BlockWise1x128``). K is
  zero-padded to a multiple of 128 (exact). Run on an H200 (docs/numerics.md).
* MXFP8's 1x32 e8m0 blocks on sm100+, 32x32 weight tiles expanded to 1x32: ``BlockWise1x32``
  with e8m0 scales in the swizzled 128x4 tile layout ([Note: MXFP8 on CUDA]). Not run on a GPU.
* NVFP4's 1x16 e4m3 blocks on sm100+, dense gemms: ``BlockWise1x16`` with e2m1 operands packed
  along K ([Note: NVFP4 on CUDA], from ``_nvfp4_mm``). Not run on a GPU.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from f8dist.config import E4M3, E8M0, ScaledMMConfig
from f8dist.core.scaling import (
    E2M1, e2m1_pack, expand_blocks, group_ids, in_memory, nvfp4_dequantize, stored_scale,
)

__all__ = ["float8_mm", "kernel_block", "scaled_mm", "scaled_grouped_mm",
           "block_scaled_grouped_mm", "grouped_scales", "pad_groups", "scatter_rows",
           "check_gemm_shape", "check_block_shape", "GEMM_ALIGNMENT"]

GEMM_ALIGNMENT = 16
# the output dtypes of CUDA's per-row scaled gemm; others go through float32 ([Note: scaled_mm
# constraints])
_ROWWISE_OUT_DTYPES = (torch.bfloat16,)


def check_gemm_shape(
    k: int, n: int, *, what: str, pad_inner_dim: bool, pad_k: bool = False
) -> None:
    """Raise a clear error if a float8 gemm cannot take a [*, K] x [K, N] problem (``pad_k``:
    K will be padded, only N counts)."""
    if pad_inner_dim:
        return
    dims = (("N", n),) if pad_k else (("K", k), ("N", n))
    bad = [f"{name}={v}" for name, v in dims if v % GEMM_ALIGNMENT != 0]
    if bad:
        raise ValueError(
            f"{what}: torch._scaled_mm needs the contraction dim K and the output dim N to be "
            f"multiples of {GEMM_ALIGNMENT}, got {', '.join(bad)}. Make the layer (or its shard) "
            f"a multiple of {GEMM_ALIGNMENT}, keep the layer in high precision with "
            f"module_filter_fn, or set Float8LinearConfig(pad_inner_dim=True)."
        )


def block_problems(specs, in_features: int, out_features: int) -> List[str]:
    """The dims of a linear that its block-scaled casts (``specs``, a ``CastSpecs``) cannot divide
    into blocks, e.g. ``["out_features=96 (block 128)"]``; the tokens may be anything ([Note: block
    scales] in f8dist/config/cells.py)."""
    k, n = in_features, out_features
    dims = {  # each operand's layer dims: name -> (size, dim in the operand's [rows, cols])
        "input": {"in_features": (k, 1)},
        "weight": {"out_features": (n, 0), "in_features": (k, 1)},
        "grad_output": {"out_features": (n, 1)},
    }
    bad = []
    for spec in specs:
        if spec.enabled and spec.blockwise:
            block = spec.block_shape(2)
            for name, (size, dim) in dims[spec.operand.value].items():
                msg = f"{name}={size} (block {block[dim]})"
                if size % block[dim] and msg not in bad:
                    bad.append(msg)
    return bad


def shape_problems(specs, in_features: int, out_features: int) -> List[str]:
    """Every dim of a linear that its float8 gemms cannot take as it is: the kernels' alignment
    (multiples of :data:`GEMM_ALIGNMENT`) and, for block-scaled ``specs``, the blocks
    (:func:`block_problems`); e.g. ``["in_features=48 (block 32)"]``. Empty when it fits."""
    dims = {"in_features": in_features, "out_features": out_features}
    bad = [f"{name}={size} (multiple of {GEMM_ALIGNMENT})" for name, size in dims.items()
           if size % GEMM_ALIGNMENT]
    return bad + [p for p in block_problems(specs, in_features, out_features)
                  if p.split(" ")[0] not in {b.split(" ")[0] for b in bad}]


def check_block_shape(specs, in_features: int, out_features: int, *, what: str,
                      pad_inner_dim: bool) -> None:
    """Raise a clear error naming the fix for :func:`block_problems`; ``pad_inner_dim``: ragged
    blocks are zero-padded instead, exact."""
    bad = [] if pad_inner_dim else block_problems(specs, in_features, out_features)
    if bad:
        raise ValueError(
            f"{what}: block-scaled float8 needs the layer's dims to divide into its blocks, got "
            f"{', '.join(bad)}. Make the layer a multiple of the block, keep it in high precision "
            "with module_filter_fn, or set Float8LinearConfig(pad_inner_dim=True) (the last "
            "block zero-padded, exact)."
        )


# the most float32 block products [k-blocks, M, N] the CPU kernel holds at once
_BLOCK_PRODUCTS = 1 << 24


@torch.library.custom_op("f8dist::cpu_block_scaled_mm", mutates_args=())
def cpu_block_scaled_mm(
    a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
    a_block: List[int], b_block: List[int], out_dtype: torch.dtype,
    alpha: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``a`` [M, K] @ ``b`` [K, N] in float8 with dequantizing block scales ``inv_a``
    [M/bm, K/bk] and ``inv_b`` [K/bk, N/bn] (float32): [Note: the block-scaled gemm]; ``alpha``
    (float32, []) multiplies the float32 result before its cast to ``out_dtype`` ([Note: the
    NVFP4 gemm])."""
    out = block_products(a, b, inv_a, inv_b, a_block, b_block)  # [M, N] float32
    return (out if alpha is None else out * alpha).to(out_dtype)


def block_products(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
                   a_block, b_block) -> torch.Tensor:
    """The float32 result of :func:`cpu_block_scaled_mm`, before its output cast: also the
    gemm of each expert in the grouped kernel (below), so that the two agree to
    the bit. The operands are copied in one layout (contiguous float32) whatever theirs."""
    (m, k), n, bk = a.shape, b.shape[1], a_block[1]
    nk = -(-k // bk)
    a32 = F.pad(a.to(torch.float32), (0, nk * bk - k)).contiguous()  # [M, K'] float32
    a32 = a32.reshape(m, nk, bk).transpose(0, 1)  # [nk, M, bk]
    b32 = F.pad(b.to(torch.float32), (0, 0, 0, nk * bk - k)).contiguous().reshape(nk, bk, n)
    sa = expand_blocks(inv_a, (a_block[0], 1), (m, nk)).t()  # [nk, M]
    sb = expand_blocks(inv_b, (1, b_block[1]), (nk, n))  # [nk, N]
    out = a32.new_zeros((m, n))  # [M, N] float32
    step = max(1, _BLOCK_PRODUCTS // max(1, m * n))
    for j in range(0, nk, step):  # each block's exact products summed in float32
        part = torch.bmm(a32[j:j + step], b32[j:j + step])  # [kb, M, N]
        out += (part * sa[j:j + step, :, None] * sb[j:j + step, None, :]).sum(0)
    return out


@cpu_block_scaled_mm.register_fake
def _(a, b, inv_a, inv_b, a_block, b_block, out_dtype, alpha=None):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _check_block_pair(a_block, b_block) -> None:
    """The contract of the block-scaled gemms, dense and grouped: both operands in blocks, the
    same block along the contraction dim ([Note: the block-scaled gemm])."""
    if a_block is None or b_block is None:
        raise TypeError(
            "a block-scaled float8 operand meets a tensorwise or axiswise one: both operands of "
            "a block-scaled gemm need block scales (the config's gemm cells must agree)")
    if a_block[1] != b_block[0]:
        raise ValueError(
            f"block-scaled gemm: a's blocks {tuple(a_block)} and b's {tuple(b_block)} differ "
            "along the contraction dim K")


# [Note: an emulated gemm's rounding]
# An emulated gemm multiplies in float32 and casts the result to its output dtype. As two ops, a
# compiled graph fused the cast into what reads the output (a Float8Linear's bias add) and, as
# inductor does by default (``emulate_precision_casts=False``), added the bias to the float32
# value: compiled outputs differed from eager's in the last bf16 bit. ``emulated_mm`` is one op,
# whose output leaves it rounded, as a kernel's does.


@torch.library.custom_op("f8dist::emulated_mm", mutates_args=())
def emulated_mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` (float32) cast to ``out_dtype`` ([Note: an emulated gemm's rounding])."""
    return torch.mm(a, b).to(out_dtype)


@emulated_mm.register_fake
def _(a, b, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _dequantized(data: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """float32 ``data / scale``, a block grid expanded: what an emulated gemm multiplies (the
    dense gemms and the block-scaled grouped one; ``Float8LinearConfig(emulate=True)``)."""
    per_element = scale if block is None else expand_blocks(scale, block, data.shape)
    return data.to(torch.float32) / per_element


def _block_scaled_mm(a_data, a_scale, a_block, b_data, b_scale, b_block, offs, *, out_dtype,
                     mm_config) -> torch.Tensor:
    """The gemm of two block-scaled operands ([Note: the block-scaled gemm])."""
    if mm_config.emulate:
        return emulated_mm(_dequantized(a_data, a_scale, a_block),
                           _dequantized(b_data, b_scale, b_block), out_dtype)
    inv_a = a_scale.to(torch.float32).reciprocal()  # powers of 2 (e8m0) invert exactly
    inv_b = b_scale.to(torch.float32).reciprocal()
    if a_data.device.type not in ("cpu", "meta"):  # meta: shapes only, the CPU op's fake kernel
        # torch's block kernels refuse fast accumulation ("scaled_gemm doesn't support fast
        # accum with 128x128 blockwise scaling", H200, torch 2.11); DeepSeek's kernels promote
        # their sums to float32 at every 128-block anyway
        e8m0 = a_scale.dtype == E8M0 and b_scale.dtype == E8M0
        return _cuda_block_scaled_mm(a_data, b_data, inv_a, inv_b, tuple(a_block), tuple(b_block),
                                     e8m0=e8m0, out_dtype=out_dtype)
    return cpu_block_scaled_mm(in_memory(a_data.contiguous()), b_data, inv_a, inv_b,
                               list(a_block), list(b_block), out_dtype)


# torch's scaling type of an operand's blocks, seen with its contraction dim last ([Note: the
# block-scaled gemm]); the pairs CUDA's DeepSeek kernels (sm90) take
_CUDA_BLOCKS = {(1, 128): "BlockWise1x128", (128, 128): "BlockWise128x128"}
_CUDA_BLOCK_PAIRS = {((1, 128), (128, 128)), ((128, 128), (1, 128)), ((1, 128), (1, 128))}
# the same pairs by torch's names of their scaling types (what cuda_block_arg_problems reads)
_CUDA_BLOCK_KIND_PAIRS = {tuple(_CUDA_BLOCKS[b] for b in pair) for pair in _CUDA_BLOCK_PAIRS}
# MXFP8's contraction block, and the tile of its swizzled scale layout ([Note: MXFP8 on CUDA])
MX_BLOCK = 32
_SWIZZLE_ROWS, _SWIZZLE_COLS = 128, 4
# NVFP4's contraction block ([Note: NVFP4 on CUDA])
NVFP4_BLOCK = 16
# the block kernels with swizzled scales, by torch's scaling type: (contraction block, the
# scales' dtype, the operands' dtype)
_SWIZZLED_KINDS = {"BlockWise1x32": (MX_BLOCK, E8M0, E4M3),
                   "BlockWise1x16": (NVFP4_BLOCK, E4M3, E2M1)}


def _cuda_block_scales(inv: torch.Tensor, block: Tuple[int, int]) -> torch.Tensor:
    """Dequantizing scales [outer blocks, K/128] of an operand with its contraction dim last, in
    the layout CUDA's DeepSeek kernels take ([Note: the block-scaled gemm])."""
    inv = inv.to(torch.float32)
    if block[0] == 1:  # [outer, K/128], outer-dim-major
        return inv.t().contiguous().t()
    nk = inv.shape[1]
    if nk % 4:
        inv = F.pad(inv, (0, -nk % 4), value=1.0)  # [outer/128, round_up(K/128, 4)]
    # the strides are the layout: never those of whatever view ``inv`` came in as
    return inv.contiguous().t()  # [round_up(K/128, 4), outer/128]


# [Note: MXFP8 on CUDA]
# torch's MXFP8 gemm is ``torch.nn.functional.scaled_mm(a, b, sa, ScalingType.BlockWise1x32, sb,
# ScalingType.BlockWise1x32, swizzle_a=SwizzleType.SWIZZLE_32_4_4, swizzle_b=...)``: cuBLAS's
# block-scaled kernel, on CUDA sm100+ (torch's tests gate it on capability >= 10.0; ROCm takes
# unswizzled scales and is not wired up). It wants ``a`` [M, K] row-major and ``b`` [K, N]
# column-major, both e4m3, K and N multiples of 16, and for each operand seen with its contraction
# dim last (``a``, ``b.t()`` [N, K]) the e8m0 dequantizing scales of its 1x32 blocks, [rows,
# ceil(K/32)], padded to [round_up(rows, 128), round_up(ceil(K/32), 4)] and stored contiguous in
# cuBLAS's "32_4_4" order (:func:`swizzle_32_4_4`): tiles of 128 rows x 4 block-columns, the tiles
# row by row, inside a tile the scale of (row r, column c) at (r % 32) * 16 + (r // 32) * 4 + c.
# torch's CUDA kernel checks the dtypes, the number of scales, the swizzle enum and contiguity
# (restated in [Note: CUDA's block layout contract], f8dist's check of its arguments), never the
# order inside: that is f8dist's to get right, so
# tests/core/test_gemm.py checks :func:`swizzle_32_4_4` against the index formula element by element
# and runs the whole argument list through a CPU reading of it, bit for bit the CPU kernel.
#
# f8dist pads K to a multiple of 32 (the grad_weight gemm's tokens; zero bytes, exact) and N to a
# multiple of 16 (zero columns, sliced off); the padded scales are 1. A weight in 32x32 tiles
# ("mxfp8_square_weights") has as the scale of each tile the scale of each of its 32 rows' 1x32
# blocks, so its grid repeated 32 times along the rows (``_row_block_scales``, exact) is a 1x32
# grid and the same kernel runs it. The e8m0 scales f8dist keeps are quantizing powers of 2 in
# [2**-127, 2**127]; their reciprocals (what the kernel multiplies by) are in the same range and
# convert to e8m0 exactly. Written against torch's source and checked on the CPU by f8dist's own
# statement of CUDA's rules; not run on an sm100 GPU (scripts/cuda_block_check.py is the check to
# run there).


def _round_up_to(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def swizzle_32_4_4(scales: torch.Tensor) -> torch.Tensor:
    """Block scales [R, C] (R rows, C blocks along K) in cuBLAS's 32_4_4 order ([Note: MXFP8 on
    CUDA]): flat [round_up(R, 128) * round_up(C, 4)], the padding 1. Any dtype F.pad takes; the
    inverse is :func:`unswizzle_32_4_4`.

    Example::

        >>> swizzle_32_4_4(torch.arange(8.0).reshape(2, 4)).shape
        torch.Size([512])
    """
    r, c = scales.shape
    rp, cp = _round_up_to(r, _SWIZZLE_ROWS), _round_up_to(c, _SWIZZLE_COLS)
    padded = F.pad(scales, (0, cp - c, 0, rp - r), value=1.0)  # [R', C']
    # row = 128 * tile_row + 32 * i + j, column = 4 * tile_col + k
    tiles = padded.reshape(rp // 128, 4, 32, cp // 4, 4)  # [tile_row, i, j, tile_col, k]
    return tiles.permute(0, 3, 2, 1, 4).reshape(-1)  # [tile_row, tile_col, j, i, k]


def unswizzle_32_4_4(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The [rows, cols] block scales that :func:`swizzle_32_4_4` stored as ``flat``."""
    rp, cp = _round_up_to(rows, _SWIZZLE_ROWS), _round_up_to(cols, _SWIZZLE_COLS)
    tiles = flat.reshape(rp // 128, cp // 4, 32, 4, 4)  # [tile_row, tile_col, j, i, k]
    return tiles.permute(0, 3, 2, 1, 4).reshape(rp, cp)[:rows, :cols]  # the same swap undoes it


def _row_block_scales(inv: torch.Tensor, block: Tuple[int, int], rows: int) -> torch.Tensor:
    """The scales [rows, nk] of 1 x bk blocks of an operand [rows, K] in ``block = (r, bk)``
    blocks with scales [ceil(rows / r), nk]: each scale repeated for its r rows (exact)."""
    return inv if block[0] == 1 else expand_blocks(inv, (block[0], 1), (rows, inv.shape[1]))


def _torch_block_enums():
    """torch's (ScalingType, SwizzleType) for ``F.scaled_mm``, or None where this torch lacks
    them (looked up by feature: torch.nn.functional, else torch._C)."""
    kinds = getattr(F, "ScalingType", None) or getattr(torch._C, "_ScalingType", None)
    swizzles = getattr(F, "SwizzleType", None) or getattr(torch._C, "_SwizzleType", None)
    if getattr(F, "scaled_mm", None) is None or kinds is None or swizzles is None:
        return None
    return kinds, swizzles


def _has_block_api(kernel: Optional[str]) -> bool:
    """Whether this torch's ``F.scaled_mm`` names the scaling (and swizzle) types of ``kernel``."""
    enums = _torch_block_enums()
    if enums is None or kernel is None:
        return False
    if kernel in ("mxfp8", "nvfp4"):
        kind = "BlockWise1x32" if kernel == "mxfp8" else "BlockWise1x16"
        return hasattr(enums[0], kind) and hasattr(enums[1], "SWIZZLE_32_4_4")
    return all(hasattr(enums[0], name) for name in _CUDA_BLOCKS.values())


def _cuda_block_kernel(a_block, bt_block) -> Optional[str]:
    """Which CUDA kernel takes blocks ``a_block`` x ``bt_block`` (each operand seen with its
    contraction dim last): "mxfp8" (1x32, any rows: squares expand), "deepseek", or None."""
    if a_block[1] == MX_BLOCK and bt_block[1] == MX_BLOCK:
        return "mxfp8"
    return "deepseek" if (a_block, bt_block) in _CUDA_BLOCK_PAIRS else None


_EMULATE = "Float8LinearConfig(emulate=True) (dequantize, then a high-precision matmul)"


def cuda_block_problem(kernel: Optional[str], capability: Optional[Tuple[int, int]], *,
                       device: str = "cuda", api: bool = True, rocm: bool = False,
                       e8m0: bool = True, dtypes=(E4M3, E4M3), blocks: str = "") -> Optional[str]:
    """Why a block-scaled gemm for ``kernel`` (:func:`_cuda_block_kernel`) cannot run on a CUDA
    GPU of ``capability`` (None: ``device`` is not CUDA), naming what to use instead; None if it
    can ([Note: the block-scaled gemm], [Note: MXFP8 on CUDA]). ``e8m0``: both operands' scales
    are e8m0; ``dtypes``: the operands' float8 dtypes."""
    where = ("f8dist runs block-scaled gemms on the CPU (an exact kernel) and on CUDA: DeepSeek's "
             "1x128 / 128x128 blocks (the 'blockwise' recipe) on sm90, MXFP8's 1x32 e8m0 blocks "
             "(the 'mxfp8' recipes, 32x32 weight tiles too) and NVFP4's 1x16 e4m3 blocks (the "
             "'nvfp4' recipe, dense gemms) on sm100+")
    if capability is None:
        return f"no {device} kernel for float8 blocks {blocks}: {where}. Set {_EMULATE}"
    sm = f"sm{capability[0]}{capability[1]}"
    if kernel is None:
        return f"no CUDA kernel for float8 blocks {blocks}: {where}. Set {_EMULATE}"
    if rocm:
        return (f"ROCm: f8dist wires up CUDA's block-scaled kernels only ({where}). "
                f"Set {_EMULATE}")
    if kernel == "deepseek" and capability[0] != 9:
        instead = ("use the 'mxfp8' recipes (MXFP8 runs on sm100+)" if capability[0] >= 10
                   else "use the 'rowwise' or 'tensorwise' recipe")
        return (f"DeepSeek's 1x128 / 128x128 block kernels run on sm90 only (torch's check), this "
                f"GPU is {sm}: {instead}, or set {_EMULATE}")
    if kernel in ("mxfp8", "nvfp4") and capability[0] < 10:
        instead = ("use the 'blockwise' recipe (DeepSeek's 1x128 / 128x128 blocks run on sm90)"
                   if capability[0] == 9 else "use the 'rowwise' or 'tensorwise' recipe")
        what = "MXFP8 (1x32 e8m0 blocks)" if kernel == "mxfp8" else "NVFP4 (1x16 e4m3 blocks)"
        return (f"{what} needs sm100+ (Blackwell), this GPU is {sm}: {instead}, or set "
                f"{_EMULATE}")
    if not api:
        names = {"mxfp8": "ScalingType.BlockWise1x32 and SwizzleType.SWIZZLE_32_4_4 (MXFP8's gemm)",
                 "nvfp4": "ScalingType.BlockWise1x16 and SwizzleType.SWIZZLE_32_4_4 (NVFP4's gemm)",
                 }.get(kernel, "ScalingType.BlockWise1x128 (DeepSeek's blocks)")
        return (f"torch {torch.__version__} has no torch.nn.functional.scaled_mm with {names}: "
                f"upgrade torch, or set {_EMULATE}")
    if kernel == "mxfp8" and not e8m0:
        return ("CUDA's MXFP8 gemm takes e8m0 scales: set the casts' scale_dtype to "
                f"torch.float8_e8m0fnu (the 'mxfp8' recipes do), or set {_EMULATE}")
    if kernel == "mxfp8" and tuple(dtypes) != (E4M3, E4M3):
        return (f"CUDA's MXFP8 gemm takes e4m3 operands only, got {dtypes[0]} x {dtypes[1]}: "
                "cast every operand to torch.float8_e4m3fn (the 'mxfp8' recipes do), or set "
                f"{_EMULATE}")
    return None


def _mx_scales(inv: torch.Tensor, block: Tuple[int, int], rows: int) -> torch.Tensor:
    """e8m0 scales of an operand [rows, K] (contraction dim last) in ``block = (r, 32)`` blocks,
    in MXFP8's layout ([Note: MXFP8 on CUDA])."""
    grid = _row_block_scales(inv.to(torch.float32), block, rows)  # [rows, ceil(K/32)]
    return stored_scale(swizzle_32_4_4(grid), E8M0)  # e8m0 from the exponent bits, exact


def _cuda_mx_args(a, b, inv_a, inv_b, a_block, bt_block, out_dtype):
    """``F.scaled_mm``'s (args, kwargs) for MXFP8 ([Note: MXFP8 on CUDA]); the output has
    round_up(N, 16) columns."""
    kinds, swizzles = _torch_block_enums()
    (m, k), n = a.shape, b.shape[1]
    pad_k, pad_n = -k % MX_BLOCK, -n % GEMM_ALIGNMENT
    a = F.pad(a, (0, pad_k)) if pad_k else a.contiguous()  # [M, K'] row-major
    bt = F.pad(b.t(), (0, pad_k, 0, pad_n)) if pad_k or pad_n else b.t().contiguous()  # [N', K']
    sa = _mx_scales(inv_a, a_block, m)  # a's blocks, swizzled
    sb = _mx_scales(inv_b.t(), bt_block, n)  # b.t()'s blocks, swizzled
    mx, swizzle = kinds.BlockWise1x32, swizzles.SWIZZLE_32_4_4
    return ((a, bt.t(), sa, mx, sb, mx),
            dict(swizzle_a=swizzle, swizzle_b=swizzle, output_dtype=out_dtype))


def _cuda_deepseek_args(a, b, inv_a, inv_b, a_block, bt_block, out_dtype):
    """``F.scaled_mm``'s (args, kwargs) for DeepSeek's blocks ([Note: the block-scaled gemm])."""
    kinds = _torch_block_enums()[0]
    pad = -a.shape[1] % 128
    a = F.pad(a, (0, pad)) if pad else a.contiguous()  # [M, K'] row-major
    b = (F.pad(b.t(), (0, pad)) if pad else b.t().contiguous()).t()  # [K', N] column-major
    sa = _cuda_block_scales(inv_a, a_block)
    sb = _cuda_block_scales(inv_b.t(), bt_block)
    return ((a, b, sa, getattr(kinds, _CUDA_BLOCKS[a_block]),
             sb, getattr(kinds, _CUDA_BLOCKS[bt_block])), dict(output_dtype=out_dtype))


def cuda_block_args(a, b, inv_a, inv_b, a_block, b_block, *, out_dtype):
    """The arguments of ``torch.nn.functional.scaled_mm`` that compute ``a`` [M, K] @ ``b`` [K, N]
    with dequantizing float32 block scales on CUDA: (args, kwargs); the output may have padded
    columns past N. No device check (:func:`cuda_block_problem`); the layouts are checked by
    :func:`check_cuda_block_args`, on any device (meta too)."""
    a_block, bt_block = tuple(a_block), (b_block[1], b_block[0])  # b's blocks seen from b.t()
    build = _cuda_mx_args if _cuda_block_kernel(a_block, bt_block) == "mxfp8" else \
        _cuda_deepseek_args
    args, kwargs = build(a, b, inv_a, inv_b, a_block, bt_block, out_dtype)
    check_cuda_block_args(args, kwargs)
    return args, kwargs


# [Note: CUDA's block layout contract]
# What torch's CUDA ``scaled_mm`` requires of the block-scaled arguments f8dist builds, restated
# from torch's source (aten/src/ATen/native/cuda/ScaledBlas.cpp: ``_scaled_mm_cuda_v2_out``, the
# recipe checks ``check_deepseek_recipe`` / ``check_mxfp8_recipe`` of its dispatch table,
# ``_scaled_block1x128_block128x128`` and its siblings, ``_scaled_mxfp8_mxfp8``; ``_scaled_gemm``
# takes row-major x column-major only), the same rules torch 2.13's meta kernel states. Seen
# from ``a`` [M, K] and ``b`` [K, N], K = a.size(1):
#
# * a row-major, b column-major, K and N multiples of 16, one scale and one scaling type each;
# * DeepSeek: both operands e4m3, float32 scales; an operand of R rows (M for a, N for b)
#   in 1x128 blocks has scales [R, ceil(K/128)] with strides (1, R); in 128x128 blocks
#   [round_up(ceil(K/128), 4), ceil(R/128)] with strides (1, round_up(ceil(K/128), 4)); a
#   single column may have strides (1, 1);
# * MXFP8: both operands e4m3, e8m0 scales, contiguous, with round_up(R, 128) *
#   round_up(ceil(K/32), 4) elements, and one SWIZZLE_32_4_4 each (the order inside is
#   ``swizzle_32_4_4``'s, which torch cannot check: tests/core/test_gemm.py checks it);
# * NVFP4 (``BlockWise1x16``): both operands float4_e2m1fn_x2, two values a byte along K (so
#   the K above is the packed K / 2, a multiple of 16), e4m3 scales as MXFP8's with 1x16 blocks:
#   round_up(R, 128) * round_up(ceil(2 K/16), 4) elements ([Note: NVFP4 on CUDA]).
#
# torch 2.11-2.13's meta kernel of ``aten._scaled_mm_v2`` made the same checks, so tests could ask
# it on the CPU; from torch 2.14 it infers the output's shape only. This check is f8dist's own, so
# the layouts are proven without a GPU on every torch f8dist supports (tests/core/test_gemm.py also
# holds it against the meta kernel where that still checks).


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _name(kind) -> str:
    return getattr(kind, "name", str(kind))


def _deepseek_scale_problem(what: str, scale: torch.Tensor, kind: str, rows: int,
                            k: int) -> Optional[str]:
    """What is wrong with ``scale`` as the ``kind`` ("BlockWise1x128" or "BlockWise128x128")
    scales of an operand of ``rows`` rows and contraction dim ``k`` ([Note: CUDA's block layout
    contract]); None if CUDA takes it."""
    nk = -(-k // 128)
    shape = (rows, nk) if kind == "BlockWise1x128" else \
        (_round_up_to(nk, _SWIZZLE_COLS), -(-rows // 128))
    if scale.dtype != torch.float32:
        return f"{what} must be float32 for {kind}, got {scale.dtype}"
    if tuple(scale.shape) != shape:
        return f"{what} must have shape {list(shape)} for {kind}, got {list(scale.shape)}"
    # outer-dim-major; torch lets a single column have stride 1
    if scale.stride(0) != 1 or scale.stride(1) not in ((shape[0], 1) if shape[1] == 1 else
                                                       (shape[0],)):
        return (f"{what} must have strides (1, {shape[0]}) for {kind} (outer-dim-major), got "
                f"{tuple(scale.stride())}")
    return None


def cuda_block_arg_problems(args, kwargs) -> List[str]:
    """Every way in which ``F.scaled_mm(*args, **kwargs)`` breaks what CUDA's DeepSeek or MXFP8
    kernels require of block-scaled arguments ([Note: CUDA's block layout contract]); empty if
    none. Shapes, strides and dtypes only: runs on any device, meta included."""
    a, b, scale_a, kinds_a, scale_b, kinds_b = args
    kinds_a, kinds_b = [_name(x) for x in _as_list(kinds_a)], [_name(x) for x in _as_list(kinds_b)]
    scales_a, scales_b = _as_list(scale_a), _as_list(scale_b)
    (m, k), (kb, n) = a.shape, b.shape
    bad = []
    if k != kb:
        bad.append(f"a [{m}, {k}] and b [{kb}, {n}] differ along K")
    if k % GEMM_ALIGNMENT or n % GEMM_ALIGNMENT:
        bad.append(f"K={k} and N={n} must be multiples of {GEMM_ALIGNMENT}")
    if a.stride(1) != 1:
        bad.append(f"a must be row-major, got strides {tuple(a.stride())}")
    if b.stride(0) != 1:
        bad.append(f"b must be column-major, got strides {tuple(b.stride())}")
    if len(scales_a) != 1 or len(kinds_a) != 1 or len(scales_b) != 1 or len(kinds_b) != 1:
        return bad + ["one scale tensor and one scaling type per operand"]
    pair, scale_a, scale_b = (kinds_a[0], kinds_b[0]), scales_a[0], scales_b[0]
    dtype = _SWIZZLED_KINDS[pair[0]][2] if pair[0] in _SWIZZLED_KINDS else E4M3
    if (a.dtype, b.dtype) != (dtype, dtype):
        bad.append(f"both operands must be {dtype} for {pair[0]} x {pair[1]}, got {a.dtype} x "
                   f"{b.dtype}")
    if pair in _CUDA_BLOCK_KIND_PAIRS:
        bad += [p for p in (_deepseek_scale_problem("scale_a", scale_a, pair[0], m, k),
                            _deepseek_scale_problem("scale_b", scale_b, pair[1], n, k)) if p]
        if kwargs.get("use_fast_accum"):
            bad.append("use_fast_accum must be False with DeepSeek's block scales")
    elif pair[0] == pair[1] and pair[0] in _SWIZZLED_KINDS:
        kind, (bk, scale_dtype, _) = pair[0], _SWIZZLED_KINDS[pair[0]]
        k = 2 * k if a.dtype == E2M1 else k  # two e2m1 values a byte along K
        swizzles = [_name(x) for x in _as_list(kwargs.get("swizzle_a") or [])], \
            [_name(x) for x in _as_list(kwargs.get("swizzle_b") or [])]
        for what, scale, rows, swizzle in (("scale_a", scale_a, m, swizzles[0]),
                                           ("scale_b", scale_b, n, swizzles[1])):
            numel = _round_up_to(rows, _SWIZZLE_ROWS) * _round_up_to(-(-k // bk), _SWIZZLE_COLS)
            if scale.dtype != scale_dtype:
                bad.append(f"{what} must be {scale_dtype} for {kind}, got {scale.dtype}")
            if scale.numel() != numel:
                bad.append(f"{what} must have {numel} elements for {kind} "
                           f"(round_up({rows}, 128) * round_up(ceil({k}/{bk}), 4)), got "
                           f"{scale.numel()}")
            if not scale.is_contiguous():
                bad.append(f"{what} must be contiguous for {kind}")
            if swizzle != ["SWIZZLE_32_4_4"]:
                bad.append(f"swizzle_{what[-1]} must be [SWIZZLE_32_4_4] for {kind}, got "
                           f"{swizzle}")
    else:
        bad.append(f"no CUDA block kernel takes {pair[0]} x {pair[1]}")
    return bad


def check_cuda_block_args(args, kwargs) -> None:
    """Raise if CUDA's ``F.scaled_mm`` would reject these block-scaled arguments
    (:func:`cuda_block_arg_problems`); f8dist builds them (:func:`cuda_block_args`), so a
    failure here is f8dist's bug, caught before the kernel (or, without a GPU, in the tests)."""
    bad = cuda_block_arg_problems(args, kwargs)
    if bad:
        raise ValueError(
            "torch.nn.functional.scaled_mm on CUDA would reject these block-scaled arguments: "
            f"{'; '.join(bad)} ([Note: CUDA's block layout contract] in f8dist/core/gemm.py)")


def _cuda_block_scaled_mm(a, b, inv_a, inv_b, a_block, b_block, *, e8m0, out_dtype):
    """``a`` [M, K] @ ``b`` [K, N] on CUDA's block-scaled kernels ([Note: the block-scaled gemm],
    [Note: MXFP8 on CUDA]); ``e8m0``: both operands' scales are e8m0."""
    kernel = _cuda_block_kernel(a_block, (b_block[1], b_block[0]))  # b seen from b.t()
    cuda = a.device.type == "cuda"
    problem = cuda_block_problem(
        kernel, torch.cuda.get_device_capability(a.device) if cuda else None,
        device=a.device.type, api=_has_block_api(kernel),
        rocm=cuda and torch.version.hip is not None, e8m0=e8m0, dtypes=(a.dtype, b.dtype),
        blocks=f"{a_block} x {b_block}")
    if problem is not None:
        raise NotImplementedError(problem + " ([Note: the block-scaled gemm] in f8dist/core/gemm.py)")
    args, kwargs = cuda_block_args(a, b, inv_a, inv_b, a_block, b_block, out_dtype=out_dtype)
    out = F.scaled_mm(*args, **kwargs)  # [M, N'] (MXFP8: N' = round_up(N, 16))
    n = b.shape[1]
    return out[:, :n] if out.shape[1] != n else out


@torch.library.custom_op("f8dist::cpu_scaled_mm", mutates_args=())
def cpu_scaled_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=...)`` on the CPU, under CUDA's
    constraints ([Note: the CPU kernel]); ``scale_*`` are the dequantizing (inverse) scales."""
    _check_cuda_constraints(a, b, scale_a, scale_b, out_dtype)
    out = torch.mm(a.to(torch.float32), b.to(torch.float32))  # [M, N], float8 products are exact
    return (out * scale_a * scale_b).to(out_dtype)


@cpu_scaled_mm.register_fake
def _(a, b, scale_a, scale_b, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _check_cuda_constraints(a, b, scale_a, scale_b, out_dtype) -> None:
    (m, k), n = a.shape, b.shape[1]
    rowwise = not (scale_a.numel() == 1 and scale_b.numel() == 1)  # CUDA's test for tensorwise
    problems = [msg for bad, msg in (
        (a.stride(1) != 1, "a must be row-major"),
        (b.stride(0) != 1, "b must be column-major"),
        (k % GEMM_ALIGNMENT or n % GEMM_ALIGNMENT, f"K={k} and N={n} must be multiples of 16"),
        (scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32, "scales must be float32"),
        (rowwise and (tuple(scale_a.shape), tuple(scale_b.shape)) != ((m, 1), (1, n)),
         f"per-row scales must be [M, 1] and [1, N], got {tuple(scale_a.shape)}, {tuple(scale_b.shape)}"),
        (rowwise and out_dtype not in _ROWWISE_OUT_DTYPES, "per-row scales need a bfloat16 output"),
    ) if bad]
    _reject("torch._scaled_mm", problems)


def _reject(op: str, problems: List[str]) -> None:
    """The contract check's verdict: raise as CUDA's ``op`` would, naming every problem ([Note:
    scaled_mm constraints], [Note: grouped gemm constraints])."""
    if problems:
        raise RuntimeError(f"{op} on CUDA would reject this gemm: {'; '.join(problems)}")


def _kernel(a, b, scale_a, scale_b, *, out_dtype, use_fast_accum):
    if a.device.type == "cpu":  # [Note: the CPU kernel]
        return cpu_scaled_mm(a, b, scale_a, scale_b, out_dtype)
    return torch._scaled_mm(
        a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=use_fast_accum
    )


def _in_kernel_layout(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``data`` row-major; a stored copy for per-row scales ([Note: operands in their kernel
    layout])."""
    data = data.contiguous()
    return in_memory(data) if scale.dim() else data


def _round_up(x: int) -> int:
    return _round_up_to(x, GEMM_ALIGNMENT)


def kernel_block(block) -> Optional[Tuple[int, int]]:
    """The (rows, cols) blocks of a matrix (of each expert's, for a 3-D operand) that the
    block-scaled gemms take, from an operand's block (one entry per dim, None for a whole dim:
    [Note: one scale layout] in f8dist/core/tensor.py; or None): block lengths along both of its last
    two dims, not both 1. None: the tensorwise / per-row gemms, whose scales factor out of every
    dot product."""
    if block is None:
        return None
    rows, cols = tuple(block)[-2:]
    if rows is None or cols is None or rows == cols == 1:
        return None
    return rows, cols


# [Note: the NVFP4 gemm]
# NVFP4 operands ([Note: NVFP4] in f8dist/config/cells.py) carry e4m3 decode scales per 1x16 (or
# 16x16) block and a float32 decode scale per tensor ([Note: two-level scales] in
# f8dist/core/tensor.py). The gemm is the block-scaled one ([Note: the block-scaled gemm]) on the
# block scales, its float32 result multiplied by the product of the tensor scales, as CUDA's
# NVFP4 kernels take it (block scales in the kernel, the tensor scales as its alpha):
#
#     out = ta * tb * sum over k-blocks j of (sum_{k in j} a[m, k] b[k, n]) sa[m, j] sb[j, n]
#
# The data comes unpacked, one e2m1 value a byte as e4m3 (each is one; Float8Tensor holds them
# packed, [Note: packed e2m1] in f8dist/core/scaling.py).
# On the CPU ``f8dist::cpu_block_scaled_mm``: e2m1 products are exact in float32, and so is the
# product of two e4m3 scales. Emulation dequantizes each operand (``nvfp4_dequantize``) and runs
# a float32 matmul. The tensor scales enter the dense kernel as its ``alpha``, so the output
# leaves it rounded to its dtype: multiplied outside, inductor fused the cast to bf16 with the
# layer's bias add and skipped the rounding, so compiled outputs differed from eager's. On CUDA
# sm100+ torch's NVFP4 ``scaled_mm`` runs the dense gemm ([Note: NVFP4 on CUDA]); elsewhere off
# the CPU the gemm raises naming ``emulate=True``.
#
# Grouped (experts: [Note: block grouped gemms] in f8dist/nn/grouped.py) the gemm is the block
# grouped one ([Note: the CPU block grouped kernel]) on the e4m3 block scales, its float32 result
# times ``ta * tb``: one tensor scale per operand, the logical tensor's (all tokens; the whole
# [E, N, K] weight), which factors out of every expert's gemm as it does out of a dense one.
# Per expert, bit for bit the dense NVFP4 gemm of that expert's rows.


# [Note: NVFP4 on CUDA]
# torch's NVFP4 gemm is ``torch.nn.functional.scaled_mm(a, b, sa, ScalingType.BlockWise1x16, sb,
# ScalingType.BlockWise1x16, swizzle_a=SwizzleType.SWIZZLE_32_4_4, swizzle_b=...)``: cuBLAS's
# block-scaled kernel on CUDA sm100+ (built with CUDA >= 12.8), found by feature (``BlockWise1x16``
# in torch's ScalingType; read against torch 2.13's source and meta kernel). It is MXFP8's
# ([Note: MXFP8 on CUDA]) with e2m1 data and e4m3 scales of 1x16 blocks: ``a`` [M, K/2]
# row-major and ``b`` [K/2, N] column-major, float4_e2m1fn_x2 packed along K (torchao's
# ``_addmm_nvfp4_dispatch`` passes the same), each operand's e4m3 decode scales [rows, K/16]
# swizzled by :func:`swizzle_32_4_4` (torchao's ``to_blocked``, bit for bit; f8dist pads with 1,
# torchao with 0: padding meets zero data or output columns that are sliced off). The kernel
# runs single-level, as torchao calls it: its float32 output times ``ta * tb`` in float32, then
# ``out_dtype``, the CPU kernel's order ([Note: the NVFP4 gemm]).
#
# The gemm reads e2m1 values one a byte (``_gemm_data`` in f8dist/core/tensor.py), so every
# operand is packed along K here (:func:`_pack_along_k`): a cast in (1, 16) blocks was packed
# along K already, grad_weight's operands (packed along the features, [Note: packed e2m1]) were
# not. Either way the repack costs an unpack (tensor.py: 0.5 byte read, 1 written per value), a
# float32 copy (4 bytes) and the pack (0.5 byte written): elementwise passes over the operand,
# no gemm. K is zero-padded to a multiple of 32 (16 packed bytes; exact) and N to 16 (zero
# columns, sliced off). Token groups (experts) have no NVFP4 kernel f8dist wires up: grouped on
# CUDA raises naming ``emulate=True``. Not run on an sm100 GPU (scripts/cuda_block_check.py's
# nvfp4 part is the check to run there).


def _pack_along_k(x: torch.Tensor, k: int, rows: int) -> torch.Tensor:
    """e2m1 values ``x`` [R, K] (one a byte, any float dtype) zero-padded to [rows, k] and packed
    two a byte along K: [rows, k/2] float4_e2m1fn_x2, row-major ([Note: NVFP4 on CUDA])."""
    x = x.to(torch.float32)
    x = F.pad(x, (0, k - x.shape[1], 0, rows - x.shape[0]))  # [rows, k]
    packed = e2m1_pack(x, dim=1)  # [rows, k / 2], in whatever strides the pack left
    return packed.view(torch.uint8).contiguous().view(E2M1)  # float4 has no copy kernel


def _nvfp4_scales(decode: torch.Tensor, block: Tuple[int, int], rows: int) -> torch.Tensor:
    """e4m3 decode scales of an operand [rows, K] (contraction dim last) in ``block = (r, 16)``
    blocks, in the kernel's swizzled layout ([Note: NVFP4 on CUDA])."""
    grid = _row_block_scales(decode.to(torch.float32), block, rows)  # [rows, ceil(K/16)]
    return swizzle_32_4_4(grid).to(E4M3)  # e4m3 values and the padding 1: exact


def cuda_nvfp4_args(a, b, scale_a, scale_b, a_block, b_block, *, out_dtype):
    """The arguments of ``torch.nn.functional.scaled_mm`` that compute ``a`` [M, K] @ ``b``
    [K, N] for e2m1 values (one a byte) with e4m3 decode block scales, ``a_block`` / ``b_block``
    along K of 16, on CUDA: (args, kwargs), the output float32 with round_up(N, 16) columns, not
    yet times the tensor scales ([Note: NVFP4 on CUDA]); checked by
    :func:`check_cuda_block_args`."""
    kinds, swizzles = _torch_block_enums()
    a_block, bt_block = tuple(a_block), (b_block[1], b_block[0])  # b's blocks seen from b.t()
    (m, k), n = a.shape, b.shape[1]
    kp = _round_up_to(k, 2 * GEMM_ALIGNMENT)  # 16 packed bytes
    a2 = _pack_along_k(a, kp, m)  # [M, K'/2] row-major
    bt = _pack_along_k(b.t(), kp, _round_up(n))  # [N', K'/2]
    sa = _nvfp4_scales(scale_a, a_block, m)  # a's blocks, swizzled
    sb = _nvfp4_scales(scale_b.t(), bt_block, n)  # b.t()'s blocks, swizzled
    nv, swizzle = kinds.BlockWise1x16, swizzles.SWIZZLE_32_4_4
    args = (a2, bt.t(), sa, nv, sb, nv)
    kwargs = dict(swizzle_a=swizzle, swizzle_b=swizzle, output_dtype=out_dtype)
    check_cuda_block_args(args, kwargs)
    return args, kwargs


def _cuda_nvfp4_mm(a, b, scale_a, scale_b, a_block, b_block, offs, tensor_scales, *,
                   out_dtype) -> torch.Tensor:
    """The NVFP4 gemm on CUDA's kernel ([Note: NVFP4 on CUDA]), or the error naming what runs."""
    cuda = a.device.type == "cuda"
    kernel = "nvfp4" if a_block[1] == b_block[0] == NVFP4_BLOCK and offs is None else None
    blocks = f"{tuple(a_block)} x {tuple(b_block)}" + (" grouped" if offs is not None else "")
    problem = cuda_block_problem(
        kernel, torch.cuda.get_device_capability(a.device) if cuda else None,
        device=a.device.type, api=_has_block_api(kernel),
        rocm=cuda and torch.version.hip is not None, blocks=f"(NVFP4) {blocks}")
    if problem is not None:
        raise NotImplementedError(problem + " ([Note: NVFP4 on CUDA] in f8dist/core/gemm.py)")
    args, kwargs = cuda_nvfp4_args(a, b, scale_a, scale_b, a_block, b_block,
                                   out_dtype=torch.float32)
    out = F.scaled_mm(*args, **kwargs)[:, :b.shape[1]]  # [M, N]
    ta, tb = tensor_scales
    return (out * (ta * tb)).to(out_dtype)


def _nvfp4_mm(a_data, a_scale, a_block, b_data, b_scale, b_block, offs, tensor_scales, *,
              out_dtype, mm_config) -> torch.Tensor:
    """The gemm of two NVFP4 operands ([Note: the NVFP4 gemm])."""
    ta, tb = tensor_scales
    if ta is None or tb is None or a_block is None:
        raise TypeError("an NVFP4 operand meets another format: both operands of an NVFP4 gemm "
                        "need e4m3 block scales and a tensor scale (the config's gemm cells must "
                        "agree)")
    if mm_config.emulate:  # dequantize, then the high-precision gemm
        a_hp = nvfp4_dequantize(a_data, a_scale, a_block, ta, torch.float32)
        b_hp = nvfp4_dequantize(b_data, b_scale, b_block, tb, torch.float32)
        if offs is None:
            return emulated_mm(a_hp, b_hp, out_dtype)
        return _grouped_hp(a_hp, b_hp, offs.to(torch.int32)).to(out_dtype)
    if a_data.device.type not in ("cpu", "meta"):  # meta: shapes only, the CPU op's fake kernel
        return _cuda_nvfp4_mm(a_data, b_data, a_scale, b_scale, a_block, b_block, offs,
                              tensor_scales, out_dtype=out_dtype)
    inv_a, inv_b = a_scale.to(torch.float32), b_scale.to(torch.float32)  # decode scales
    if offs is None:
        return cpu_block_scaled_mm(in_memory(a_data.contiguous()), b_data, inv_a, inv_b,
                                   list(a_block), list(b_block), out_dtype, ta * tb)  # [M, N]
    out = cpu_block_scaled_grouped_mm(a_data, b_data, inv_a, inv_b, list(a_block),
                                      list(b_block), offs.to(torch.int32), torch.float32)
    return (out * (ta * tb)).to(out_dtype)


# [Note: one gemm entry]
# ``float8_mm`` is the float8 gemm of every kind: dense or grouped (token groups ``offs``), with
# per-tensor / per-row scales or block scales. It reads the kind off the operands' blocks (block
# lengths along both dims of a matrix: ``kernel_block``) and ``offs``, and runs that kind's row
# of ``_GEMMS``: its contract (the block pair for both block kinds, CUDA's constraints inside
# each CPU kernel), then emulation (dequantize, then a high-precision gemm), CUDA's kernel or the
# kind's one exact CPU kernel. Float8Tensor's op table calls it for ``aten.mm`` and
# ``aten._grouped_mm`` alike (f8dist/core/tensor.py); ``scaled_mm``, ``scaled_grouped_mm`` and
# ``block_scaled_grouped_mm`` are its rows, public for their callers.


def float8_mm(a_data: torch.Tensor, a_scale: torch.Tensor, a_block, b_data: torch.Tensor,
              b_scale: torch.Tensor, b_block, offs: Optional[torch.Tensor] = None, *,
              out_dtype: torch.dtype, mm_config: ScaledMMConfig,
              tensor_scales: Tuple[Optional[torch.Tensor], Optional[torch.Tensor]] = (None, None),
              ) -> torch.Tensor:
    """``a_hp @ b_hp`` for float8 data and quantizing scales (``x_hp = x_data / x_scale``), each
    scale a grid over its operand's ``block`` ([Note: one scale layout] in f8dist/core/tensor.py;
    None: one scale): dense, ``a_data`` [M, K] @ ``b_data`` [K, N]; grouped over the token groups
    ``offs``, [M, K] @ [E, K, N] -> [M, N] or [N, M] @ [M, K] -> [E, N, K] ([Note: one gemm
    entry]). ``tensor_scales``: NVFP4's second level of each operand, whose ``*_scale`` grids are
    then e4m3 decode scales ([Note: the NVFP4 gemm])."""
    if offs is None and 0 in (a_data.shape[0], a_data.shape[1], b_data.shape[1]):
        # an empty batch: nothing to multiply, or a sum of nothing
        return a_data.new_zeros((a_data.shape[0], b_data.shape[1]), dtype=out_dtype)
    a_block, b_block = kernel_block(a_block), kernel_block(b_block)
    blocks = a_block is not None or b_block is not None
    if blocks:
        _check_block_pair(a_block, b_block)
    if any(t is not None for t in tensor_scales):
        return _nvfp4_mm(a_data, a_scale, a_block, b_data, b_scale, b_block, offs, tensor_scales,
                         out_dtype=out_dtype, mm_config=mm_config)
    return _GEMMS[offs is not None, blocks](a_data, a_scale, a_block, b_data, b_scale, b_block,
                                           offs, out_dtype=out_dtype, mm_config=mm_config)


def scaled_mm(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    mm_config: ScaledMMConfig,
    a_block: Optional[Tuple[int, int]] = None,
    b_block: Optional[Tuple[int, int]] = None,
) -> torch.Tensor:
    """The product of float8 ``a_data`` [M, K] and ``b_data`` [K, N] scaled by ``a_scale`` ([] or
    [M, 1]) and ``b_scale`` ([] or [1, N]), in ``out_dtype``; with ``a_block``/``b_block`` the
    scales are per block ([Note: the block-scaled gemm]). The dense rows of :func:`float8_mm`."""
    return float8_mm(a_data, a_scale, a_block, b_data, b_scale, b_block, out_dtype=out_dtype,
                     mm_config=mm_config)


def _scaled_mm(a_data, a_scale, a_block, b_data, b_scale, b_block, offs, *, out_dtype,
               mm_config) -> torch.Tensor:
    """The dense gemm of per-tensor / per-row scales ([Note: scaled_mm constraints])."""
    cfg = mm_config
    m, k = a_data.shape
    n = b_data.shape[1]
    if cfg.emulate:
        return emulated_mm(_dequantized(a_data, a_scale, None),
                           _dequantized(b_data, b_scale, None), out_dtype)

    check_gemm_shape(k, n, what="float8 gemm", pad_inner_dim=cfg.pad_inner_dim, pad_k=cfg.pad_k)
    pad_k, pad_n = _round_up(k) - k, _round_up(n) - n
    if pad_k or pad_n:  # F.pad writes a contiguous tensor: pad each operand in its kernel layout
        a_data = F.pad(a_data, (0, pad_k))  # [M, K'] row-major
        b_data = F.pad(b_data.t(), (0, pad_k, 0, pad_n)).t()  # [K', N'] column-major
        if b_scale.dim() == 2 and pad_n:
            b_scale = F.pad(b_scale, (0, pad_n), value=1.0)  # [1, N']

    a_data = _in_kernel_layout(a_data, a_scale)  # row-major
    b_data = _in_kernel_layout(b_data.t(), b_scale).t()  # column-major
    a_inv = a_scale.reciprocal().to(torch.float32)
    b_inv = b_scale.reciprocal().to(torch.float32)

    axiswise = a_inv.numel() > 1 or b_inv.numel() > 1
    if axiswise and a_inv.dim() == 0:
        a_inv = a_inv.expand(m, 1)
    if axiswise and b_inv.dim() == 0:
        b_inv = b_inv.expand(1, b_data.shape[1])

    if axiswise and out_dtype not in _ROWWISE_OUT_DTYPES:  # [Note: scaled_mm constraints]
        one = torch.ones((), dtype=torch.float32, device=a_data.device)
        out = _kernel(a_data, b_data, one, one, out_dtype=torch.float32,
                      use_fast_accum=cfg.use_fast_accum)  # [M, N']
        out = (out * a_inv * b_inv).to(out_dtype)
    else:
        out = _kernel(a_data, b_data, a_inv.contiguous(), b_inv.contiguous(), out_dtype=out_dtype,
                      use_fast_accum=cfg.use_fast_accum)  # [M, N']
    if pad_n:
        out = out[:, :n]
    return out


# ---------------------------------------------------------------------------------------------
# the grouped gemms
# ---------------------------------------------------------------------------------------------

def pad_groups(offsets: torch.Tensor, m: int, alignment: int = GEMM_ALIGNMENT
               ) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Each token group rounded up to a multiple of ``alignment`` rows ([Note: grouped gemm
    constraints]; a block along the tokens, [Note: block grouped gemms] in f8dist/nn/grouped.py):
    (padded offsets [E] int32, the padded row of each of the ``m`` rows [M], padded rows)."""
    sizes = torch.diff(offsets, prepend=offsets.new_zeros(1))  # [E]
    padded_offsets = torch.cumsum(_round_up_to(sizes, alignment), 0).to(torch.int32)  # [E]
    ids = group_ids(offsets, m)  # [M]
    shift = torch.cat([padded_offsets.new_zeros(1), padded_offsets - offsets])  # [E + 1]
    rows = torch.arange(m, device=offsets.device) + shift[ids]  # [M]
    m_padded = _round_up_to(m, alignment) + alignment * offsets.shape[0]  # static
    return padded_offsets, rows, m_padded


def scatter_rows(x: torch.Tensor, rows: torch.Tensor, m_padded: int, fill: float = 0.0):
    """``x`` [M, C] placed at ``rows`` of a [M_padded, C] tensor of ``fill`` (float8 via uint8)."""
    raw = x.view(torch.uint8) if x.dtype == E4M3 else x
    out = raw.new_full((m_padded, x.shape[1]), fill)  # [M_padded, C]
    out = out.index_copy(0, rows, raw)
    return out.view(x.dtype) if x.dtype == E4M3 else out


@torch.library.custom_op("f8dist::cpu_scaled_grouped_mm", mutates_args=())
def cpu_scaled_grouped_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
    offs: torch.Tensor, out_dtype: torch.dtype,
) -> torch.Tensor:
    """``torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype=...)`` on the CPU, under
    CUDA's constraints ([Note: the CPU grouped kernel])."""
    _check_grouped_constraints(a, b, scale_a, scale_b, offs, out_dtype)
    out = torch._grouped_mm(a.to(torch.float32), b.to(torch.float32), offs)  # exact products
    e = offs.shape[0]
    if b.dim() == 3:  # 2d x 3d: [M, N], scale_a [M], scale_b [E, N]
        ids = group_ids(offs, a.shape[0]).clamp(max=e - 1)  # [M]
        out = out * scale_a[:, None] * scale_b[ids]
    else:  # 2d x 2d: [E, N, K], scale_a [E * N], scale_b [E * K]
        out = out * scale_a.view(e, -1, 1) * scale_b.view(e, 1, -1)
    return out.to(out_dtype)


@cpu_scaled_grouped_mm.register_fake
def _(a, b, scale_a, scale_b, offs, out_dtype):
    if b.dim() == 3:
        return a.new_empty((a.shape[0], b.shape[-1]), dtype=out_dtype)
    return a.new_empty((offs.shape[0], a.shape[0], b.shape[1]), dtype=out_dtype)


def _check_grouped_constraints(a, b, scale_a, scale_b, offs, out_dtype) -> None:
    k = a.shape[1]
    n = b.shape[-1]
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    problems = [msg for bad, msg in (
        (a.dtype != E4M3 or b.dtype != E4M3, f"operands must be e4m3, got {a.dtype}, {b.dtype}"),
        (a.stride(-1) != 1, "a must be row-major"),
        (b.stride(-2) != 1, "b must be column-major"),
        (k % GEMM_ALIGNMENT or n % GEMM_ALIGNMENT, f"K={k} and N={n} must be multiples of 16"),
        (offs.dtype != torch.int32, "offsets must be int32"),
        (bool((sizes % GEMM_ALIGNMENT).any()), "token groups must be multiples of 16 rows"),
        (scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32, "scales must be float32"),
        (out_dtype != torch.bfloat16, "the output must be bfloat16"),
    ) if bad]
    _reject("torch._scaled_grouped_mm", problems)


def _grouped_kernel(a, b, scale_a, scale_b, offs, *, mm_config: ScaledMMConfig) -> torch.Tensor:
    if a.device.type in ("cpu", "meta"):  # [Note: the CPU grouped kernel]; meta: its fake
        return cpu_scaled_grouped_mm(a, b, scale_a, scale_b, offs, torch.bfloat16)
    if a.device.type != "cuda" or torch.cuda.get_device_capability(a.device) < (9, 0):
        raise RuntimeError(
            f"float8 grouped gemms need torch._scaled_grouped_mm, which runs on CUDA sm90+ only "
            f"(got {a.device}); set Float8LinearConfig(emulate=True) to emulate them, or keep the "
            f"experts in high precision with module_filter_fn"
        )
    return torch._scaled_grouped_mm(
        a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16,
        use_fast_accum=mm_config.use_fast_accum,
    )


def scaled_grouped_mm(
    a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
    offsets: torch.Tensor, *, out_dtype: torch.dtype, mm_config: ScaledMMConfig,
) -> torch.Tensor:
    """A float8 grouped gemm ([Note: grouped gemm constraints]) from quantizing scales
    (``x_hp = x_data / x_scale``):

    * ``b_data`` 3-D: ``a_data`` [M, K] with ``a_scale`` [M], ``b_data`` [E, K, N] with
      ``b_scale`` [E, N] -> [M, N];
    * ``b_data`` 2-D: ``a_data`` [N, M] with ``a_scale`` [E, N], ``b_data`` [M, K] with
      ``b_scale`` [E, K] -> [E, N, K], contracting each group's columns of ``a`` and rows of ``b``.
    """
    a_inv = a_scale.reciprocal().to(torch.float32)
    b_inv = b_scale.reciprocal().to(torch.float32)
    if mm_config.emulate:
        a_hp = a_data.to(torch.float32) * (a_inv[:, None] if b_data.dim() == 3 else 1.0)
        if b_data.dim() == 3:
            b_hp = b_data.to(torch.float32) * b_inv[:, None, :]  # [E, K, N]
            return torch._grouped_mm(a_hp, b_hp, offsets).to(out_dtype)
        out = torch._grouped_mm(a_hp, b_data.to(torch.float32), offsets)  # [E, N, K]
        return (out * a_inv[:, :, None] * b_inv[:, None, :]).to(out_dtype)

    offsets = offsets.to(torch.int32)
    if b_data.dim() == 3:
        m = a_data.shape[0]
        padded, rows, m_padded = pad_groups(offsets, m)
        a = scatter_rows(a_data, rows, m_padded)  # [M', K] row-major
        sa = scatter_rows(a_inv[:, None], rows, m_padded, 1.0)[:, 0]  # [M']
        b = b_data.transpose(-2, -1).contiguous().transpose(-2, -1)  # [E, K, N] column-major
        out = _grouped_kernel(a, b, sa, b_inv.contiguous(), padded, mm_config=mm_config)  # [M', N]
        valid = group_ids(offsets, m) < offsets.shape[0]  # [M]: rows past the groups get 0
        return torch.where(valid[:, None], out[rows], 0).to(out_dtype)  # [M, N]
    m = a_data.shape[1]
    padded, rows, m_padded = pad_groups(offsets, m)
    a = scatter_rows(a_data.t(), rows, m_padded).t().contiguous()  # [N, M'] row-major
    b = scatter_rows(b_data, rows, m_padded).t().contiguous().t()  # [M', K] column-major
    out = _grouped_kernel(a, b, a_inv.reshape(-1).contiguous(), b_inv.reshape(-1).contiguous(), padded,
                  mm_config=mm_config)  # [E, N, K]
    return out.to(out_dtype)


def _per_group(scale: torch.Tensor, offsets: torch.Tensor, cols: int) -> torch.Tensor:
    """Per-row scales that are constant over each token group ([M, C] or [M, 1]) -> [E, cols],
    1 for an empty group (it multiplies nothing)."""
    e, m = offsets.shape[0], scale.shape[0]
    if m == 0:
        return scale.new_ones((e, cols))
    sizes = torch.diff(offsets, prepend=offsets.new_zeros(1))  # [E]
    starts = (offsets - sizes).clamp(max=m - 1).long()  # [E]
    per_group = scale[starts].expand(e, cols)  # [E, cols]
    return torch.where(sizes[:, None] > 0, per_group, torch.ones_like(per_group))


def _rows(scale: torch.Tensor, m: int) -> torch.Tensor:
    """A token operand's scale ([M, 1], or [] for none) as one per row: [M]."""
    return scale.expand(m, 1)[:, 0].contiguous()


def _token_scales(scale: torch.Tensor, m: int) -> torch.Tensor:
    """A token operand's scales ([M, C] or [M, 1] per group, or [] for a delayed one) as rows:
    [M, C] or [M, 1]."""
    return scale.expand(m, scale.shape[-1] if scale.dim() else 1)


def grouped_scales(a_scale: torch.Tensor, a_shape, b_scale: torch.Tensor, b_shape,
                   offsets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Float8Tensor scales (broadcastable to their operands) as :func:`scaled_grouped_mm` takes
    them: 2d x 3d, ``a`` [M, K] per row ([M, 1], or [] for a delayed one) -> [M], ``b``
    [E, K, N] per expert and column ([E, 1, 1] or [E, 1, N]) -> [E, N]; 2d x 2d,
    ``a`` [N, M] and ``b`` [M, K], each per token group -> [E, N] and [E, K]."""
    if len(b_shape) == 3:
        return _rows(a_scale, a_shape[0]), b_scale.expand(*b_shape)[:, 0].contiguous()
    (n, m), k = a_shape, b_shape[1]
    a_tokens = a_scale.t() if a_scale.dim() else a_scale  # [M, C]
    return (_per_group(_token_scales(a_tokens, m), offsets, n),
            _per_group(_token_scales(b_scale, m), offsets, k))


# [Note: the CPU block grouped kernel]
# With block scales ([Note: block grouped gemms] in f8dist/nn/grouped.py) each expert's gemm is the
# dense block-scaled gemm ([Note: the block-scaled gemm] in f8dist/core/gemm.py) on its token group:
# ``f8dist::cpu_block_scaled_grouped_mm`` runs ``block_products``, the dense CPU kernel's own
# code, once per non-empty group (the group sizes read on the host: one sync per gemm, inside one
# opaque custom op), so a grouped gemm gives a Float8Linear's bits per expert. It checks the
# layout the groups need: 2d x 3d, the scales of ``a`` one row of blocks per token (a group may
# end anywhere); 2d x 2d, every group a multiple of the contraction block (the caller pads the
# groups, so no block spans two experts). torch 2.13 has no block-scaled grouped kernel on CUDA
# that f8dist wires up (MXFP8's ``torch._scaled_grouped_mm`` wants sm100 and swizzled e8m0
# scales, DeepSeek's 1x128 x 128x128 none): on CUDA these gemms raise, naming
# ``Float8LinearConfig(emulate=True)``.


def _groups(offs: torch.Tensor):
    """[(expert, start, end)] of the non-empty token groups (read on the host)."""
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    return [(e, s, t) for e, (s, t) in enumerate(zip(starts, ends)) if t > s]


@torch.library.custom_op("f8dist::cpu_block_scaled_grouped_mm", mutates_args=())
def cpu_block_scaled_grouped_mm(
    a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
    a_block: List[int], b_block: List[int], offs: torch.Tensor, out_dtype: torch.dtype,
) -> torch.Tensor:
    """The block-scaled grouped gemm on the CPU ([Note: the CPU block grouped kernel]) from
    dequantizing float32 block scales:

    * 2d x 3d: ``a`` [M, K] with ``inv_a`` [M, K/bk] (``a_block`` (1, bk)), ``b`` [E, K, N] with
      ``inv_b`` [E, K/bk, N/bn] -> [M, N]; rows past the last group are 0;
    * 2d x 2d: ``a`` [N, M] with ``inv_a`` [N/bn, M/bk], ``b`` [M, K] with ``inv_b``
      [M/bk, K/bk'], every group a multiple of bk rows -> [E, N, K]; an empty group gives 0.
    """
    bk = a_block[1]
    if a_block[1] != b_block[0]:
        raise ValueError(f"block grouped gemm: a's blocks {tuple(a_block)} and b's "
                         f"{tuple(b_block)} differ along the contraction dim")
    if b.dim() == 3:
        if a_block[0] != 1:
            raise ValueError(f"block grouped gemm: the tokens' blocks {tuple(a_block)} must be one "
                             "token high, or a block would span two experts' groups")
        out = a.new_zeros((a.shape[0], b.shape[-1]), dtype=torch.float32)  # [M, N]
        for e, s, t in _groups(offs):
            out[s:t] = block_products(a[s:t], b[e], inv_a[s:t], inv_b[e], a_block, b_block)
        return out.to(out_dtype)
    if bool((offs % bk).any()):
        raise ValueError(f"block grouped gemm: token groups must be multiples of the contraction "
                         f"block ({bk} rows), got offsets {offs.tolist()}; pad the groups "
                         "(pad_groups)")
    out = a.new_zeros((offs.shape[0], a.shape[0], b.shape[1]), dtype=torch.float32)  # [E, N, K]
    for e, s, t in _groups(offs):
        out[e] = block_products(a[:, s:t], b[s:t], inv_a[:, s // bk:t // bk],
                                inv_b[s // bk:t // bk], a_block, b_block)
    return out.to(out_dtype)


@cpu_block_scaled_grouped_mm.register_fake
def _(a, b, inv_a, inv_b, a_block, b_block, offs, out_dtype):
    if b.dim() == 3:
        return a.new_empty((a.shape[0], b.shape[-1]), dtype=out_dtype)
    return a.new_empty((offs.shape[0], a.shape[0], b.shape[1]), dtype=out_dtype)


def _grouped_hp(a_hp: torch.Tensor, b_hp: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The emulated grouped gemm of dequantized operands: 2d x 2d [E, N, K]; 2d x 3d [M, N]
    with the rows past the last group 0, as the kernels give them."""
    out = torch._grouped_mm(a_hp, b_hp, offsets)
    if b_hp.dim() == 2:
        return out  # [E, N, K]
    valid = group_ids(offsets, a_hp.shape[0]) < offsets.shape[0]  # [M]
    return torch.where(valid[:, None], out, 0)  # [M, N]


def block_scaled_grouped_mm(
    a_data: torch.Tensor, a_scale: torch.Tensor, a_block, b_data: torch.Tensor,
    b_scale: torch.Tensor, b_block, offsets: torch.Tensor, *, out_dtype: torch.dtype,
    mm_config: ScaledMMConfig,
) -> torch.Tensor:
    """A block-scaled float8 grouped gemm from quantizing block scales (float32 or e8m0 grids, a
    3-D grid per expert for a 3-D ``b_data``), shapes as :func:`cpu_block_scaled_grouped_mm`;
    bfloat16 out as CUDA's grouped gemms, then ``out_dtype``."""
    offsets = offsets.to(torch.int32)
    if mm_config.emulate:  # dequantize, then the high-precision grouped gemm
        a_hp, b_hp = _dequantized(a_data, a_scale, a_block), _dequantized(b_data, b_scale, b_block)
        return _grouped_hp(a_hp, b_hp, offsets).to(out_dtype)
    if a_data.device.type not in ("cpu", "meta"):  # meta: shapes only, the CPU op's fake
        raise NotImplementedError(
            f"block-scaled float8 grouped gemms run on the CPU kernel only; on "
            f"{a_data.device.type} set Float8LinearConfig(emulate=True) or use the 'rowwise' or "
            "'tensorwise' recipe for the experts ([Note: the CPU block grouped kernel] in "
            "f8dist/core/gemm.py)")
    inv_a = a_scale.to(torch.float32).reciprocal()  # powers of 2 (e8m0) invert exactly
    inv_b = b_scale.to(torch.float32).reciprocal()
    out = cpu_block_scaled_grouped_mm(a_data, b_data, inv_a, inv_b, list(a_block),
                                      list(b_block), offsets, torch.bfloat16)
    return out.to(out_dtype)


def _scaled_grouped(a_data, a_scale, a_block, b_data, b_scale, b_block, offs, *, out_dtype,
                    mm_config) -> torch.Tensor:
    """The grouped gemm of per-tensor / per-row scales: the Float8Tensors' scales in the
    kernel's layout (:func:`grouped_scales`), then :func:`scaled_grouped_mm`."""
    a_scale, b_scale = grouped_scales(a_scale, a_data.shape, b_scale, b_data.shape, offs)
    return scaled_grouped_mm(a_data, a_scale, b_data, b_scale, offs, out_dtype=out_dtype,
                             mm_config=mm_config)


# the gemm of each kind ([Note: one gemm entry]): (grouped, block scales) -> its row, each
# taking (a_data, a_scale, a_block, b_data, b_scale, b_block, offs, *, out_dtype, mm_config)
_GEMMS = {
    (False, False): _scaled_mm,
    (False, True): _block_scaled_mm,
    (True, False): _scaled_grouped,
    (True, True): block_scaled_grouped_mm,
}
