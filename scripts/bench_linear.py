"""Benchmark a linear layer's forward + backward: nn.Linear (bf16) vs f8dist's Float8Linear per recipe,
eager and torch.compile'd, and torchao.float8's Float8Linear on the same shapes in the same run when
torchao is installed (it is never required).

One row per (shape, mode, recipe). Ratios:
  f8dist_speedup    = bf16_ms / f8dist_ms        (> 1: float8 faster than bf16)
  torchao_speedup   = bf16_ms / torchao_ms
  f8dist_vs_torchao = torchao_ms / f8dist_ms     (>= 1: f8dist no slower than torchao)

    python scripts/bench_linear.py                              # CPU shapes, eager and compiled
    python scripts/bench_linear.py --shapes llama70b --modes compile
    python scripts/bench_linear.py --recipes tensorwise --csv /tmp/linear.csv
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn as nn

from bench_common import (
    GemmShape, add_common_args, check_device, median_times, report, shapes_from_args, torchao_converter,
)
from f8dist import Float8LinearConfig, convert_to_float8_training

RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]
# not in the default run: CUDA runs blockwise on sm90 only, the MXFP8 recipes on sm100+ ([Note:
# the block-scaled gemm] in f8dist/core/gemm.py)
BLOCK_RECIPES = ["blockwise", "mxfp8", "mxfp8_square_weights"]
MODES = ["eager", "compile"]
COLUMNS = [
    "shape", "M", "K", "N", "mode", "recipe",
    "bf16_ms", "f8dist_ms", "torchao_ms",
    "f8dist_speedup", "torchao_speedup", "f8dist_vs_torchao",
]


def fwd_bwd(model: nn.Module, x: torch.Tensor, grad_out: torch.Tensor):
    """One training step of the layer without the optimizer: forward, then grads of the input and
    the weight (``autograd.grad``, so nothing accumulates between calls)."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        return torch.autograd.grad(model(x), [x, *params], grad_out)

    return step


def layer_candidates(shape: GemmShape, recipes, mode: str, device: str, ao_convert) -> dict:
    """bf16, f8dist and (if given) torchao layers of one shape, all from the same bf16 weights."""
    base = nn.Sequential(nn.Linear(shape.k, shape.n, bias=False))
    base = base.to(device=device, dtype=torch.bfloat16)
    x = torch.randn(shape.m, shape.k, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(shape.m, shape.n, device=device, dtype=torch.bfloat16)

    models = {"bf16": base}
    for recipe in recipes:
        models[f"f8dist:{recipe}"] = convert_to_float8_training(
            copy.deepcopy(base), config=Float8LinearConfig.from_recipe_name(recipe)
        )
        if ao_convert is not None:
            try:
                models[f"torchao:{recipe}"] = ao_convert(copy.deepcopy(base), recipe)
            except (AssertionError, ImportError, RuntimeError, NotImplementedError,
                    ValueError) as e:  # e.g. blockwise needs sm90
                print(f"torchao {recipe}: not run on {device} ({type(e).__name__}: {e})")
    if mode == "compile":
        models = {name: torch.compile(m) for name, m in models.items()}
    return {name: fwd_bwd(m, x, grad_out) for name, m in models.items()}


def main(argv=None) -> list:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--recipes", nargs="+", choices=RECIPES + BLOCK_RECIPES,
                        default=RECIPES)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    parser.add_argument("--no-torchao", action="store_true", help="skip torchao even if installed")
    args = parser.parse_args(argv)
    check_device(args.device, parser.prog)
    shapes = shapes_from_args(args)
    ao_convert = None if args.no_torchao else torchao_converter()
    torch.manual_seed(0)

    rows = []
    for shape in shapes:
        for mode in args.modes:
            # every shape and recipe is a new graph of the same forward code: start each group
            # from a clean dynamo cache so the recompile limit is never what is measured
            torch._dynamo.reset()
            times = median_times(
                layer_candidates(shape, args.recipes, mode, args.device, ao_convert),
                warmup=args.warmup, repeats=args.repeats, device=args.device,
            )
            bf16 = times["bf16"]
            for recipe in args.recipes:
                ours = times[f"f8dist:{recipe}"]
                theirs = times.get(f"torchao:{recipe}")
                rows.append({
                    "shape": shape.name, "M": shape.m, "K": shape.k, "N": shape.n,
                    "mode": mode, "recipe": recipe,
                    "bf16_ms": bf16 * 1e3,
                    "f8dist_ms": ours * 1e3,
                    "torchao_ms": None if theirs is None else theirs * 1e3,
                    "f8dist_speedup": bf16 / ours,
                    "torchao_speedup": None if theirs is None else bf16 / theirs,
                    "f8dist_vs_torchao": None if theirs is None else theirs / ours,
                })
    title = "Linear fwd+bwd: bf16 vs float8 (speedup > 1: faster than bf16; f8dist_vs_torchao >= 1: f8dist no slower)"
    if ao_convert is None:
        title += " [torchao not installed: its columns are '-']"
    report(rows, COLUMNS, title=title, device=args.device, csv_path=args.csv)
    return rows


if __name__ == "__main__":
    main()
