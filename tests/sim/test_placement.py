"""f8dist/core/placement.py on a 2 x 2 x 4 mesh of 16 simulated ranks (LocalTensorMode, [Note:
simulating ranks in one process] in tests/sim/__init__.py): a value reduced over the axes that
shard its tensor takes ONE all-reduce over exactly those axes, also when they are some of the
mesh's axes (HSDP x TP: dp_shard and tp, adjacent or not), where DTensor's redistribution made
one per axis (and warned so)."""

import logging

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from f8dist.core.placement import reduce_over_shards
from f8dist.testing import count_collectives
from tests.sim.local import local_world, per_rank

NAMES = ("dp_replicate", "dp_shard", "tp")


@pytest.mark.parametrize("placements, axes", [
    ([Replicate(), Shard(0), Shard(1)], ("dp_shard", "tp")),
    ([Shard(0), Replicate(), Shard(1)], ("dp_replicate", "tp")),
    ([Replicate(), Replicate(), Shard(1)], ("tp",)),
])
def test_reduce_over_some_axes_is_one_all_reduce_over_them(placements, axes, caplog):
    with local_world(16) as mode, caplog.at_level(logging.WARNING):
        mesh = init_device_mesh("cpu", (2, 2, 4), mesh_dim_names=NAMES)
        local = mode.rank_map(lambda rank: torch.tensor([float(rank), -float(rank)]))
        with count_collectives() as counts:
            out = reduce_over_shards(local, mesh, placements, "max")
        grid = torch.arange(16).reshape(2, 2, 4)
        for rank, value in per_rank(out, 16).items():
            where = (grid == rank).nonzero()[0].tolist()
            # the ranks sharing this rank's coordinates on the other axes
            index = tuple(slice(None) if n in axes else c for n, c in zip(NAMES, where))
            group = grid[index].flatten().tolist()
            assert value.tolist() == [max(group), -min(group)], (rank, group)
        assert counts["all_reduce"].calls == 1
        group = grid[tuple(slice(None) if n in axes else 0 for n in NAMES)].flatten().tolist()
        assert counts["all_reduce"].calls_over(group, "max") == 1  # as rank 0 issues it
        assert "sequential" not in caplog.text  # torch warns of one all-reduce per axis
