"""Expert parallelism (f8dist/parallel/ep/) on 4 and 8 simulated ranks in one process
([Note: simulating ranks in one process] in tests/sim/__init__.py) against one device:
each rank routes its own uneven slice of one batch (one rank none at all), some experts get no
token; outputs, input gradients and the experts' weight gradients bit for bit one device's; and
EP 2 with the experts' FSDP2 float8 all-gather on a one-rank dp_shard group. The real
multi-process gloo test is tests/distributed/test_moe_ep.py."""

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from f8dist import Float8LinearConfig, convert_to_float8_training
from f8dist.models.moe import MoE, MoEArgs
from f8dist.models.moe_parallel import parallelize_moe
from tests.sim.threads import run_threads

DIM, HIDDEN, PER_RANK = 64, 32, 4  # experts per rank
SIZES = [7, 2, 0, 5, 3, 1, 4, 6]  # tokens per rank: uneven, rank 2 has none


def _moe(recipe, world):
    moe = MoE(DIM, HIDDEN, MoEArgs(num_experts=PER_RANK * world, top_k=2, shared_expert=False))
    moe.init_weights(0.02, torch.Generator().manual_seed(0))
    moe.to(torch.bfloat16)
    if recipe is not None:
        convert_to_float8_training(moe, config=Float8LinearConfig.from_recipe_name(recipe))
    return moe


@pytest.mark.parametrize("world,recipe", [(4, None), (4, "rowwise"), (4, "tensorwise"),
                                          (8, "rowwise"), (8, "mxfp8")])
def test_expert_parallel_on_simulated_ranks_matches_one_device(world, recipe):
    ref = _moe(recipe, world)
    layers = [copy.deepcopy(ref) for _ in range(world)]
    sizes = SIZES[:world]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, sum(sizes), DIM, generator=g).to(torch.bfloat16)
    grad = torch.randn(1, sum(sizes), DIM, generator=g).to(torch.bfloat16)
    x_ref = x.clone().requires_grad_()
    out = ref(x_ref)
    out.backward(grad)
    counts = torch.bincount(ref.router(x[0])[1].reshape(-1), minlength=PER_RANK * world)
    assert (counts == 0).any(), counts  # an expert without any token

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        ep = parallelize_moe(layers[rank], mesh)
        return _step_matches_one_device(ep, ref, rank, sizes, x, grad, out, x_ref).shape[1]

    assert run_threads(world, rank_main) == sizes


def _step_matches_one_device(ep, ref, rank, sizes, x, grad, out, x_ref):
    """Rank ``rank``'s forward and backward of its tokens: output, input and expert gradients
    equal one device's (``ref``'s ``out``, ``x_ref.grad``) bit for bit; returns the output."""
    mine = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    xi = x[:, mine].clone().requires_grad_()
    o = ep(xi)
    o.backward(grad[:, mine])
    experts = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    assert torch.equal(o, out[:, mine]), rank
    assert torch.equal(xi.grad, x_ref.grad[:, mine]), rank
    for w in ("w1", "w2", "w3"):
        mine_grad = getattr(ep.experts, w).grad.to_local()
        assert torch.equal(mine_grad, getattr(ref.experts, w).grad[experts]), (rank, w)
    return o


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "mxfp8_square_weights"])
def test_expert_parallel_with_float8_all_gather_on_a_one_rank_dp_group(recipe):
    """dp_shard 1 x ep 2 (``train.py --ep 2`` on 2 ranks): FSDP2 shards the experts on dim 1 over
    a one-rank group and runs no all-gather ([Note: one-rank FSDP2 group] in
    f8dist/core/weight.py); the experts hand over their float8 bytes and scales (per expert,
    delayed or in blocks). Outputs, input and expert gradients one device's bit for bit."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    world = 2
    config = Float8LinearConfig.from_recipe_name(recipe).replace(enable_fsdp_float8_all_gather=True)
    ref = MoE(DIM, HIDDEN, MoEArgs(num_experts=PER_RANK * world, top_k=2, shared_expert=False))
    ref.init_weights(0.02, torch.Generator().manual_seed(0))
    convert_to_float8_training(ref, config=config)
    layers = [copy.deepcopy(ref) for _ in range(world)]
    sizes = SIZES[:world]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, sum(sizes), DIM, generator=g)
    grad = torch.randn(1, sum(sizes), DIM, generator=g)
    x_ref = x.clone().requires_grad_()
    out = ref(x_ref)
    out.backward(grad)

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_shard", "ep"))
        ep = parallelize_moe(layers[rank], mesh["ep"])
        fully_shard(ep.experts, mesh=mesh["dp_shard"], shard_placement_fn=lambda p: Shard(1))
        _step_matches_one_device(ep, ref, rank, sizes, x, grad, out, x_ref)
        return type(ep.experts.w1.to_local()).__name__

    gathered = run_threads(world, rank_main)
    assert gathered == ["Float8AllGatherWeight"] * world
