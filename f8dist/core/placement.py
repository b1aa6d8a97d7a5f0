"""The one distributed rule of f8dist: a statistic of a tensor is the statistic of the logical tensor.

[Note: amax]
An amax is a reduction over the *logical* (global) tensor, never over one rank's piece of it: the
plain reduction of what the rank holds, all-reduced (max) over exactly the mesh axes whose
placement shards the tensor, and over no other axis:

    replicated tensor (a TP-replicated activation)       no collective
    FSDP2 weight (Shard(0) over dp)                       all-reduce over dp
    TP weight or sequence-sharded activation               all-reduce over tp
    2-D FSDP x TP weight                                  one all-reduce over dp and tp
    HSDP x TP weight (replicated over dp_replicate)       one all-reduce over dp_shard and tp
    expert weight [E, N, K], one amax per expert          over the axes sharding dims 1, 2 only
      (FSDP2 on dim 1 under EP x FSDP2: dp_shard; EP or FSDP2 on dim 0: none)

Then every rank casts its shard as one device would: :func:`reduce_partial` for a DTensor
reduction (already ``Partial(max)``), :func:`reduce_over_shards` for a local one (an empty shard's
amax is 0). Activations are not sharded by data parallelism: each rank scales its own micro-batch.
Nothing else in f8dist inspects placements to decide a reduction.

[Note: tokens of sharded experts]
Under expert parallelism an expert layer's tokens are sharded over exactly the axes that shard
its weights' dim 0, so their statistics are reduced over those (:func:`expert_token_placements`).

[Note: shards on block boundaries]
A block scale ([Note: block scales] in f8dist/config/cells.py) is a statistic of its block alone, so it
needs no collective provided no shard splits a block. torch shards a dim of size ``n`` over ``k``
ranks in chunks of ``ceil(n / k)``, so every shard starts on a block boundary iff that chunk is a
multiple of the block; a dim two mesh axes shard is cut in two steps, each keeping whole blocks.

[Note: global positions]
What depends on an element's place (stochastic rounding's draw, [Note: stochastic rounding] in
f8dist/core/scaling.py) is keyed on its flat index in the logical tensor, so that a shard computes
what one device computes for those elements: :func:`global_positions` reads the shard's offsets
from its placements and mesh coordinate as torch does (``compute_local_shape_and_global_offset``:
uneven chunks, several axes sharding one dim). Shard and Replicate placements only: a
``_StridedShard``'s rows are no contiguous range, and a ``Partial`` tensor has no values yet.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

__all__ = [
    "is_dtensor",
    "local_part",
    "like",
    "has_partial",
    "reduce_partial",
    "reduce_over_shards",
    "all_reduce",
    "all_gather",
    "blocks_split_by_shards",
    "global_positions",
    "shard_index",
    "expert_token_placements",
]


def is_dtensor(x) -> bool:
    """Whether ``x`` is a DTensor (checked by name, so that the core imports no torch.distributed)."""
    return type(x).__name__ == "DTensor" and hasattr(x, "placements")


def local_part(x: torch.Tensor) -> torch.Tensor:
    """This rank's tensor: ``x.to_local()`` for a DTensor, ``x`` itself otherwise."""
    return x.to_local() if is_dtensor(x) else x


def like(template: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as this rank's part of a DTensor laid out like ``template`` (if one)."""
    return with_layout(layout(template), local)


def layout(t: torch.Tensor) -> Optional[tuple]:
    """(mesh, placements, global shape, stride) of a DTensor, None for a plain tensor."""
    if not is_dtensor(t):
        return None
    return t.device_mesh, t.placements, t.shape, t.stride()


def with_layout(layout: Optional[tuple], local: torch.Tensor) -> torch.Tensor:
    """``local`` as this rank's part of a DTensor of ``layout`` (:func:`layout`); itself for None."""
    if layout is None:
        return local
    from torch.distributed.tensor import DTensor

    mesh, placements, shape, stride = layout
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def has_partial(placements: Sequence) -> bool:
    """Whether any placement is a pending reduction (``Partial``)."""
    return any(p is not None and p.is_partial() for p in placements)


def reduce_partial(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its ``Partial`` placements made ``Replicate`` (an all-reduce over them; ONE
    over all of them for a max, as :func:`reduce_over_shards`)."""
    if not is_dtensor(x) or not has_partial(x.placements):
        return x
    from torch.distributed.tensor import DTensor, Replicate

    placements = [Replicate() if p.is_partial() else p for p in x.placements]
    partial = [p for p in x.placements if p.is_partial()]
    if len(partial) > 1 and all(p.reduce_op == "max" for p in partial):
        # [Note: amax]: one collective, not one per axis (a max is exact in any order; a sum
        # keeps DTensor's per-axis order, which its numbers depend on)
        pending = [p if p.is_partial() else Replicate() for p in x.placements]
        local = reduce_over_shards(x.to_local(), x.device_mesh, pending, "max")
        return DTensor.from_local(local, x.device_mesh, placements, run_check=False,
                                  shape=x.shape, stride=x.stride())
    return x.redistribute(x.device_mesh, placements)


def reduce_over_shards(local: torch.Tensor, mesh, placements: Sequence, op: str) -> torch.Tensor:
    """Reduce (``op``: "max" or "sum") a value computed on this rank's shard over the mesh axes
    whose placement shards the tensor; a plain tensor, the same on every rank of the mesh.

    ``local`` may stack the values of several tensors sharded alike. A tensor sharded over
    several axes takes ONE collective over all of them, not one per axis.
    """
    sharded = [not p.is_replicate() for p in placements]
    if not any(sharded):
        return local
    if all(sharded):
        return all_reduce(local, op, _whole_mesh_group(mesh))
    names = mesh.mesh_dim_names
    if names is not None and sum(sharded) > 1:  # e.g. HSDP x TP: dp_shard and tp, not dp_replicate
        axes = mesh[tuple(n for n, s in zip(names, sharded) if s)]
        return all_reduce(local, op, _whole_mesh_group(axes))
    from torch.distributed.tensor import DTensor, Partial, Replicate

    pending = [Partial(op) if s else Replicate() for s in sharded]
    reduced = DTensor.from_local(local, mesh, pending, run_check=False)
    return reduced.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()


def all_reduce(t: torch.Tensor, op: str, group=None) -> torch.Tensor:
    """Functional all-reduce (``op``: "max" or "sum") of ``t`` over ``group`` (a process group or a
    device mesh; None: every rank); ``t`` itself without a process group."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    if not (dist.is_available() and dist.is_initialized()):
        return t
    if getattr(group, "ndim", 1) > 1:  # a multi-dimensional device mesh
        group = _whole_mesh_group(group)
    return funcol.wait_tensor(funcol.all_reduce(t, op, group if group is not None else dist.group.WORLD))


def all_gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Functional all-gather of ``t`` along ``dim`` over ``group`` (a process group or a 1-D
    device mesh); ``t`` itself without a process group."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    if not (dist.is_available() and dist.is_initialized()):
        return t
    return funcol.wait_tensor(funcol.all_gather_single(t.contiguous(), dim, group))


def _whole_mesh_group(mesh) -> Optional[object]:
    """A group spanning every rank of ``mesh`` (None: the world)."""
    import torch.distributed as dist

    if mesh.ndim == 1:
        return mesh
    if mesh.size() == dist.get_world_size():
        return None
    return mesh._flatten()


def expert_token_placements(placements: Sequence) -> list:
    """The placements of an expert layer's tokens, given its 3-D weights' ([Note: tokens of
    sharded experts])."""
    from torch.distributed.tensor import Replicate

    return [p if p.is_shard(0) else Replicate() for p in placements]


def blocks_split_by_shards(shape: Sequence[int], block: Sequence[int], mesh_sizes: Sequence[int],
                           placements: Sequence) -> Optional[str]:
    """Why shards of a tensor of ``shape`` laid out as ``placements`` over mesh dims of
    ``mesh_sizes`` ranks split its blocks of ``block`` ([Note: shards on block boundaries]); None
    when none does. An N-D ``shape`` with a 2-D ``block`` is in row blocks ([Note: row blocks of
    N-D activations] in f8dist/config/specs.py) or token blocks, which its sequences must hold whole
    ([Note: token blocks of N-D activations])."""
    if len(shape) > len(block) == 2 and block[1] == 1 < block[0]:
        sequences, tokens = math.prod(shape[:-2]), shape[-2]
        if sequences > 1 and tokens % block[0]:
            return (f"its {sequences} sequences of {tokens} tokens split the {block[0]}-token "
                    f"blocks of its [{sequences * tokens}, {shape[-1]}] view")
    block = (1,) * (len(shape) - len(block)) + tuple(block)
    ranks_per_dim = {}  # dim -> the mesh sizes sharding it, outermost first
    for size, p in sorted(zip(mesh_sizes, placements), key=lambda sp: _is_strided(sp[1])):
        if p.is_replicate():
            continue
        if not (p.is_shard() or _is_strided(p)):
            return f"placement {p} (only Shard and Replicate placements keep blocks whole)"
        ranks_per_dim.setdefault(p.dim % len(shape), []).append(size)
    for dim, sizes in ranks_per_dim.items():
        chunk = shape[dim]
        for size in sizes:
            chunk = -(-chunk // size)  # rows (or columns) per rank
            if chunk % block[dim]:
                ranks = "x".join(map(str, sizes))
                return (f"{ranks} ranks shard dim {dim} of this {list(shape)} tensor into {chunk} "
                        f"per rank, which splits its {block[dim]}-wide blocks")
    return None


def _is_strided(p) -> bool:
    """A ``_StridedShard`` (FSDP2's shard of a TP-sharded dim): it applies after the ``Shard``."""
    return type(p).__name__ == "_StridedShard"


def global_positions(t: torch.Tensor) -> torch.Tensor:
    """The flat index in the logical tensor of each element of this rank's part of ``t`` (int64,
    the local shape; [Note: global positions]); ``arange`` of a plain tensor."""
    if not is_dtensor(t):
        return torch.arange(t.numel(), device=t.device).view(t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in t.placements:
        if not (p.is_replicate() or p.is_shard()) or _is_strided(p):
            raise NotImplementedError(
                f"the global positions of a DTensor placed as {p} (stochastic rounding keys on "
                "them): only Shard and Replicate placements are contiguous ranges; redistribute "
                "it first or turn stochastic_rounding off for this cast")
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return _positions(tuple(t.shape), shape, offset, t.device)


def shard_index(mesh, placements: Sequence, dim: int = 0) -> int:
    """The index of this rank's chunk of ``dim`` among those ``placements`` cut it into over
    ``mesh`` (0 where nothing shards it): as torch nests the mesh axes that shard one dim, the
    first outermost (experts under EP: [Note: positions in token groups] in
    f8dist/core/scaling.py)."""
    coordinate, index = mesh.get_coordinate(), 0
    for axis, p in enumerate(placements):
        if p.is_shard(dim):
            index = index * mesh.size(axis) + coordinate[axis]
    return index


def _positions(shape: tuple, local_shape, offset, device) -> torch.Tensor:
    """The flat indices in a contiguous ``shape`` of the block of ``local_shape`` at ``offset``."""
    from torch.distributed._local_tensor import maybe_run_for_local_tensor

    @maybe_run_for_local_tensor  # simulated ranks (LocalTensorMode): once per rank's offsets
    def positions(local_shape, offset):
        out = torch.zeros((), dtype=torch.int64, device=device)
        stride = 1
        for d in reversed(range(len(shape))):
            index = torch.arange(offset[d], offset[d] + local_shape[d], device=device) * stride
            out = out + index.view([-1 if i == d else 1 for i in range(len(shape))])
            stride *= shape[d]
        return out.expand(local_shape)  # [local_shape]

    return positions(tuple(local_shape), tuple(offset))
