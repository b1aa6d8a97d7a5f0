"""FSDP2 all-gather of NVFP4 weights in 4 bits on 2 simulated ranks (threads): each rank's
16x16-block shard cast with the logical weight's tensor scale ([Note: amax] in
f8dist/core/placement.py) crosses the wire as packed e2m1 bytes and e4m3 block scales ([Note:
the wire], [Note: two-level scales] in f8dist/core/tensor.py): forward and backward one
device's bit for bit, at most 0.26x bf16's bytes, scales included."""

import copy

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from f8dist import Float8LinearConfig, convert_to_float8_training
from f8dist.core.cast import stochastic_rounding
from f8dist.parallel.fsdp import Float8AllGatherWeight
from f8dist.testing import count_collectives
from tests.sim.parallel.fsdp.one_device import one_device_steps
from tests.sim.threads import run_threads

WORLD, DIM, STEPS = 2, 64, 2  # 32 rows per rank: whole 16x16 blocks


def make(fp8_all_gather: bool) -> nn.Module:
    torch.manual_seed(0)
    config = Float8LinearConfig.from_recipe_name("nvfp4").replace(
        enable_fsdp_float8_all_gather=fp8_all_gather)
    net = nn.Sequential(nn.Linear(DIM, DIM, bias=False), nn.ReLU(), nn.Linear(DIM, DIM, bias=False))
    with torch.no_grad():
        net[0].weight[3, 5] = 4.0  # an outlier on rank 0's shard: the tensor scale is all of it
    return convert_to_float8_training(net, config=config)


def shard(model: nn.Module, mp_policy=None) -> nn.Module:
    kw = {} if mp_policy is None else {"mp_policy": mp_policy}
    for m in (model[0], model[2], model):
        fully_shard(m, **kw)
    model.set_force_sum_reduction_for_comms(True)  # the reference's arithmetic: sum, then divide
    return model


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(WORLD * step + rank)
    return torch.randn(2, 16, DIM, generator=g)  # [B, S, DIM], each rank its own


def test_nvfp4_weights_all_gathered_in_4_bits_match_one_device():
    """Two optimizer steps: the second all-gathers into the tensors FSDP2 made in the first
    (``out=``), its new tensor scale included."""
    ref = make(True)
    copies = [copy.deepcopy(ref) for _ in range(WORLD)]
    outs, grads = one_device_steps(ref, batch, WORLD, STEPS)

    def rank_main(rank):
        stochastic_rounding.reset(stream=rank)  # each replica its own draws, as one_device_steps
        model = shard(copies[rank])
        assert all(isinstance(p.to_local(), Float8AllGatherWeight) for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        counts = []
        for step in range(STEPS):
            with count_collectives() as fwd:
                y = model(batch(step, rank))
            y.pow(2).mean().backward()
            assert torch.equal(y, outs[step][rank]), (rank, step)
            for n, p in model.named_parameters():
                assert torch.equal(p.grad.full_tensor(), grads[step][n]), (rank, step, n)
            opt.step()
            opt.zero_grad()
            counts.append(fwd)
        return counts

    for counts in run_threads(WORLD, rank_main):
        for fwd in counts:
            # per weight: its 4-bit bytes and e4m3 scales in one all-gather, its amax in one
            # all-reduce
            assert (fwd["all_gather"].calls, fwd["all_reduce"].calls) == (2, 2), fwd


def all_gather_bytes(fp8_all_gather: bool) -> list:
    """Forward all-gather bytes per rank, with bf16 parameters for a high-precision gather."""
    models = [make(fp8_all_gather) for _ in range(WORLD)]
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def rank_main(rank):
        model = shard(models[rank], mp)
        with count_collectives() as fwd:
            model(batch(0, rank).bfloat16())
        return fwd.expect("all_gather").output_bytes

    return run_threads(WORLD, rank_main)


def test_nvfp4_all_gather_bytes():
    nvfp4, bf16 = all_gather_bytes(True), all_gather_bytes(False)
    # per rank: two gathered weights, half a byte per element and one e4m3 byte per 16x16 block,
    # against bf16's 2 bytes per element
    assert nvfp4 == [2 * DIM * DIM * (1 / 2 + 1 / 256)] * WORLD, nvfp4
    assert bf16 == [2 * DIM * DIM * 2] * WORLD, bf16
    assert nvfp4[0] / bf16[0] <= 0.26
