"""torchrun program: torch.compile of a float8 TP + SP model gives eager's numbers.

A column-wise linear with a sequence-sharded input (cast to float8 before its all-gather) feeds a
row-wise linear that reduce-scatters back to sequence shards. The same model runs eagerly and
under torch.compile (fresh copies, same data); output and weight gradients must be bit-identical.
This catches a compiled backward traced with the wrong gradient placements ([Note: gradient
placements under compile] in f8dist/nn/linear.py) or gradient types ([Note: float8 gradients under
compile] in f8dist/parallel/tp/style.py): both gave wrong weight gradients (0 dB) or failed to compile.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import parallelize_module

from f8dist import Float8LinearConfig, convert_to_float8_training
from f8dist.parallel.tp import Float8ColwiseParallel, Float8RowwiseParallel
from tests.distributed.common import assert_equal, init, main, write_result

RECIPES = ("tensorwise", "rowwise")


def run_once(base: nn.Module, mesh, recipe: str, compiled: bool):
    model = convert_to_float8_training(
        copy.deepcopy(base), config=Float8LinearConfig.from_recipe_name(recipe)
    )
    parallelize_module(model, mesh, {
        "0": Float8ColwiseParallel(input_layouts=Shard(1)),
        "1": Float8RowwiseParallel(output_layouts=Shard(1)),
    })
    run = torch.compile(model, fullgraph=True) if compiled else model
    torch.manual_seed(1)
    x = torch.randn(2, 32, 64)  # [B, S, D], this rank's sequence shard
    out = run(x)  # [B, S, D] sequence shard
    out.sum().backward()
    return {
        "out": out.detach(),
        "grad:0.weight": model[0].weight.grad.full_tensor(),
        "grad:1.weight": model[1].weight.grad.full_tensor(),
    }


def run(args):
    rank, world, _ = init()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False))
    checked = []
    for recipe in RECIPES:
        torch._dynamo.reset()
        eager = run_once(base, mesh, recipe, compiled=False)
        compiled = run_once(base, mesh, recipe, compiled=True)
        for name in eager:
            assert_equal(f"{recipe} {name} (compiled vs eager)", eager[name], compiled[name])
            checked.append(f"{recipe}:{name}")
    write_result(args, {"checked": checked})


if __name__ == "__main__":
    main(run)
