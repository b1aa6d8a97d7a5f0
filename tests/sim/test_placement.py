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


@pytest.mark.parametrize("mesh_shape, placements", [
    ((4,), [Shard(1)]),  # 10 rows over 4 ranks: 3, 3, 3, 1 (torch's chunks)
    ((2, 2), [Shard(1), Shard(1)]),  # 10 over 2 then 2: 3, 2, 3, 2
    ((2, 2), [Shard(2), Shard(0)]),  # 6 columns over 2, then 3 over 2: 2, 1
    ((2, 2), [Replicate(), Shard(2)]),
])
def test_global_positions_are_a_shards_flat_indices_in_the_logical_tensor(mesh_shape, placements):
    # [Note: global positions]: uneven shards as torch's Shard cuts them
    from f8dist.core.placement import global_positions
    from tests.sim.local import shard

    whole = torch.arange(3 * 10 * 6).view(3, 10, 6)  # each element's flat index
    assert torch.equal(global_positions(whole.float()), whole)
    world = mesh_shape[0] * (mesh_shape[1] if len(mesh_shape) > 1 else 1)
    with local_world(world) as mode:
        mesh = init_device_mesh("cpu", mesh_shape)
        got = per_rank(global_positions(shard(whole.float(), mesh, placements, mode)), world)
        want = per_rank(shard(whole, mesh, placements, mode).to_local(), world)
        for rank in range(world):
            assert torch.equal(got[rank], want[rank]), rank


def test_global_positions_refuse_partial_placements():
    from torch.distributed.tensor import DTensor, Partial

    from f8dist.core.placement import global_positions

    with local_world(2):
        mesh = init_device_mesh("cpu", (2,))
        d = DTensor.from_local(torch.zeros(4, 4), mesh, [Partial()], run_check=False)
        with pytest.raises(NotImplementedError, match="placed as P.*Shard and Replicate"):
            global_positions(d)
