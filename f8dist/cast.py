"""The one place a high-precision tensor becomes a Float8Tensor.

Every cast is described by a :class:`CastSite` (which module, which gemm, which operand), so a cast
can be inspected before and after quantization (``f8dist.debug``) and its scale looked up in the
module's delayed-scaling state (``f8dist.delayed``).

``cast_to_float8`` handles plain tensors and DTensors alike. For a DTensor, the amax is the plain
torch reduction; its Partial(max) placements are turned Replicate, which all-reduces over exactly
the mesh axes that shard the reduced dims (``[Note: amax]`` in DESIGN.md). The result is a DTensor
whose local tensor is a Float8Tensor holding the local shard and its scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from f8dist.config import ScalingGranularity
from f8dist.scaling import amax_to_scale, saturated_cast, tensor_amax
from f8dist.tensor import Float8Tensor, ScaledMMConfig

__all__ = [
    "CastSite", "cast_to_float8", "ToFloat8", "reduced_amax", "cast_observers", "is_dtensor",
    "local_part", "like",
]


@dataclass(frozen=True)
class CastSite:
    """Where a cast happens: module FQN, gemm ("output", "grad_input", "grad_weight") and operand
    ("input", "weight", "grad_output")."""

    fqn: str
    gemm: str
    operand: str

    def __str__(self):
        return f"{self.fqn or '<root>'}:{self.gemm}:{self.operand}"


# Callbacks ``fn(site, hp, fp8)`` run after every cast while non-empty (f8dist.debug fills it).
# Empty by default: the check is a Python-level branch, so it adds no op to a traced graph.
cast_observers: List[Callable[[CastSite, torch.Tensor, torch.Tensor], None]] = []


def is_dtensor(x) -> bool:
    """Whether ``x`` is a DTensor (checked by name: the core imports no torch.distributed)."""
    return type(x).__name__ == "DTensor" and hasattr(x, "placements")


def local_part(x: torch.Tensor) -> torch.Tensor:
    """This rank's tensor: ``x.to_local()`` for a DTensor, ``x`` itself otherwise."""
    return x.to_local() if is_dtensor(x) else x


def like(template: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as this rank's part of a DTensor laid out like ``template`` (same mesh,
    placements, global shape and stride); ``local`` itself when ``template`` is no DTensor."""
    if not is_dtensor(template):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, template.device_mesh, template.placements, run_check=False,
        shape=template.shape, stride=template.stride(),
    )


def reduced_amax(x: torch.Tensor, dim=None) -> torch.Tensor:
    """amax of the logical tensor. For a DTensor, Partial placements are reduced (all-reduce over
    the axes sharding the reduced dims); Shard placements of kept dims stay sharded."""
    amax = tensor_amax(x, dim)
    if is_dtensor(amax):
        from torch.distributed.tensor import Replicate

        placements = [Replicate() if p.is_partial() else p for p in amax.placements]
        amax = amax.redistribute(amax.device_mesh, placements)
    return amax


def cast_to_float8(
    hp: torch.Tensor,
    float8_dtype: torch.dtype,
    *,
    granularity: ScalingGranularity = ScalingGranularity.TENSORWISE,
    axiswise_dim: int = -1,
    round_scales_to_power_of_2: bool = False,
    mm_config: ScaledMMConfig = ScaledMMConfig(),
    scale: Optional[torch.Tensor] = None,
    site: Optional[CastSite] = None,
) -> torch.Tensor:
    """Cast ``hp`` to a Float8Tensor (a DTensor of them if ``hp`` is a DTensor).

    ``scale`` given: use it (delayed scaling, precomputed FSDP scales); else compute it from the
    amax of ``hp``: of the whole tensor (tensorwise) or over ``axiswise_dim`` (axiswise). Not
    differentiable: see :class:`ToFloat8` for that.
    """
    axis = None
    if granularity is ScalingGranularity.AXISWISE:
        axis = axiswise_dim % hp.dim()
    if scale is None:
        amax = reduced_amax(hp, axis)  # [] or hp.shape with 1 at axis
        scale = amax_to_scale(amax, float8_dtype, round_to_power_of_2=round_scales_to_power_of_2)
    elif axis is not None:
        raise ValueError("a given scale is tensorwise; axiswise casts compute their own scales")

    scale_local = local_part(scale)  # [] or the local shard's [..., 1, ...]
    data = saturated_cast(local_part(hp), scale_local, float8_dtype)
    out = like(hp, Float8Tensor(data, scale_local, hp.dtype, axis, mm_config))

    if cast_observers and site is not None:
        for observer in cast_observers:
            observer(site, hp, out)
    return out


class ToFloat8(torch.autograd.Function):
    """Differentiable cast: forward casts to float8, backward passes the gradient through in high
    precision (the cast is an identity up to rounding). Used where a float8 tensor must cross a
    module boundary, e.g. a sequence-parallel input cast before its all-gather."""

    @staticmethod
    def forward(ctx, hp: torch.Tensor, float8_dtype: torch.dtype, kwargs: dict):
        return cast_to_float8(hp, float8_dtype, **kwargs)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None
