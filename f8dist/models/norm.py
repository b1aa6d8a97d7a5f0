"""RMSNorm that keeps for backward what a fused kernel keeps: its input and one float32 rstd
per row.

[Note: RMSNorm's saved tensors]
``nn.RMSNorm`` computes in float32 (``x.float() * rsqrt(mean(x**2) + eps) * w``, rounded to the
input's dtype). On CUDA torch runs it as one fused kernel that keeps the input
and ``rstd`` for backward; on the CPU it is composite, and autograd keeps the float32 upcast of
the input twice more, 8 bytes per element of a bf16 input beside its 2: in a LLaMA block the two
norms kept more than the attention. :class:`RMSNorm` is ``nn.RMSNorm`` (same parameters, same
state dict, same output bit for bit) whose backward recomputes the float32 copy from the kept
input, on every device, so memory reports measure what a fused kernel keeps:

    kept: x (its dtype) [..., D], rstd (float32) [..., 1]
    n  = x.float() * rstd                            # the forward's, recomputed
    dw = sum over rows of grad * n                   # in float32
    dn = grad * w                                    # in float32
    dx = rstd * dn - x.float() * rstd**3 * mean(dn * x.float())

Gradients are autograd's up to the order of float32 sums (tested against float64). A DTensor
input (sequence parallel: sharded along the sequence, whole rows on each rank) runs the same ops
on its local rows; the weight's gradient is then Partial over those rows, as with ``nn.RMSNorm``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["RMSNorm"]


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float):
        xf = x.float()  # [..., D]
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * weight.float()).type_as(x)  # [..., D]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xf = x.float()  # [..., D]
        g = grad.float()  # [..., D]
        grad_weight = None
        if ctx.needs_input_grad[1]:
            n = xf * rstd  # [..., D]
            grad_weight = (g * n).reshape(-1, n.shape[-1]).sum(0).type_as(weight)  # [D]
        dn = g * weight.float()  # [..., D]
        dot = (dn * xf).mean(-1, keepdim=True)  # [..., 1]
        grad_x = rstd * dn - xf * rstd.pow(3) * dot  # [..., D]
        return grad_x.type_as(x), grad_weight, None


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` over the last dimension, keeping only its input and float32 ``rstd`` for
    backward ([Note: RMSNorm's saved tensors]). Other shapes, no affine weight, or no gradient:
    ``nn.RMSNorm`` itself.

    Example::

        >>> norm = RMSNorm(64, eps=1e-5)
        >>> x = torch.randn(2, 8, 64)
        >>> torch.equal(norm(x), nn.RMSNorm(64, eps=1e-5)(x))
        True
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.weight is None
            or len(self.normalized_shape) != 1
            or not torch.is_grad_enabled()
        ):
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        weight = self.weight
        if weight.dtype != x.dtype:  # nn.RMSNorm multiplies in the promoted dtype
            return super().forward(x)
        return _RMSNorm.apply(x, weight, eps)
