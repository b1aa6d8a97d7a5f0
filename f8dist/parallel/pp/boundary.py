"""A float8 pipeline stage boundary: activations cross it in e4m3, their gradients in e5m2, each
with one float32 scale per token.

[Note: the float8 stage boundary]
``torch.distributed.pipelining`` sends a stage's outputs as plain tensors: it allocates the
receiving stage's buffers from their shape and dtype (given to ``PipelineStage`` or inferred),
receives the gradients into buffers shaped like the outputs, and sends only tensors that are
differentiable (an integer output gets no gradient, so nothing would flow back). So the boundary
packs a token's float8 bytes and its scale into the elements of the activation's own dtype, a
tensor autograd differentiates like any other:

    Float8StageOutput (last module of the sending stage)
        x [..., D] (bf16 / fp32)  ->  e4m3 per token  ->  wire [..., (D + 4) / itemsize] (same dtype)
            a token's row: its D e4m3 bytes, then its float32 scale's 4 bytes
    Float8StageInput (first module of the receiving stage)
        wire  ->  e4m3 bytes and scales  ->  x [..., D] dequantized, in the wire's dtype

Backward runs the same pair the other way: the receiving stage casts the gradient of ``x`` to e5m2
per token and packs it into a gradient of the wire's shape, which pipelining sends back and the
sending stage unpacks and dequantizes into the gradient of its activation. The elements of a wire
are bytes, not numbers (some are NaN patterns); only the copies that move them touch them.

Both casts go through ``cast_to_float8`` (power-of-2 scales, as the rowwise recipe's: dividing by
them is exact) and the bytes are laid out as on every f8dist wire ([Note: the wire] in
f8dist/core/tensor.py). A token's scale depends on that token alone, so a pipeline whose micro-batches
cross the boundary computes what one device computes with the same pair of modules between the
same layers, bit for bit. The wire of D features takes D + 4 bytes per token each way, bf16's
2 * D: (D + 4) / (2 * D) of its bytes (0.53 at D = 64).

Give ``PipelineStage`` the wire's shape statically (``input_args`` / ``output_args``, e.g.
``wire_like``): a stage that infers its input's shape runs a forward on an uninitialized buffer,
whose bytes would reach the delayed amax histories ([Note: delayed scaling]) as amaxes.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn as nn

from f8dist.config import E4M3, E5M2, CastSpec, Gemm, Operand, ScalingGranularity
from f8dist.core.cast import cast_to_float8
from f8dist.core.tensor import Float8Tensor, WireMeta

__all__ = ["Float8StageOutput", "Float8StageInput", "wire_like", "ACTIVATION", "GRADIENT"]

SCALE_BYTES = 4  # one float32 scale per token

# per token: one scale over a token's features (its last dim), a power of 2
ACTIVATION = CastSpec(dtype=E4M3, granularity=ScalingGranularity.AXISWISE, axis=-1,
                      round_scales_to_power_of_2=True, fqn="pp.boundary")
GRADIENT = CastSpec(dtype=E5M2, granularity=ScalingGranularity.AXISWISE, axis=-1,
                    round_scales_to_power_of_2=True, gemm=Gemm.GRAD_INPUT,
                    operand=Operand.GRAD_OUTPUT, fqn="pp.boundary")


def _wire_width(x: torch.Tensor) -> int:
    """The wire's last dim for ``x`` [..., D]: (D + 4) bytes per token in ``x``'s elements."""
    dim, size = x.shape[-1], x.element_size()
    if (dim + SCALE_BYTES) % size:
        raise ValueError(
            f"a float8 stage boundary packs a token's {dim} float8 bytes and its {SCALE_BYTES}-byte "
            f"scale into {x.dtype} elements of {size} bytes: the activation's last dim "
            f"(D={dim}) must be a multiple of {size}; pad the model dim"
        )
    return (dim + SCALE_BYTES) // size


def wire_like(x: torch.Tensor) -> torch.Tensor:
    """An empty tensor (on the meta device) shaped like the wire that carries ``x`` [..., D]
    across a boundary: for ``PipelineStage``'s ``input_args`` / ``output_args``.

    Example::

        >>> wire_like(torch.empty(2, 8, 64, dtype=torch.bfloat16)).shape
        torch.Size([2, 8, 34])
    """
    return torch.empty(*x.shape[:-1], _wire_width(x), dtype=x.dtype, device="meta",
                       requires_grad=True)


def _pack(x: torch.Tensor, spec: CastSpec) -> torch.Tensor:
    """``x`` [..., D] cast per token with ``spec`` -> its wire [..., (D + 4) / itemsize]."""
    width = _wire_width(x)
    fp8 = cast_to_float8(x.reshape(-1, x.shape[-1]), spec)  # [T, D] e4m3 / e5m2, scales [T, 1]
    data, scale = fp8.to_wire(0)[0]  # [T, D], [T, 4] uint8
    wire = x.new_empty(*x.shape[:-1], width)  # [..., (D + 4) / itemsize]: not a view of the bytes
    torch.cat([data, scale], dim=-1, out=wire.view(torch.uint8).view(data.shape[0], -1))  # [T, D + 4]
    return wire


def _unpack(wire: torch.Tensor, spec: CastSpec) -> torch.Tensor:
    """The wire [..., W] of :func:`_pack` -> the dequantized [..., W * itemsize - 4], in its dtype."""
    rows = wire.reshape(-1, wire.shape[-1]).view(torch.uint8)  # [T, D + 4]
    dim = rows.shape[-1] - SCALE_BYTES
    data, scale = rows[:, :dim].contiguous(), rows[:, dim:].contiguous()  # [T, D], [T, 4]
    meta = WireMeta(spec.dtype, torch.float32, None, wire.dtype, (1, None), spec.mm_config)
    x = Float8Tensor.from_wire(meta, (data, scale)).to_original_precision()  # [T, D]
    return x.view(*wire.shape[:-1], dim)


class _Crossing(torch.autograd.Function):
    """``there(t)`` in forward, ``back(grad)`` in backward: a half of the boundary."""

    @staticmethod
    def forward(ctx, t, there: Callable, back: Callable):
        ctx.back = back
        return there(t)

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad.contiguous()), None, None


class Float8StageOutput(nn.Module):
    """The last module of a pipeline stage that sends its activation [..., D] to the next one:
    returns the activation's wire, its e4m3 bytes and per-token scales packed in the activation's
    dtype ([Note: the float8 stage boundary]); backward unpacks the e5m2 gradient that comes back.

    Example::

        >>> x = torch.randn(2, 8, 64, requires_grad=True)
        >>> out = Float8StageInput()(Float8StageOutput()(x))  # what two stages compute
        >>> out.shape, Float8StageOutput()(x).shape
        (torch.Size([2, 8, 64]), torch.Size([2, 8, 17]))
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Crossing.apply(x.contiguous(), partial(_pack, spec=ACTIVATION),
                               partial(_unpack, spec=GRADIENT))


class Float8StageInput(nn.Module):
    """The first module of a pipeline stage that receives a :class:`Float8StageOutput`'s wire:
    returns the dequantized activation; backward casts its gradient to e5m2 per token and packs
    it for the way back ([Note: the float8 stage boundary])."""

    def forward(self, wire: torch.Tensor) -> torch.Tensor:
        return _Crossing.apply(wire, partial(_unpack, spec=ACTIVATION), partial(_pack, spec=GRADIENT))
