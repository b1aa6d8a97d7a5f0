"""torchrun program: FSDP2 float8 all-gather of block-scaled weights against one device.

Scenarios (comma-separated ``--scenarios``; [Note: block-scaled all-gather] in
f8dist/core/weight.py):

* ``parity``: "mxfp8_square_weights" (32x32 e8m0 weight blocks), same data on every rank, shards
  on block boundaries: outputs and every gradient bit-identical to one device over AdamW steps,
  with float8 and with high-precision all-gathers; the collectives of each forward (all-gathers
  only: no amax all-reduce).
* ``bytes``: forward all-gather bytes, float8 (bytes + e8m0 scales) vs bf16 all-gather under
  MixedPrecisionPolicy(param_dtype=bf16).
* ``split``: a weight whose shards would split its blocks raises, naming the fix.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from f8dist import Float8LinearConfig, convert_to_float8_training
from f8dist.parallel.fsdp import Float8AllGatherWeight
from f8dist.testing import count_collectives
from tests.distributed.common import assert_equal, main, run_scenarios, scenario_args

DIM, HIDDEN = 64, 128  # fc1 [128, 64] and fc2 [64, 128]: 64 and 32 rows per rank on 2 ranks
STEPS = 3


class Net(nn.Module):
    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.fc1 = nn.Linear(DIM, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, DIM, bias=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))  # [B, S, DIM]


def make_model(device, fp8_all_gather, hidden=HIDDEN):
    torch.manual_seed(0)
    config = Float8LinearConfig.from_recipe_name("mxfp8_square_weights").replace(
        enable_fsdp_float8_all_gather=fp8_all_gather)
    return convert_to_float8_training(Net(hidden).to(device), config=config)


def shard(model, mp_policy=None):
    kw = {} if mp_policy is None else {"mp_policy": mp_policy}
    fully_shard(model.fc1, **kw)
    fully_shard(model.fc2, **kw)
    fully_shard(model, **kw)
    model.set_force_sum_reduction_for_comms(True)  # the reference's arithmetic: sum, then divide
    return model


def batch(device, step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(2, 16, DIM, generator=g).to(device)  # the same on every rank


def parity(device, world, fp8_all_gather, out):
    ref = make_model(device, fp8_all_gather)
    model = shard(copy.deepcopy(ref))
    n_f8 = sum(isinstance(p.to_local(), Float8AllGatherWeight) for p in model.parameters())
    if n_f8 != (2 if fp8_all_gather else 0):
        raise AssertionError(f"expected float8 all-gather weights: {fp8_all_gather}, found {n_f8}")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tag = "fp8_ag" if fp8_all_gather else "hp_ag"
    forward = []
    for step in range(STEPS):
        x = batch(device, step)
        with count_collectives() as fwd:
            y = model(x)
        forward.append(fwd.as_dict())
        y_ref = ref(x)
        assert_equal(f"{tag} step {step} output", y_ref, y)
        y.pow(2).mean().backward()
        y_ref.pow(2).mean().backward()
        for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
            p_ref.grad.mul_(world).div_(world)
            assert_equal(f"{tag} step {step} grad {name}", p_ref.grad, p.grad.full_tensor())
        for opt_ in (opt_ref, opt):
            opt_.step()
            opt_.zero_grad()
    out[f"{tag}_forward_collectives"] = forward


def all_gather_bytes(device, fp8_all_gather):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shard(make_model(device, fp8_all_gather), mp)
    with count_collectives() as fwd:
        y = model(batch(device, 0).bfloat16())
    y.float().sum().backward()  # the gathered float8 weight serves the grad_input gemm too
    return fwd.expect("all_gather").output_bytes


def bytes_ratio(device, out):
    fp8, bf16 = all_gather_bytes(device, True), all_gather_bytes(device, False)
    out["bytes"] = {"fp8_all_gather_output_bytes": fp8, "bf16_all_gather_output_bytes": bf16,
                    "ratio": fp8 / bf16}


def split(device, out):
    # hidden 96: fc1's 96 rows give 48 per rank on 2 ranks, which splits its 32-row blocks
    model = shard(make_model(device, True, hidden=96))
    try:
        model(batch(device, 0))
    except ValueError as e:
        out["split_error"] = str(e)
    else:
        raise AssertionError("a shard that splits a block must raise")


def run(args):
    def table(rank, world, device, out):
        return {
            "parity": lambda: [parity(device, world, fp8, out) for fp8 in (True, False)],
            "bytes": lambda: bytes_ratio(device, out),
            "split": lambda: split(device, out),
        }

    run_scenarios(args, table, barrier=True)


if __name__ == "__main__":
    main(run, scenario_args)
