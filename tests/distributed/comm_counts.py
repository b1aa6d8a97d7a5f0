"""torchrun program: f8dist.testing.count_collectives sees c10d, FSDP2-style and DTensor collectives
with exact byte counts (2 ranks)."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from f8dist.testing import count_collectives
from tests.distributed.common import init, main, write_result


def run(args):
    rank, world, device = init()
    results = {}

    # c10d: all_reduce of 10 float32 (40 bytes in, 40 out)
    with count_collectives() as c:
        t = torch.ones(10, device=device)
        dist.all_reduce(t)
    results["all_reduce"] = c.as_dict()
    if not torch.equal(t, torch.full_like(t, world)):
        raise AssertionError(f"all_reduce gave {t}")

    # the calls FSDP2 makes: all_gather_single / reduce_scatter_single on uint8 and bf16
    with count_collectives() as c:
        shard = torch.full((6,), rank, dtype=torch.uint8, device=device)
        full = torch.empty(6 * world, dtype=torch.uint8, device=device)
        dist.all_gather_into_tensor(full, shard)
        big = torch.ones(4 * world, dtype=torch.bfloat16, device=device)
        out = torch.empty(4, dtype=torch.bfloat16, device=device)
        dist.reduce_scatter_tensor(out, big)
    results["fsdp_style"] = c.as_dict()

    # DTensor: the amax of a sharded tensor, Partial(max) -> Replicate, is one functional
    # all-reduce of a 0-dim float32 (4 bytes)
    mesh = init_device_mesh(device.type, (world,))
    x = distribute_tensor(torch.arange(8.0, device=device).reshape(4, 2), mesh, [Shard(0)])
    with count_collectives() as c:
        amax = torch.max(torch.abs(x)).full_tensor()
    results["dtensor_amax"] = c.as_dict()
    if amax.item() != 7.0:
        raise AssertionError(f"amax {amax}")

    with count_collectives() as outer:
        with count_collectives() as inner:
            dist.broadcast(torch.zeros(3, device=device), src=0)
        dist.all_reduce(torch.zeros(2, device=device))
    results["nested_outer"] = outer.as_dict()
    results["nested_inner"] = inner.as_dict()

    with count_collectives() as c:
        torch.ones(3, device=device) * 2
    results["nothing"] = c.as_dict()
    try:
        c.expect("all_gather")
    except AssertionError:
        results["expect_raised"] = True
    else:
        results["expect_raised"] = False

    results["world"] = world
    write_result(args, results)


if __name__ == "__main__":
    main(run)
