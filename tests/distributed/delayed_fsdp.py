"""torchrun program: delayed scaling under FSDP2, different data per rank, vs one device.

Every rank also runs the unsharded model on the global batch (the one-device reference). After
each sync the sharded run's histories and scales must equal the reference's, and the sync must
issue exactly one all-reduce.
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode

from f8dist import Float8LinearConfig, convert_to_float8_training, sync_float8_amax_and_scale_history

STEPS = 6


def sqnr(ref, x):
    return (10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum())).item()


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    fp8_all_gather = os.environ.get("F8_ALL_GATHER", "0") == "1"
    config = Float8LinearConfig.from_recipe_name("delayed").replace(
        enable_amax_init=False, enable_fsdp_float8_all_gather=fp8_all_gather
    )
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
    ref = convert_to_float8_training(copy.deepcopy(plain), config=config)
    model = convert_to_float8_training(plain, config=config)
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    # Each rank backprops its share of the global-batch loss (sum / global count), so its
    # grad_output is the slice of one device's grad_output (and the synced amax one device's).
    # FSDP averages the gradients over ranks (gloo has no PREMUL_SUM for a divide factor of 1):
    # lr * world makes the update one device's, exactly for a power-of-2 world.
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * world)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(1)
    counts, max_rel = [], 0.0
    for step in range(STEPS):
        x = torch.randn(16 * world, 32, generator=g)  # [B_global, 32]
        t = torch.randn(16 * world, 16, generator=g)
        xs, ts = x.chunk(world)[rank], t.chunk(world)[rank]  # this rank's micro-batch

        opt_ref.zero_grad()
        nn.functional.mse_loss(ref(x), t).backward()
        sync_float8_amax_and_scale_history(ref)
        opt_ref.step()

        opt.zero_grad()
        with CommDebugMode() as step_comm:
            (nn.functional.mse_loss(model(xs), ts, reduction="sum") / t.numel()).backward()
        with CommDebugMode() as comm:
            sync_float8_amax_and_scale_history(model)
        counts.append(comm.get_total_counts())
        sync_ops = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
        assert set(sync_ops) == {"all_reduce"}, sync_ops
        fwd_bwd_ops = {str(k).split(".")[-1]: v for k, v in step_comm.get_comm_counts().items()}
        assert "all_reduce" not in fwd_bwd_ops, fwd_bwd_ops  # no amax collective in the step
        opt.step()

        for (k, v), v_ref in zip(model.state_dict().items(), ref.state_dict().values()):
            if "fp8_" in k:
                rel = ((v - v_ref).abs() / v_ref.abs().clamp(min=1e-30)).max().item()
                max_rel = max(max_rel, rel)
                if step == 0:  # before any weight update both runs see the same tensors
                    assert torch.equal(v, v_ref), (step, k, v, v_ref)
                else:
                    torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=0, msg=f"{step} {k}")
    dbs = {
        k: sqnr(v_ref, v.full_tensor())
        for (k, v), v_ref in zip(model.state_dict().items(), ref.state_dict().values())
        if k.endswith(".weight")
    }
    assert counts == [1] * STEPS, counts
    assert min(dbs.values()) >= 60, dbs
    if rank == 0:
        print(f"all_gather_float8={fp8_all_gather} collectives per sync: {counts}")
        print(f"collectives in forward+backward of the last step: {fwd_bwd_ops}")
        print(f"max relative diff of fp8_* buffers vs one device: {max_rel:.3g}")
        print("weight SQNR vs one device after %d steps: %s" % (STEPS, {k: round(v, 1) for k, v in dbs.items()}))
        print("OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
