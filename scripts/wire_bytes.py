"""Bytes per collective for bf16, MXFP8 and NVFP4 on 2 simulated ranks (threads, torch's threaded
process group), counted by f8dist's collective counter (``f8dist.testing.count_collectives``):

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python scripts/wire_bytes.py

* FSDP2 all-gather: the forward all-gathers of a two-linear stack (dim 64), output bytes per
  rank; bf16 gathers bf16 parameters, the float8 recipes their weights in float8
  (``enable_fsdp_float8_all_gather``; MXFP8 as 32x32 weight tiles) with their block scales;
* EP dispatch: the dispatch all-to-all of an MoE (dim 64, 8 experts, top 2) with
  ``Float8ExpertParallel``, input bytes per rank less the bf16 combine's and the counts';
  per routed token.

The SP all-gather (activations with their 1x16 / 1x32 block scales) moves the bytes per element of
the EP dispatch's tokens: tests/sim/parallel/tp/test_style.py counts it. Figures in
docs/performance.md.
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
RECIPES = (None, "mxfp8", "nvfp4")  # None: bf16


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


def main() -> list:
    rows = []
    base = {}
    for recipe in RECIPES:
        name = recipe or "bf16"
        for what, fn in (("FSDP2 all-gather (bytes, rank 0)", fsdp_all_gather),
                         ("EP dispatch (bytes per token)", ep_dispatch)):
            value = fn(recipe)
            base.setdefault(what, value)
            rows.append((what, name, value, value / base[what]))
    print(f"| collective | recipe | bytes | vs bf16 |\n|---|---|---|---|")
    for what, name, value, ratio in sorted(rows, key=lambda r: r[0]):
        print(f"| {what} | {name} | {value:g} | {ratio:.3f} |")
    return rows


if __name__ == "__main__":
    main()
