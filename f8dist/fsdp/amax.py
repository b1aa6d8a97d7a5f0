"""The amax of an FSDP2-sharded weight, reduced over every mesh axis that shards it.

[Note: sharded weight amax]
``[Note: amax]`` in DESIGN.md: the amax of a weight is a reduction over the logical (whole) weight.
A rank holds one shard, described by the weight's sharded DTensor parameter: its ``device_mesh``
and ``placements`` say which mesh axes shard it (dp under FSDP2; dp and tp under 2-D FSDP x TP).
The local amax is the plain ``tensor_amax`` of the shard, placed as ``Partial("max")`` on exactly
those axes and ``Replicate`` elsewhere; redistributing to ``Replicate`` is the all-reduce.

The local amax is computed here rather than by running ``tensor_amax`` on the DTensor because an
unevenly sharded weight can leave a rank with an empty shard, whose ``max`` has no value: its
amax is 0 (the identity of ``max`` over magnitudes).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from f8dist.scaling import tensor_amax

__all__ = ["local_amax", "reduce_amax_over_shards"]


def local_amax(shard: torch.Tensor) -> torch.Tensor:
    """max(|shard|) in float32; 0 for an empty shard."""
    if shard.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=shard.device)
    return tensor_amax(shard)


def reduce_amax_over_shards(amax: torch.Tensor, mesh, placements: Sequence) -> torch.Tensor:
    """All-reduce (max) ``amax`` over the mesh axes whose placement shards the tensor
    (``placements`` of a parameter: Shard-like or Replicate).

    ``amax`` may hold several amaxes (one per weight, stacked): they travel in one collective per
    sharding mesh axis. Returns a plain tensor, the same on every rank.
    """
    # Shard and _StridedShard (what FSDP2 puts on dp over a TP-sharded dim) both shard
    partial = [Replicate() if p.is_replicate() else Partial("max") for p in placements]
    if not any(p.is_partial() for p in partial):
        return amax
    reduced = DTensor.from_local(amax, mesh, partial, run_check=False)
    return reduced.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
