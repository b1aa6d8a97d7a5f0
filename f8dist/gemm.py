"""The float8 gemm: ``torch._scaled_mm`` with the layout, padding and dtype rules it needs.

``scaled_mm(a, b)`` computes ``a_hp @ b_hp`` for Float8Tensors ``a`` [M, K] and ``b`` [K, N], where
``x_hp = x._data / x._scale``. It is what ``aten.mm`` on two Float8Tensors runs (tensor.py).

[Note: scaled_mm constraints]
CUDA's kernels want ``a`` row-major and ``b`` column-major, K and N multiples of 16, and (for
per-row scales on some releases) a bfloat16 output. We honour the layout rules on every device, so
a program that runs on the CPU runs on a GPU too:

* K or N not a multiple of 16: raise (``check_gemm_shape``), or with ``pad_inner_dim`` zero-pad
  them and slice the result, which is exact.
* axiswise scales with a float32 output: run the gemm with unit scales in float32 and apply the
  scales to the float32 result. Exact, since a scale only multiplies the whole dot product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from f8dist.tensor import Float8Tensor

__all__ = ["scaled_mm", "check_gemm_shape", "GEMM_ALIGNMENT"]

GEMM_ALIGNMENT = 16


def check_gemm_shape(k: int, n: int, *, what: str, pad_inner_dim: bool) -> None:
    """Raise a clear error if a float8 gemm cannot take a [*, K] x [K, N] problem."""
    if pad_inner_dim:
        return
    bad = [f"{name}={v}" for name, v in (("K", k), ("N", n)) if v % GEMM_ALIGNMENT != 0]
    if bad:
        raise ValueError(
            f"{what}: torch._scaled_mm needs the contraction dim K and the output dim N to be "
            f"multiples of {GEMM_ALIGNMENT}, got {', '.join(bad)}. Make the layer (or its shard, "
            f"or the number of tokens) a multiple of {GEMM_ALIGNMENT}, keep the layer in high "
            f"precision with module_filter_fn, or set Float8LinearConfig(pad_inner_dim=True)."
        )


def rowwise_fp32_output_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` on ``device`` emits float32 with per-row scales (CUDA's
    rowwise kernels emit bfloat16 only; see [Note: scaled_mm constraints])."""
    return device.type != "cuda"


def _round_up(x: int) -> int:
    return (x + GEMM_ALIGNMENT - 1) // GEMM_ALIGNMENT * GEMM_ALIGNMENT


def scaled_mm(a: Float8Tensor, b: Float8Tensor) -> torch.Tensor:
    """The float8 product of ``a`` [M, K] and ``b`` [K, N] in ``a``'s original dtype."""
    cfg = a._mm_config
    out_dtype = a._orig_dtype
    a_data, b_data = a._data, b._data  # [M, K], [K, N]
    a_scale, b_scale = a._scale, b._scale  # [] or [M, 1]; [] or [1, N]
    m, k = a_data.shape
    n = b_data.shape[1]

    if cfg.emulate:
        a_hp = a_data.to(torch.float32) / a_scale
        b_hp = b_data.to(torch.float32) / b_scale
        return torch.mm(a_hp, b_hp).to(out_dtype)

    check_gemm_shape(k, n, what="float8 gemm", pad_inner_dim=cfg.pad_inner_dim)
    pad_k, pad_n = _round_up(k) - k, _round_up(n) - n
    if pad_k or pad_n:
        a_data = F.pad(a_data, (0, pad_k))  # [M, K']
        b_data = F.pad(b_data, (0, pad_n, 0, pad_k))  # [K', N']
        if b_scale.dim() == 2 and pad_n:
            b_scale = F.pad(b_scale, (0, pad_n), value=1.0)  # [1, N']

    a_data = a_data.contiguous()  # row-major
    b_data = b_data.t().contiguous().t()  # column-major
    a_inv = a_scale.reciprocal().to(torch.float32)
    b_inv = b_scale.reciprocal().to(torch.float32)

    axiswise = a_inv.numel() > 1 or b_inv.numel() > 1
    if axiswise and a_inv.dim() == 0:
        a_inv = a_inv.expand(m, 1)
    if axiswise and b_inv.dim() == 0:
        b_inv = b_inv.expand(1, b_data.shape[1])

    if axiswise and out_dtype == torch.float32 and not rowwise_fp32_output_supported(a_data.device):
        one = torch.ones((), dtype=torch.float32, device=a_data.device)
        out = torch._scaled_mm(
            a_data, b_data, scale_a=one, scale_b=one, out_dtype=torch.float32,
            use_fast_accum=cfg.use_fast_accum,
        )  # [M, N']
        out = out * a_inv * b_inv
    else:
        out = torch._scaled_mm(
            a_data,
            b_data,
            scale_a=a_inv.contiguous(),
            scale_b=b_inv.contiguous(),
            out_dtype=out_dtype,
            use_fast_accum=cfg.use_fast_accum,
        )  # [M, N']
    if pad_n:
        out = out[:, :n]
    return out
