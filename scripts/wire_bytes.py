"""Bytes per collective for bf16, MXFP8 and NVFP4 on 2 simulated ranks (threads, torch's threaded
process group), counted by f8dist's collective counter (``f8dist.testing.count_collectives``):

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python scripts/wire_bytes.py

* FSDP2 all-gather: the forward all-gathers of a two-linear stack (dim 64), output bytes per
  rank; bf16 gathers bf16 parameters, the float8 recipes their weights in float8
  (``enable_fsdp_float8_all_gather``; MXFP8 as 32x32 weight tiles) with their block scales;
* EP dispatch: the dispatch all-to-all of an MoE (dim 64, 8 experts, top 2) with
  ``Float8ExpertParallel``, input bytes per rank less the bf16 combine's and the counts';
  per routed token;
* SP all-gather: a colwise / rowwise pair (dim 64 -> 128 -> 64) with sequence parallelism
  (``f8dist.parallel.tp``; bf16: torch's styles), output bytes per rank of the forward's
  all-gathers (the activation) and the backward's (the output's gradient), [2, 64, 64] each; the
  float8 recipes gather each of their two casts of it (one per gemm) with its block scales;
  ``nvfp4+derive`` (``sp_grad_weight="derive"``) gathers the row-block cast alone, from which the
  grad_weight gemm derives its operands.

Figures in docs/performance.md.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.tensor.parallel import parallelize_module  # noqa: E402

from f8dist import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from f8dist.models.moe import MoE, MoEArgs  # noqa: E402
from f8dist.parallel.ep import Float8ExpertParallel  # noqa: E402
from f8dist.testing import count_collectives  # noqa: E402
from tests.sim.threads import run_threads  # noqa: E402

WORLD, DIM, HIDDEN, TOKENS = 2, 64, 32, 16
SP_SHAPE = (2, 64, DIM)  # [batch, seq, dim]: 32 tokens a sequence shard, whole 1x32 blocks
RECIPES = (None, "mxfp8", "nvfp4")  # None: bf16
SP_RECIPES = (*RECIPES, "nvfp4+derive")  # sp_grad_weight="derive": one cast of each crosses


def fsdp_all_gather(recipe) -> int:
    """Forward all-gather output bytes on rank 0."""
    def rank_main(rank):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False))
        if recipe is not None:
            square = "mxfp8_square_weights" if recipe == "mxfp8" else recipe  # one weight cast
            convert_to_float8_training(net, config=Float8LinearConfig.from_recipe_name(
                square).replace(enable_fsdp_float8_all_gather=True))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for m in (net[0], net[1], net):
            fully_shard(m, mp_policy=mp)
        with torch.no_grad(), count_collectives() as counts:
            net(torch.randn(TOKENS, DIM))
        return counts.expect("all_gather").output_bytes

    return run_threads(WORLD, rank_main)[0]


def ep_dispatch(recipe) -> float:
    """Dispatch bytes per routed token on rank 0 (all-to-all input bytes with and without float8
    dispatch differ by the tokens' bytes; the bf16 tokens are ``2 * dim``)."""
    moe = MoE(DIM, HIDDEN, MoEArgs(num_experts=4 * WORLD, top_k=2, shared_expert=False))
    moe.init_weights(0.02, torch.Generator().manual_seed(0))
    moe.to(torch.bfloat16)
    if recipe is not None:
        convert_to_float8_training(moe, config=Float8LinearConfig.from_recipe_name(recipe))
    x = torch.randn(1, TOKENS, DIM, generator=torch.Generator().manual_seed(1)).bfloat16()

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
        sent = {}
        for fd in (True, False):
            layer = copy.deepcopy(moe)
            parallelize_module(layer.experts, mesh, Float8ExpertParallel(float8_dispatch=fd))
            with torch.no_grad(), count_collectives() as counts:
                layer(x)
            sent[fd] = counts["all_to_all"].input_bytes
        assignments = TOKENS * moe.args.top_k
        return 2 * DIM - (sent[False] - sent[True]) / assignments

    return run_threads(WORLD, rank_main)[0]


def sp_all_gather(recipe) -> dict:
    """Forward and backward all-gather output bytes on rank 0 of a colwise / rowwise pair with
    sequence parallelism (``f8dist.parallel.tp``; bf16: torch's ``ColwiseParallel`` /
    ``RowwiseParallel``): the forward gathers the activation, the backward the output's
    gradient, each of ``SP_SHAPE`` (bf16 in, bf16 gradient out)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from f8dist.parallel.tp import Float8ColwiseParallel, Float8RowwiseParallel

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(DIM, 2 * DIM, bias=False),
                        nn.Linear(2 * DIM, DIM, bias=False)).bfloat16()
    if recipe is not None:
        name, _, mode = recipe.partition("+")  # "nvfp4+derive": the recipe, its sp_grad_weight
        config = Float8LinearConfig.from_recipe_name(name)
        convert_to_float8_training(net, config=config.replace(
            sp_grad_weight=mode or config.sp_grad_weight))
    colwise, rowwise = ((ColwiseParallel, RowwiseParallel) if recipe is None
                        else (Float8ColwiseParallel, Float8RowwiseParallel))
    gen = torch.Generator().manual_seed(1)
    x, grad_out = (torch.randn(SP_SHAPE, generator=gen).bfloat16() for _ in range(2))
    nets = [copy.deepcopy(net) for _ in range(WORLD)]

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (WORLD,))
        m = parallelize_module(nets[rank], mesh, {
            "0": colwise(input_layouts=Shard(1)), "1": rowwise(output_layouts=Shard(1))})
        h = x.chunk(WORLD, 1)[rank].clone().requires_grad_()
        with count_collectives() as fwd:
            out = m(h)
        with count_collectives() as bwd:
            out.backward(grad_out.chunk(WORLD, 1)[rank])
        out.sum(), h.grad.sum()  # wait for the two reduce-scatters (async collective tensors)
        return {"SP all-gather, forward (bytes, rank 0)": fwd.expect("all_gather").output_bytes,
                "SP all-gather, backward (bytes, rank 0)": bwd.expect("all_gather").output_bytes}

    return run_threads(WORLD, rank_main)[0]


def main() -> list:
    rows = []
    base = {}
    for recipe in RECIPES:
        name = recipe or "bf16"
        values = {"FSDP2 all-gather (bytes, rank 0)": fsdp_all_gather(recipe),
                  "EP dispatch (bytes per token)": ep_dispatch(recipe), **sp_all_gather(recipe)}
        for what, value in values.items():
            base.setdefault(what, value)
            rows.append((what, name, value, value / base[what]))
    for recipe in SP_RECIPES[len(RECIPES):]:  # SP-only variants
        for what, value in sp_all_gather(recipe).items():
            rows.append((what, recipe, value, value / base[what]))
    print(f"| collective | recipe | bytes | vs bf16 |\n|---|---|---|---|")
    for what, name, value, ratio in sorted(rows, key=lambda r: r[0]):
        print(f"| {what} | {name} | {value:g} | {ratio:.3f} |")
    return rows


if __name__ == "__main__":
    main()
