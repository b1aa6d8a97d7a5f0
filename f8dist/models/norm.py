"""RMSNorm that keeps for backward what a fused kernel keeps: its input and one float32 rstd
per row.

[Note: RMSNorm's saved tensors]
On the CPU ``nn.RMSNorm`` is composite and autograd keeps float32 copies of the input; CUDA's
fused kernel keeps only the input and ``rstd``. :class:`RMSNorm` is ``nn.RMSNorm`` (bit for bit)
whose backward recomputes the float32 copy, on every device, so memory reports measure what a
fused kernel keeps. Gradients are autograd's up to the order of float32 sums.

[Note: a norm output recomputed in backward]
The norm keeps its input and ``rstd`` anyway, and from them its output is one pointwise pass,
bit for bit the forward's: :meth:`RMSNorm.normalize` returns ``(fn, tensors)`` giving it again,
and a Float8Linear with ``recompute_norm_output`` takes them as its ``recompute`` instead of
keeping its input. Not for a DTensor input (the linear reads the rows all-gathered), nor for a
norm with hooks, which ``normalize`` would bypass.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn

from f8dist.core.placement import is_dtensor

__all__ = ["RMSNorm"]

Recompute = Optional[Tuple[Callable[..., torch.Tensor], Tuple[torch.Tensor, ...]]]


def _normalized(x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The norm's output from its input [..., D], rstd [..., 1] and weight [D]."""
    return (x.float() * rstd * weight.float()).type_as(x)  # [..., D]


def _normalized_again(x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`_normalized`, bit for bit, written ``rstd * x`` so that AOTAutograd's CSE does not
    merge it with the forward's output (its partitioner would then save that output again)."""
    return (rstd * x.float() * weight.float()).type_as(x)  # [..., D]


class _RMSNorm(torch.autograd.Function):
    """(output, rstd); rstd is not differentiable, the tensor that backward keeps."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float):
        xf = x.float()  # [..., D]
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
        ctx.save_for_backward(x, weight, rstd)
        ctx.mark_non_differentiable(rstd)
        ctx.set_materialize_grads(False)  # no zeros for rstd's gradient in backward
        return _normalized(x, rstd, weight), rstd  # [..., D], [..., 1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _grad_rstd=None):
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
        return self.normalize(x)[0]

    def normalize(self, x: torch.Tensor) -> Tuple[torch.Tensor, Recompute]:
        """The output, and ``(fn, tensors)`` with ``fn(*tensors)`` the output again from what
        backward keeps anyway, for its readers to recompute it ([Note: a norm output recomputed
        in backward]); None where nothing is kept (no grad) or for a DTensor ``x``."""
        if (
            self.weight is None
            or len(self.normalized_shape) != 1
            or not torch.is_grad_enabled()
        ):
            return super().forward(x), None
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        weight = self.weight
        if weight.dtype != x.dtype:  # nn.RMSNorm multiplies in the promoted dtype
            return super().forward(x), None
        out, rstd = _RMSNorm.apply(x, weight, eps)  # [..., D], [..., 1]
        return out, (None if is_dtensor(x) else (_normalized_again, (x, rstd, weight)))
