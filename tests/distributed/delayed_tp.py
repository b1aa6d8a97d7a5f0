"""torchrun program: delayed scaling under tensor parallelism (PyTorch's Colwise/RowwiseParallel
on Float8Linear), vs one device.

The row-wise layer's input and the column-wise layer's grad_output are activations sharded over
the tp ranks; each rank records the amax of its shard, the sync's MAX all-reduce makes it the
logical tensor's, so the histories and scales equal one device's and the delayed casts use them.
"""

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from f8dist import Float8LinearConfig, convert_to_float8_training, sync_float8_amax_and_scale_history

STEPS = 4


def sqnr(ref, x):
    return (10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum())).item()


def main():
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    config = Float8LinearConfig.from_recipe_name("delayed")
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    ref = convert_to_float8_training(copy.deepcopy(plain), config=config)
    model = convert_to_float8_training(plain, config=config)
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(1)
    counts, max_rel = [], 0.0
    for step in range(STEPS):
        x, t = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)  # same on all ranks
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), t).backward()
            with CommDebugMode() as comm:
                sync_float8_amax_and_scale_history(m)
            o.step()
        counts.append(comm.get_total_counts())
        for (k, v), v_ref in zip(model.state_dict().items(), ref.state_dict().values()):
            if "fp8_" in k:
                v = v.to_local()  # parallelize_module makes buffers Replicate DTensors
                max_rel = max(max_rel, ((v - v_ref).abs() / v_ref.abs().clamp(min=1e-30)).max().item())
                torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=0, msg=f"{step} {k}")
    dbs = {
        k: sqnr(v_ref, v.full_tensor())
        for (k, v), v_ref in zip(model.state_dict().items(), ref.state_dict().values())
        if k.endswith(".weight")
    }
    assert counts == [1] * STEPS, counts
    assert min(dbs.values()) >= 60, dbs
    if dist.get_rank() == 0:
        print(f"TP collectives per sync: {counts}")
        print(f"max relative diff of fp8_* buffers vs one device: {max_rel:.3g}")
        print("weight SQNR vs one device after %d steps: %s" % (STEPS, {k: round(v, 1) for k, v in dbs.items()}))
        print("OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
