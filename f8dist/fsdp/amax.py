"""The amax of an FSDP2-sharded weight, reduced over every mesh axis that shards it.

[Note: sharded weight amax]
``[Note: amax]`` in DESIGN.md: the amax of a weight is a reduction over the logical (whole) weight.
A rank holds one shard, described by the weight's sharded DTensor parameter: its ``device_mesh``
and ``placements`` say which mesh axes shard it (dp under FSDP2; dp and tp under 2-D FSDP x TP).
The local amax is the plain ``tensor_amax`` of the shard, placed as ``Partial("max")`` on exactly
those axes and ``Replicate`` elsewhere; redistributing to ``Replicate`` is the all-reduce.

The local amax is ``tensor_amax`` of the local shard rather than of the DTensor because an
unevenly sharded weight can leave a rank with an empty shard: ``tensor_amax`` gives it 0 (the
identity of ``max`` over magnitudes), while DTensor's local ``max`` would raise.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

__all__ = ["reduce_amax_over_shards"]


def reduce_amax_over_shards(amax: torch.Tensor, mesh, placements: Sequence) -> torch.Tensor:
    """All-reduce (max) ``amax`` over the mesh axes whose placement shards the tensor
    (``placements`` of a parameter: Shard-like or Replicate).

    ``amax`` may hold several amaxes (one per weight, stacked): they travel in one collective per
    sharding mesh axis, or in ONE collective when every axis of a mesh spanning all ranks shards
    the tensor (2-D FSDP x TP weights). Returns a plain tensor, the same on every rank.
    """
    # Shard and _StridedShard (what FSDP2 puts on dp over a TP-sharded dim) both shard
    partial = [Replicate() if p.is_replicate() else Partial("max") for p in placements]
    n_partial = sum(p.is_partial() for p in partial)
    if n_partial == 0:
        return amax
    if n_partial > 1 and n_partial == mesh.ndim and mesh.size() == dist.get_world_size():
        # max over every mesh axis = max over all ranks: one all-reduce instead of one per axis
        amax = amax.clone()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        return amax
    reduced = DTensor.from_local(amax, mesh, partial, run_check=False)
    return reduced.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
