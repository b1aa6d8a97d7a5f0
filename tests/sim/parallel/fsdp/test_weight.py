"""FSDP2 over 8 simulated ranks (threads, [Note: simulating ranks in one process] in
tests/sim/__init__.py) with block-scaled recipes, against one device ([Note: block-scaled
all-gather] in f8dist/core/weight.py): the 2-rank test is
tests/sim/parallel/fsdp/test_block.py.

* square weight blocks gathered in float8 with shards on block boundaries: outputs and every
  gradient one device's bit for bit, no amax all-reduce, and the all-gathers
  move 1 byte per element plus one e8m0 byte per 32x32 block (against bf16's 2);
* every block recipe with a high-precision all-gather, uneven and empty shards included (a
  20-row layer over 8 ranks: 3 rows on six, 2 on one, none on the last): one device's numbers,
  no amax all-reduce; nvfp4's stochastically rounded gradients too, each rank (a replica)
  drawing from its own stream as one device does for its batch with that stream ([Note: the
  stochastic rounding key] in f8dist/core/cast.py);
* a float8 all-gather whose shards would split blocks raises, naming the fix;
* a one-rank FSDP2 group, where FSDP2 runs no collective ([Note: one-rank FSDP2 group]): every
  recipe that gathers in float8, linears and grouped experts, one device's numbers over two
  optimizer steps.
"""

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from f8dist import (
    Float8Linear, Float8LinearConfig, convert_to_float8_training, sync_float8_amax_and_scale_history,
)
from f8dist.core.cast import stochastic_rounding
from f8dist.parallel.fsdp import Float8AllGatherWeight
from f8dist.nn.grouped import GroupedExperts
from f8dist.testing import count_collectives
from tests.sim.parallel.fsdp.one_device import one_device_steps
from tests.sim.threads import run_threads

WORLD = 8
DIM = 256  # 32 rows per rank over 8 ranks: whole 32x32 blocks
HEAD = 20  # rows per rank: 3, 3, 3, 3, 3, 3, 2, 0


class Net(nn.Module):
    def __init__(self, head: bool):
        super().__init__()
        self.fc1 = nn.Linear(DIM, DIM, bias=False)
        self.fc2 = nn.Linear(DIM, DIM, bias=False)
        self.head = nn.Linear(DIM, HEAD, bias=False) if head else None

    def forward(self, x):
        y = self.fc2(torch.relu(self.fc1(x)))  # [B, S, DIM]
        return y if self.head is None else self.head(y)  # [B, S, HEAD]


def make(recipe, fp8_all_gather, head=False):
    torch.manual_seed(0)
    config = Float8LinearConfig.from_recipe_name(recipe).replace(
        enable_fsdp_float8_all_gather=fp8_all_gather, pad_inner_dim=head)
    net = convert_to_float8_training(Net(head), config=config)
    assert all(isinstance(m, Float8Linear) for m in (net.fc1, net.fc2, net.head) if m is not None)
    return net


def shard(model, mp_policy=None):
    kw = {} if mp_policy is None else {"mp_policy": mp_policy}
    for m in (model.fc1, model.fc2, model.head, model):
        if m is not None:
            fully_shard(m, **kw)
    model.set_force_sum_reduction_for_comms(True)  # the reference's arithmetic: sum, then divide
    return model


def batch(step, rank=0):
    g = torch.Generator().manual_seed(100 + WORLD * step + rank)
    return torch.randn(2, 8, DIM, generator=g)  # [B, S, DIM], each rank its own


def parity(recipe, fp8_all_gather, head=False, steps=1):
    """Every rank trains a copy on its own batches; one device runs each rank's batch (with that
    rank's stochastic rounding stream) and sums the gradients in rank order (the threaded group's
    reduce-scatter order), then divides by 8, as FSDP2 does: outputs and gradients must be equal.
    Returns, per rank, the names of the weights gathered in float8, each step's (forward,
    backward) collective counts and the rows of each weight's shard."""
    ref = make(recipe, fp8_all_gather, head)
    copies = [copy.deepcopy(ref) for _ in range(WORLD)]
    outs, grads = one_device_steps(ref, batch, WORLD, steps)

    def rank_main(rank):
        stochastic_rounding.reset(stream=rank)  # each replica its own draws, as one_device_steps
        model = shard(copies[rank])
        gathered_in_float8 = [n for n, p in model.named_parameters()
                              if isinstance(p.to_local(), Float8AllGatherWeight)]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        counts = []
        for step in range(steps):
            with count_collectives() as fwd:
                y = model(batch(step, rank))
            with count_collectives() as bwd:
                y.pow(2).mean().backward()
            counts.append((fwd, bwd))
            assert torch.equal(y, outs[step][rank]), (rank, step)
            for name, p in model.named_parameters():
                assert torch.equal(p.grad.full_tensor(), grads[step][name]), (rank, step, name)
            opt.step()
            opt.zero_grad()
        rows = {n: p.to_local().shape[0] for n, p in model.named_parameters()}
        return gathered_in_float8, counts, rows

    return run_threads(WORLD, rank_main)


def test_square_blocks_gathered_in_float8_on_8_ranks():
    # one step: its forward all-gathers each weight, its backward all-gathers it again into
    # FSDP2's buffer (out=)
    for gathered, counts, _ in parity("mxfp8_square_weights", fp8_all_gather=True, steps=1):
        assert gathered == ["fc1.weight", "fc2.weight"]
        for fwd, bwd in counts:
            assert fwd["all_reduce"].calls == bwd["all_reduce"].calls == 0
            assert fwd["all_gather"].calls == 2  # one per weight: its bytes and scales together


def all_gather_bytes(recipe, fp8_all_gather):
    """Forward all-gather bytes per rank, with bf16 parameters for a high-precision gather."""
    models = [make(recipe, fp8_all_gather) for _ in range(WORLD)]
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def rank_main(rank):
        model = shard(models[rank], mp)
        with count_collectives() as fwd:
            model(batch(0).bfloat16())
        return fwd.expect("all_gather").output_bytes

    return run_threads(WORLD, rank_main)


def test_square_blocks_all_gather_bytes_on_8_ranks():
    fp8 = all_gather_bytes("mxfp8_square_weights", True)
    bf16 = all_gather_bytes("mxfp8_square_weights", False)
    # per rank: the gathered weights, 1 byte per element and 1 e8m0 byte per 32x32 block,
    # against bf16's 2 bytes per element
    assert fp8 == [2 * DIM * DIM * (1 + 1 / 1024)] * WORLD, fp8
    assert bf16 == [2 * DIM * DIM * 2] * WORLD, bf16


@pytest.mark.parametrize("recipe", ["mxfp8", "blockwise", "nvfp4"])
def test_block_recipes_uneven_and_empty_shards_on_8_ranks(recipe):
    results = parity(recipe, fp8_all_gather=False, head=True)
    assert [rows["head.weight"] for _, _, rows in results] == [3] * 6 + [2, 0]
    for gathered, counts, _ in results:
        assert gathered == []
        for fwd, bwd in counts:  # a block's scale is its own: no amax collective
            assert fwd["all_reduce"].calls == bwd["all_reduce"].calls == 0
            assert fwd["all_gather"].calls == 3


@pytest.mark.parametrize("recipe, head, words", [
    ("mxfp8_square_weights", True, ["head:output:weight", "3 per rank", "32-wide blocks"]),
    ("blockwise", False, ["fc1:output:weight", "32 per rank", "128-wide blocks"]),
])
def test_float8_all_gather_of_split_blocks_raises_on_8_ranks(recipe, head, words):
    models = [make(recipe, True, head) for _ in range(WORLD)]
    with pytest.raises(ValueError, match="enable_fsdp_float8_all_gather=False") as e:
        run_threads(WORLD, lambda rank: shard(models[rank])(batch(0)))
    for word in words:
        assert word in str(e.value)


# -- a one-rank FSDP2 group ([Note: one-rank FSDP2 group] in f8dist/core/weight.py) --------------

ONE_DIM, ONE_HIDDEN, ONE_EXPERTS = 128, 128, 4  # whole 128x128 blocks for 'blockwise'


class LinearsAndExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(ONE_DIM, ONE_DIM, bias=False)
        self.experts = GroupedExperts(ONE_DIM, ONE_HIDDEN, ONE_EXPERTS)
        self.experts.init_weights(0.02, torch.Generator().manual_seed(1))

    def forward(self, x):  # [M, DIM]
        offsets = torch.tensor([16, 16, 48, x.shape[0]], dtype=torch.int32)  # expert 1: no token
        return self.experts(torch.relu(self.fc(x)), offsets)  # [M, DIM]


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "mxfp8_square_weights", "blockwise"])
def test_one_rank_group_matches_one_device(recipe):
    """Every recipe that all-gathers in float8, dense and grouped experts, on a one-rank FSDP2
    group (FSDP2 runs no collective and hands post_all_gather its first input only): outputs
    and gradients one device's bit for bit, over two steps with an optimizer step between."""
    torch.manual_seed(0)
    config = Float8LinearConfig.from_recipe_name(recipe).replace(enable_fsdp_float8_all_gather=True)
    ref = convert_to_float8_training(LinearsAndExperts(), config=config)
    model = copy.deepcopy(ref)
    batches = [torch.randn(64, ONE_DIM, generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    outs, grads = [], []
    for x in batches:
        y = ref(x)
        y.pow(2).mean().backward()
        outs.append(y.detach())
        grads.append({n: p.grad.clone() for n, p in ref.named_parameters()})
        sync_float8_amax_and_scale_history(ref)  # delayed: the next step's scales
        opt_ref.step()
        opt_ref.zero_grad()

    def rank_main(rank):
        fully_shard(model.fc)
        fully_shard(model.experts)
        fully_shard(model)
        gathered_in_float8 = [n for n, p in model.named_parameters()
                              if isinstance(p.to_local(), Float8AllGatherWeight)]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step, x in enumerate(batches):
            y = model(x)
            y.pow(2).mean().backward()
            assert torch.equal(y, outs[step]), step
            for name, p in model.named_parameters():
                assert torch.equal(p.grad.full_tensor(), grads[step][name]), (step, name)
            sync_float8_amax_and_scale_history(model)
            opt.step()
            opt.zero_grad()
        return gathered_in_float8

    (gathered,) = run_threads(1, rank_main)
    assert gathered == ["fc.weight", "experts.w1", "experts.w2", "experts.w3"]
