"""FSDP2 float8 all-gather of expert weights ([Note: float8 all-gather of expert weights] in
f8dist/core/weight.py) on 2 simulated ranks (FSDP2 alone) and on a 2 x 2 (dp_shard, ep) mesh; the
checks against one device run inside tests/distributed/fsdp_experts.py (run by
tests/sim/programs.py), the bytes are checked here. The delayed and block-scaled recipes' two
training steps under FSDP2 alone (on the experts dim or on dim 1) run on threads here."""

import copy

import pytest
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from f8dist import (
    Float8LinearConfig, convert_to_float8_training, sync_float8_amax_and_scale_history,
)
from f8dist.nn.grouped import GroupedExperts
from f8dist.testing import count_collectives
from tests.sim.programs import simulated
from tests.sim.threads import run_threads

DIM, HIDDEN, EXPERTS = 64, 32, 4
WEIGHT = 3 * EXPERTS * HIDDEN * DIM  # w1, w2, w3: elements of the experts' weights


FSDP = ("fsdp_experts", 2, "--scenario", "fsdp")
EP_X_FSDP = ("fsdp_experts", 4, "--scenario", "ep_fsdp")  # "--recipe": DIMS of the program


def test_fsdp_float8_all_gather_of_experts_matches_one_device():
    r = simulated(*FSDP)
    assert r["world"] == 2 and "experts.w2" in r["checked"], r
    b = r["bytes"]
    # 1 byte per element and a float32 scale per expert (gathered with them: FSDP2 shards the
    # experts dim, each rank's experts are whole), against 2 bytes per element
    assert b["float8"]["all_gather"] == WEIGHT + 3 * EXPERTS * 4, b
    assert b["bf16"]["all_gather"] == 2 * WEIGHT, b
    assert b["float8"]["all_reduce"] == 0, b  # no amax crosses ranks: the shards hold whole experts
    assert b["float8"]["all_gather"] / b["bf16"]["all_gather"] < 0.51, b


def test_ep_x_fsdp_float8_all_gather_of_experts_matches_one_device():
    r = simulated(*EP_X_FSDP, "--recipe", "tensorwise")
    assert r["world"] == 4 and r["min_sqnr_db_other"] > 100, r
    b, local = r["bytes"], WEIGHT // 2  # each EP rank gathers its 2 experts over dp_shard
    assert b["float8"]["all_gather"] == local and b["bf16"]["all_gather"] == 2 * local, b
    # the local experts' amaxes, one all-reduce per weight over dp_shard (the axis sharding dim 1)
    assert b["float8"]["all_reduce"] == 3 * (EXPERTS // 2) * 4, b
    assert b["float8"]["all_gather"] / b["bf16"]["all_gather"] == 0.5, b


# -- delayed and block-scaled expert weights on 2 simulated ranks (threads) -----------------

# recipe -> (dim = hidden: 2 ranks sharding dim 1 hold whole blocks, scale bytes per block)
RECIPES = {"delayed": (64, None), "mxfp8_square_weights": (64, (32, 1)),
           "blockwise": (256, (128, 4))}


class Experts(torch.nn.Module):
    """Grouped experts on fixed token groups (expert 1 gets no token)."""

    def __init__(self, dim: int):
        super().__init__()
        self.experts = GroupedExperts(dim, dim, EXPERTS)
        self.experts.init_weights(0.02, torch.Generator().manual_seed(1))

    def forward(self, x):  # [M, dim]
        offsets = torch.tensor([16, 16, 40, x.shape[0]], dtype=torch.int32)
        return self.experts(x, offsets)  # [M, dim]


def _two_steps(model, batches):
    """Outputs and gradients of two training steps (the delayed sync and AdamW between)."""
    opt, out = torch.optim.AdamW(model.parameters(), lr=1e-2), []
    for x in batches:
        y = model(x)
        y.pow(2).mean().backward()
        out.append((y.detach(), {n: getattr(p.grad, "full_tensor", lambda: p.grad)()
                                 for n, p in model.named_parameters()}))
        sync_float8_amax_and_scale_history(model)
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.parametrize("fsdp_dim", [0, 1])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_delayed_and_block_expert_weights_gather_float8_matching_one_device(recipe, fsdp_dim):
    """[Note: float8 all-gather of expert weights] in f8dist/core/weight.py: two training steps
    of experts that FSDP2 shards on the experts dim (0) or on dim 1 (EP x FSDP2's) over 2 ranks
    are one device's bit for bit, and the all-gather moves 1 byte per element plus the block
    scales (a delayed scale, the same on every rank, stays home)."""
    dim, block = RECIPES[recipe]
    config = Float8LinearConfig.from_recipe_name(recipe).replace(enable_fsdp_float8_all_gather=True)
    ref = convert_to_float8_training(Experts(dim), config=config)
    models = [copy.deepcopy(ref) for _ in range(2)]
    batches = [torch.randn(64, dim, generator=torch.Generator().manual_seed(s)) for s in (2, 3)]
    expected = _two_steps(ref, batches)

    def rank_main(rank):
        model = models[rank]
        fully_shard(model, shard_placement_fn=lambda p: Shard(fsdp_dim))
        assert model.experts.w1.to_local().shape[fsdp_dim] == (EXPERTS, dim)[fsdp_dim] // 2
        for (y, grads), (y_ref, grads_ref) in zip(_two_steps(model, batches), expected):
            assert torch.equal(y, y_ref), recipe
            for name, g in grads.items():
                assert torch.equal(g, grads_ref[name]), name
        with count_collectives() as counts:  # the experts' all-gather, after the sync
            model.unshard()
        model.reshard()
        return counts.as_dict()

    weight = 3 * EXPERTS * dim * dim  # elements of w1, w2, w3
    scales = 0 if block is None else weight // block[0] ** 2 * block[1]
    for counts in run_threads(2, rank_main):
        assert counts["all_gather"]["output_bytes"] == weight + scales, counts
        assert "all_reduce" not in counts, counts  # no amax crosses ranks


def test_float8_all_gather_of_expert_blocks_split_by_shards_raises():
    """2 ranks sharding dim 1 (128) of 128x128-block experts would split their blocks: the
    all-gather refuses, naming the weight, the split and the fix."""
    config = Float8LinearConfig.from_recipe_name("blockwise").replace(
        enable_fsdp_float8_all_gather=True)
    models = [convert_to_float8_training(Experts(128), config=config) for _ in range(2)]

    def rank_main(rank):
        fully_shard(models[rank], shard_placement_fn=lambda p: Shard(1))
        models[rank](torch.randn(64, 128))

    with pytest.raises(ValueError, match=r"experts\.w1:output:weight: the float8 all-gather of a "
                                         r"block-scaled weight needs shards on block boundaries.*"
                                         r"64 per rank.*enable_fsdp_float8_all_gather=False"):
        run_threads(2, rank_main)


# recipe -> (dim, hidden) (tests/distributed/fsdp_experts.py's DIMS), scale bytes per block
EP_RECIPES = {"delayed": ((64, 32), None), "mxfp8_square_weights": ((64, 64), (32, 1)),
              "blockwise": ((256, 256), (128, 4))}


@pytest.mark.parametrize("recipe", list(EP_RECIPES))
def test_ep_x_fsdp_float8_all_gather_of_delayed_and_block_experts_matches_one_device(recipe):
    """EP x FSDP2 (FSDP2 on dim 1 of each EP rank's experts, over dp_shard): logits and expert
    gradients one device's, every output and gradient the high-precision all-gather's, bit for
    bit; each EP rank gathers its experts' float8 bytes, plus the block grids' all-gather or the
    delayed scale's first amax all-reduce (one per weight)."""
    r = simulated(*EP_X_FSDP, "--recipe", recipe)
    (dim, hidden), block = EP_RECIPES[recipe]
    assert r["world"] == 4 and r["min_sqnr_db_other"] > 100, r
    b, local = r["bytes"], 3 * EXPERTS // 2 * dim * hidden  # each EP rank's 2 experts
    scales = 0 if block is None else local // block[0] ** 2 * block[1]
    assert b["float8"]["all_gather"] == local + scales and b["bf16"]["all_gather"] == 2 * local, b
    assert b["float8"]["all_reduce"] == (3 * 4 if block is None else 0), b
