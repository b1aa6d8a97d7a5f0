"""SwiGLU, ``silu(gate) * up``, whose inputs are kept for backward in float8.

[Note: SwiGLU's saved tensors]
Autograd's ``F.silu(gate) * up`` keeps three [tokens, hidden] tensors for backward (``gate``,
``silu(gate)``, ``up``). When the FFN's output projection is a Float8Linear with
``float8_activations_for_backward``, :func:`swiglu` keeps ``gate`` and ``up`` only, cast to
float8 as that linear's ``specs.activation`` says (e4m3, a scale per hidden channel). Backward
dequantizes them and computes what autograd computes (``d_up = grad * silu(gate)``,
``d_gate = silu_backward(grad * up, gate)``), so its gradients are autograd's on the float8
values, bit for bit: one e4m3 rounding inside the w1 and w3 gradients (docs/performance.md,
Memory). Per-channel scales need no collective under TP (each rank holds whole channels).

[Note: a product recomputed in backward]
w2 keeps its own float8 copy of the product for its grad_weight gemm. With
``recompute_swiglu_product`` in w2's config, :func:`swiglu_for` hands w2 the float8 ``gate`` and
``up`` that SwiGLU keeps anyway: w2 keeps nothing of its input and backward recomputes it as
``silu(gate8) * up8`` (:func:`float8_product`). Only w2's weight gradient changes: it is that of
the float8 values' product (one more e4m3 rounding), hence an option.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from f8dist.core.cast import cast_to_float8, high_precision
from f8dist.nn.linear import Float8Linear

__all__ = ["swiglu", "swiglu_for", "float8_product"]


class _Float8SavedSwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` for [M, H] inputs, keeping their float8 casts ``gate8`` and ``up8``
    for backward."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, gate8: torch.Tensor, up8: torch.Tensor):
        ctx.save_for_backward(gate8, up8)
        return F.silu(gate) * up  # [M, H]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate8, up8 = ctx.saved_tensors
        gate, up = high_precision(gate8), high_precision(up8)  # [M, H], their dtype
        d_up = grad * F.silu(gate)  # [M, H]
        d_gate = torch.ops.aten.silu_backward(grad * up, gate)  # [M, H]
        return d_gate, d_up, None, None


def float8_product(gate8: torch.Tensor, up8: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the values float8 ``gate8`` and ``up8`` [M, H] stand for, in their
    dtype: w2's input recomputed in backward ([Note: a product recomputed in backward])."""
    return F.silu(high_precision(gate8)) * high_precision(up8)  # [M, H]


def _float8_inputs(gate, up, out_proj):
    """(gate8, up8) [M, H] when SwiGLU keeps its inputs in float8 for ``out_proj``, else None."""
    spec = out_proj.specs.activation if isinstance(out_proj, Float8Linear) else None
    if spec is None or not torch.is_grad_enabled() or not (gate.requires_grad or up.requires_grad):
        return None
    hidden = gate.shape[-1]
    with torch.no_grad():  # kept for backward, not differentiated
        return tuple(cast_to_float8(t.reshape(-1, hidden), spec) for t in (gate, up))


def _product(gate, up, kept):
    if kept is None:
        return F.silu(gate) * up
    hidden = gate.shape[-1]
    out = _Float8SavedSwiGLU.apply(gate.reshape(-1, hidden), up.reshape(-1, hidden), *kept)
    return out.reshape(gate.shape)  # [..., H]


def swiglu(gate: torch.Tensor, up: torch.Tensor, out_proj: Optional[torch.nn.Module] = None
           ) -> torch.Tensor:
    """``silu(gate) * up``, inputs ``[..., H]`` of any leading shape. ``out_proj``: the layer that
    reads the product; when it is a Float8Linear with ``float8_activations_for_backward``,
    ``gate`` and ``up`` are kept for backward in float8 ([Note: SwiGLU's saved tensors]).

    Example::

        >>> w2 = Float8Linear.from_float(nn.Linear(32, 16), Float8LinearConfig(
        ...     float8_activations_for_backward=True), fqn="ffn.w2")
        >>> swiglu(torch.randn(4, 8, 32), torch.randn(4, 8, 32), out_proj=w2).shape
        torch.Size([4, 8, 32])
    """
    return _product(gate, up, _float8_inputs(gate, up, out_proj))


def swiglu_for(gate: torch.Tensor, up: torch.Tensor, out_proj: torch.nn.Module
               ) -> Tuple[torch.Tensor, Dict[str, object]]:
    """:func:`swiglu` for ``out_proj``, and the keyword arguments to call ``out_proj`` with:
    ``{"recompute": ...}`` when its config has ``recompute_swiglu_product`` ([Note: a product
    recomputed in backward]), else ``{}``. Two steps, so that ``gate`` and ``up`` are freed
    before ``out_proj`` runs.

    Example::

        >>> w2 = Float8Linear.from_float(nn.Linear(32, 16), Float8LinearConfig(
        ...     float8_activations_for_backward=True, recompute_swiglu_product=True), fqn="ffn.w2")
        >>> product, kwargs = swiglu_for(torch.randn(4, 8, 32), torch.randn(4, 8, 32), w2)
        >>> w2(product, **kwargs).shape
        torch.Size([4, 8, 16])
    """
    kept = _float8_inputs(gate, up, out_proj)
    product = _product(gate, up, kept)
    if kept is None or not out_proj.config.recompute_swiglu_product:
        return product, {}
    return product, {"recompute": (float8_product, kept)}
