"""f8dist.testing.count_collectives on simulated ranks ([Note: what is counted] in
f8dist/testing/collectives.py): on the threaded group its c10d collectives (Python methods, off
the dispatcher) are counted once, functional ones once (not again when they reach the group's
methods), each by the ranks of its group and its reduce op; under LocalTensorMode a collective
is counted once, with one rank's bytes."""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from f8dist.testing import count_collectives
from tests.sim.local import local_world, shard
from tests.sim.threads import run_threads


def test_counts_per_group_and_op_on_threads():
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13 / 2.11

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = torch.ones(4)  # 16 bytes
        with count_collectives() as counts:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=mesh["tp"].get_group())  # c10d
            funcol.wait_tensor(funcol.all_reduce(x, "sum", mesh["dp"]))  # functional
            gather(torch.empty(16), x)  # over the world
        tp, dp = mesh["tp"], mesh["dp"]
        reduces = counts["all_reduce"]
        return (reduces.calls, reduces.calls_over(tp, "max"), reduces.calls_over(tp, "sum"),
                reduces.calls_over(dp, "sum"), reduces.calls_over(dp), reduces.input_bytes,
                counts["all_gather"].calls_over(range(4)), counts["all_gather"].output_bytes)

    assert run_threads(4, rank_main) == [(2, 1, 0, 1, 1, 32, 1, 64)] * 4



def test_counts_bytes_per_group_and_dtype_on_threads():
    """``wires``: [calls, input bytes, output bytes] per (group ranks, dtype written): what a
    float8 wire (uint8) and a high-precision one carry, apart."""

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with count_collectives() as counts:
            for t in (torch.ones(4, dtype=torch.bfloat16), torch.ones(4, dtype=torch.uint8)):
                funcol.wait_tensor(funcol.all_gather_tensor(t, 0, mesh["tp"]))
            dist.all_reduce(torch.ones(2), group=mesh["dp"].get_group())
        tp, dp = (tuple(dist.get_process_group_ranks(mesh[d].get_group())) for d in ("tp", "dp"))
        gathers = {(tp, "bfloat16"): [1, 8, 16], (tp, "uint8"): [1, 4, 8]}
        return (counts["all_gather"].wires == gathers
                and counts["all_reduce"].wires == {(dp, "float32"): [1, 8, 8]})

    assert run_threads(4, rank_main) == [True] * 4

def test_counts_once_per_simulated_collective_under_local_tensor_mode():
    with local_world(8) as mode:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        x = shard(torch.randn(8, 16), mesh, [Replicate(), Shard(0)], mode)  # [2, 16] per rank
        with count_collectives() as counts:
            x.redistribute(mesh, [Replicate(), Replicate()])
        gathers = counts["all_gather"]
        assert gathers.calls == gathers.calls_over(mesh["tp"]) == 1
        assert gathers.input_bytes == 2 * 16 * 4 and gathers.output_bytes == 8 * 16 * 4
