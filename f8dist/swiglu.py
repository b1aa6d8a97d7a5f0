"""SwiGLU, ``silu(gate) * up``, whose inputs are kept for backward in float8.

[Note: SwiGLU's saved tensors]
Autograd's ``F.silu(gate) * up`` keeps three [tokens, hidden] tensors for backward: ``gate``
(silu's input), ``silu(gate)`` and ``up`` (the product's inputs), 6 bytes per hidden element in
bf16, half of a LLaMA FFN's activation memory. When the FFN's output projection is a
Float8Linear whose config has ``float8_activations_for_backward``, :func:`swiglu` keeps ``gate``
and ``up`` only, each cast to float8 as that linear's ``specs.activation`` says
(``Float8LinearConfig.activation_spec``: e4m3, one scale per hidden channel from the amax over
the tokens), 2 bytes per hidden element. Backward dequantizes them (to their dtype) and computes
what autograd computes for ``F.silu(gate) * up``:

    d_up   = grad * silu(gate)
    d_gate = silu_backward(grad * up, gate)   # grad * up * s * (1 + gate * (1 - s)), s = sigmoid

so its gradients are autograd's on the dequantized values, bit for bit, and its temporaries
those of autograd's backward. They are the gradients of the float8 values, not of the bf16
ones: an e4m3 rounding (about 30 dB) of ``gate`` and ``up`` inside the gradients of the w1 and
w3 gemms, whose float8 recipes then cast those gradients again (e5m2 or e4m3: 25-30 dB).
scripts/memory_report.py measures what it costs (gradient SQNR against fp32, with and without
it: 0.3-0.7 dB on the worst weight gradient, 0.6-0.9 dB on the input's; docs/performance.md).

Scales per channel (amax over dim 0 of ``[tokens, hidden]``) need no collective under tensor
parallelism: w1 and w3 are column-parallel, so each rank holds whole channels of every token,
and its scales are one device's. Otherwise (and without grad) :func:`swiglu` is
``F.silu(gate) * up``. Telemetry (``f8dist.debug``) records the casts of linears only; these two
are not in its tables.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from f8dist.cast import cast_to_float8, high_precision
from f8dist.config import CastSpec
from f8dist.linear import Float8Linear

__all__ = ["swiglu"]


class _Float8SavedSwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` for [M, H] inputs, keeping float8 ``gate`` and ``up`` for backward."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, spec: CastSpec):
        ctx.save_for_backward(cast_to_float8(gate, spec), cast_to_float8(up, spec))
        return F.silu(gate) * up  # [M, H]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate8, up8 = ctx.saved_tensors
        gate, up = high_precision(gate8), high_precision(up8)  # [M, H], their dtype
        d_up = grad * F.silu(gate)  # [M, H]
        d_gate = torch.ops.aten.silu_backward(grad * up, gate)  # [M, H]
        return d_gate, d_up, None


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
    spec = out_proj.specs.activation if isinstance(out_proj, Float8Linear) else None
    if spec is None or not torch.is_grad_enabled() or not (gate.requires_grad or up.requires_grad):
        return F.silu(gate) * up
    hidden = gate.shape[-1]
    out = _Float8SavedSwiGLU.apply(gate.reshape(-1, hidden), up.reshape(-1, hidden), spec)
    return out.reshape(gate.shape)  # [..., H]
