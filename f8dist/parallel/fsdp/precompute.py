"""``precompute_float8_dynamic_scale_for_fsdp``: the scales of every float8 all-gather weight with
one all-reduce, after the optimizer step, so the next forward's all-gathers need none."""

from __future__ import annotations

import torch
import torch.nn as nn

from f8dist.core import agreement
from f8dist.config import Gemm, Operand, ScalingType
from f8dist.core.weight import Float8AllGatherWeight
from f8dist.core.placement import is_dtensor, local_part, reduce_over_shards
from f8dist.core.scaling import amax_to_scale, tensor_amax

__all__ = ["precompute_float8_dynamic_scale_for_fsdp"]


@torch.no_grad()
def precompute_float8_dynamic_scale_for_fsdp(model: nn.Module) -> None:
    """Compute the float8 scale of every dynamically scaled float8 all-gather weight in ``model``
    (FSDP2-sharded) in one all-reduce of their stacked amaxes, and store each on its weight.

    Call it after ``optimizer.step()``. A stored scale serves the weight's all-gathers while the
    weight is unchanged: one updated after the call is re-scaled, never cast with a stale scale.

    Example::

        >>> optimizer.step()                                   # doctest: +SKIP
        >>> precompute_float8_dynamic_scale_for_fsdp(model)    # one all-reduce
        >>> model(x)                                           # no amax all-reduce
    """
    agreement.check_once(model)  # before this all-reduce if there was no forward yet
    # weights sharded over the same mesh axes share their all-reduce, whatever their placements
    groups = {}  # (mesh, sharded axes) -> (placements, [(module, local weight)])
    for module in model.modules():
        weight = getattr(module, "weight", None)
        local = local_part(weight)
        if not isinstance(local, Float8AllGatherWeight):
            continue
        spec = module.specs[Gemm.OUTPUT, Operand.WEIGHT]
        if spec.scaling_type is not ScalingType.DYNAMIC:
            continue
        if not is_dtensor(weight):
            raise ValueError(
                f"precompute_float8_dynamic_scale_for_fsdp: {module.fqn or type(module).__name__}'s "
                "weight is not sharded; call it on a model after fully_shard"
            )
        local = weight._local_tensor  # the object FSDP2 calls the all-gather hooks on
        key = (weight.device_mesh, tuple(not p.is_replicate() for p in weight.placements))
        groups.setdefault(key, (weight.placements, []))[1].append((spec, local))

    for (mesh, _), (placements, members) in groups.items():
        amaxes = torch.stack([tensor_amax(w._tensor) for _, w in members])  # [n]
        amaxes = reduce_over_shards(amaxes, mesh, placements, "max")  # [n]
        for (spec, w), amax in zip(members, amaxes):
            scale = amax_to_scale(
                amax, spec.dtype, round_to_power_of_2=spec.round_scales_to_power_of_2
            )
            w._precomputed = (scale, w._tensor._version)
