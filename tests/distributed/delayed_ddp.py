"""torchrun program (2 ranks): delayed scaling under DDP where the ranks run different programs in
a step, against one device.

* rank 0 accumulates 3 micro-batches per step (two under ``no_sync``), rank 1 one;
* an auxiliary head runs on rank 0's micro-batches only (``find_unused_parameters=True``).

Before issue 23, item 10, the first step all-reduced every delayed cast's amax over the ranks:
the ranks' casts did not pair up and the step aborted in a mismatched collective or raised advice
about pipeline stages. The first step now reduces only over the axes that shard a tensor (none
here: [Note: first step] in f8dist/delayed.py), so it trains as the dynamic recipes do.

The reference is one device that accumulates every rank's micro-batches (each cast from its own
amax, as the ranks do). Checked: the histories and scales are bit-identical after the first sync
and equal up to summation order later (rtol 1e-5); the weights >= 100 dB; DDP broadcast none of
the delayed buffers (they are in ``_ddp_params_and_buffers_to_ignore``).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from f8dist import Float8LinearConfig, convert_to_float8_training, sync_float8_amax_and_scale_history
from tests.distributed.common import assert_equal, init, main, sqnr, write_result

STEPS, LR = 3, 0.1
MICRO_BATCHES = {0: 3, 1: 1}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk, self.head, self.aux = nn.Linear(32, 64), nn.Linear(64, 16), nn.Linear(64, 16)

    def forward(self, x, aux: bool):
        h = torch.relu(self.trunk(x))  # [B, 64]
        y = self.head(h)  # [B, 16]
        return y + self.aux(h) if aux else y


def batches(step: int, rank: int):
    """The micro-batches of ``rank`` in ``step``: (input [8, 32], target [8, 16], runs aux)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return [(torch.randn(8, 32, generator=g) * (1 + rank), torch.randn(8, 16, generator=g), rank == 0)
            for _ in range(MICRO_BATCHES[rank])]


def loss_of(y, t):
    """The share of ``y`` in the mean over every micro-batch of the step. DDP averages the ranks'
    gradients (gloo has no PREMUL_SUM): lr * world restores one device's update, exactly for a
    power-of-2 world."""
    total = sum(MICRO_BATCHES.values()) * t.numel()
    return nn.functional.mse_loss(y, t, reduction="sum") / total


def run(args):
    rank, world, _ = init()
    assert world == 2
    config = Float8LinearConfig.from_recipe_name("delayed")
    torch.manual_seed(0)
    plain = Net()
    ref = convert_to_float8_training(copy.deepcopy(plain), config=config)
    model = convert_to_float8_training(plain, config=config)
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    opt, opt_ref = torch.optim.SGD(ddp.parameters(), lr=LR * world), torch.optim.SGD(ref.parameters(), lr=LR)
    worst = 0.0
    for step in range(STEPS):
        opt.zero_grad()
        mine = batches(step, rank)
        for i, (x, t, aux) in enumerate(mine):
            if i < len(mine) - 1:
                with ddp.no_sync():
                    loss_of(ddp(x, aux), t).backward()
            else:
                loss_of(ddp(x, aux), t).backward()
        sync_float8_amax_and_scale_history(model)
        opt.step()

        opt_ref.zero_grad()
        for r in range(world):
            for x, t, aux in batches(step, r):
                loss_of(ref(x, aux), t).backward()
        sync_float8_amax_and_scale_history(ref)
        opt_ref.step()
        for (k, v), v_ref in zip(model.state_dict().items(), ref.state_dict().values()):
            if "fp8_" in k:
                if step == 0:
                    assert_equal(f"step {step} {k}", v_ref, v)
                torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=0, msg=f"step {step} {k}")
                worst = max(worst, ((v - v_ref).abs() / v_ref.abs().clamp(min=1e-30)).max().item())
    dbs = {k: sqnr(v_ref, v) for (k, v), v_ref in zip(model.state_dict().items(), ref.state_dict().values())
           if k.endswith("weight")}
    assert min(dbs.values()) >= 100, dbs
    ignored = sorted(n for n in ddp.parameters_to_ignore if "fp8_" in n)
    write_result(args, {"weight_sqnr_db": dbs, "buffers_max_rel_diff": worst, "ddp_ignored": ignored})


if __name__ == "__main__":
    main(run)
