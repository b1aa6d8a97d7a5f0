"""Simulate ``world`` ranks as ONE program: ``LocalTensorMode`` over torch's fake process group,
every tensor a ``LocalTensor`` holding each rank's value. For programs where every rank has the
same shapes and no float8 tensor is redistributed ([Note: simulating ranks in one process] in
tests/sim/__init__.py).

Example::

    >>> with local_world(64) as mode:                                   # doctest: +SKIP
    ...     mesh = init_device_mesh("cpu", (4, 4, 4), mesh_dim_names=("a", "b", "c"))
    ...     d = distribute_tensor(x, mesh, [Shard(0), Replicate(), Shard(1)])
    ...     d.to_local()._local_tensors[5]                    # rank 5's shard
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist


@contextlib.contextmanager
def local_world(world: int) -> Iterator[object]:
    """A fake process group of ``world`` ranks and a ``LocalTensorMode`` over all of them (the
    mode is yielded: ``mode.rank_map(fn)`` makes a LocalTensor of ``fn(rank)``)."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        with LocalTensorMode(world) as mode:
            yield mode
    finally:
        dist.destroy_process_group()


def per_rank(t, world: int) -> dict:
    """{rank: value} of a LocalTensor (a plain tensor: the same on every rank)."""
    local = getattr(t, "_local_tensors", None)
    return dict(local) if local is not None else {r: t for r in range(world)}


def shard(x: torch.Tensor, mesh, placements, mode):
    """``x`` laid out as ``placements`` (Shard and Replicate) over ``mesh``: each rank's chunk, as
    ``distribute_tensor`` cuts it, without its collectives (a scatter from rank 0 costs seconds
    on 64 simulated ranks)."""
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.tensor import DTensor

    chunks = {}
    with mode.disable():  # plain tensor ops, once per rank
        ranks = mesh.mesh.tolist() if mesh.mesh.dim() == 1 else mesh.mesh.flatten().tolist()
        coordinates = torch.stack(torch.meshgrid(
            *[torch.arange(n) for n in mesh.mesh.shape], indexing="ij"), -1).reshape(-1, mesh.ndim)
        for rank, coordinate in zip(ranks, coordinates.tolist()):
            t = x
            for c, n, p in zip(coordinate, mesh.mesh.shape, placements):
                if p.is_shard():
                    t = torch.chunk(t, n, p.dim)[c]
            chunks[rank] = t.clone()
    return DTensor.from_local(LocalTensor(chunks), mesh, placements, run_check=False,
                              shape=x.shape, stride=x.stride())
