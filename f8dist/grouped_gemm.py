"""The float8 grouped gemm: ``torch._scaled_grouped_mm`` with the layout and padding it needs.

Two shapes of problem, both over jagged token groups (``offsets``, [Note: token groups] in
f8dist/scaling.py), as in ``torch._grouped_mm``::

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
"""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn.functional as F

from f8dist.config import E4M3, ScaledMMConfig
from f8dist.gemm import GEMM_ALIGNMENT, block_products
from f8dist.scaling import expand_blocks, group_ids

__all__ = ["scaled_grouped_mm", "block_scaled_grouped_mm", "pad_groups", "scatter_rows",
           "grouped_scales"]


def _round_up(x, alignment: int = GEMM_ALIGNMENT):
    return (x + alignment - 1) // alignment * alignment


def pad_groups(offsets: torch.Tensor, m: int, alignment: int = GEMM_ALIGNMENT
               ) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Each token group rounded up to a multiple of ``alignment`` rows ([Note: grouped gemm
    constraints]; a block along the tokens, [Note: block grouped gemms] in f8dist/grouped.py):
    (padded offsets [E] int32, the padded row of each of the ``m`` rows [M], padded rows)."""
    sizes = torch.diff(offsets, prepend=offsets.new_zeros(1))  # [E]
    padded_offsets = torch.cumsum(_round_up(sizes, alignment), 0).to(torch.int32)  # [E]
    ids = group_ids(offsets, m)  # [M]
    shift = torch.cat([padded_offsets.new_zeros(1), padded_offsets - offsets])  # [E + 1]
    rows = torch.arange(m, device=offsets.device) + shift[ids]  # [M]
    m_padded = _round_up(m, alignment) + alignment * offsets.shape[0]  # static
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
    _check_cuda_constraints(a, b, scale_a, scale_b, offs, out_dtype)
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


def _check_cuda_constraints(a, b, scale_a, scale_b, offs, out_dtype) -> None:
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
    if problems:
        raise RuntimeError(
            f"torch._scaled_grouped_mm on CUDA would reject this gemm: {'; '.join(problems)}")


def _kernel(a, b, scale_a, scale_b, offs, *, mm_config: ScaledMMConfig) -> torch.Tensor:
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
        out = _kernel(a, b, sa, b_inv.contiguous(), padded, mm_config=mm_config)  # [M', N]
        valid = group_ids(offsets, m) < offsets.shape[0]  # [M]: rows past the groups get 0
        return torch.where(valid[:, None], out[rows], 0).to(out_dtype)  # [M, N]
    m = a_data.shape[1]
    padded, rows, m_padded = pad_groups(offsets, m)
    a = scatter_rows(a_data.t(), rows, m_padded).t().contiguous()  # [N, M'] row-major
    b = scatter_rows(b_data, rows, m_padded).t().contiguous().t()  # [M', K] column-major
    out = _kernel(a, b, a_inv.reshape(-1).contiguous(), b_inv.reshape(-1).contiguous(), padded,
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
# With block scales ([Note: block grouped gemms] in f8dist/grouped.py) each expert's gemm is the
# dense block-scaled gemm ([Note: the block-scaled gemm] in f8dist/gemm.py) on its token group:
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
        a_hp = a_data.to(torch.float32) / expand_blocks(a_scale, a_block, a_data.shape)
        b_hp = b_data.to(torch.float32) / expand_blocks(b_scale, b_block, b_data.shape)
        if b_data.dim() == 2:
            return torch._grouped_mm(a_hp, b_hp, offsets).to(out_dtype)  # [E, N, K]
        out = torch._grouped_mm(a_hp, b_hp, offsets)  # [M, N]
        valid = group_ids(offsets, a_data.shape[0]) < offsets.shape[0]  # [M]
        return torch.where(valid[:, None], out, 0).to(out_dtype)
    if a_data.device.type not in ("cpu", "meta"):  # meta: shapes only, the CPU op's fake
        raise NotImplementedError(
            f"block-scaled float8 grouped gemms run on the CPU kernel only; on "
            f"{a_data.device.type} set Float8LinearConfig(emulate=True) or use the 'rowwise' or "
            "'tensorwise' recipe for the experts ([Note: the CPU block grouped kernel] in "
            "f8dist/grouped_gemm.py)")
    inv_a = a_scale.to(torch.float32).reciprocal()  # powers of 2 (e8m0) invert exactly
    inv_b = b_scale.to(torch.float32).reciprocal()
    out = cpu_block_scaled_grouped_mm(a_data, b_data, inv_a, inv_b, list(a_block),
                                      list(b_block), offsets, torch.bfloat16)
    return out.to(out_dtype)
