"""SQNR of the three gemms per recipe: Float8Linear against nn.Linear of the same dtype.

Prints the table of docs/numerics.md: output, grad_input and grad_weight of one float8 linear
against the same high-precision linear on the same gaussian data, in dB (higher is better, inf =
identical).

    PYTHONPATH=$PWD python scripts/sqnr_table.py
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn as nn

import dataclasses

from f8dist import CastConfig, Float8Linear, Float8LinearConfig
from f8dist.config import ScaleRounding
from f8dist.core.numerics import sqnr


def floor_rounding(recipe: str) -> Float8LinearConfig:
    """``recipe`` with its e8m0 scales rounded the OCP way ([Note: e8m0 rounding])."""
    config = Float8LinearConfig.from_recipe_name(recipe)
    return config.replace(**{
        f.name: dataclasses.replace(getattr(config, f.name), scale_rounding=ScaleRounding.FLOOR)
        for f in dataclasses.fields(config)
        if isinstance(getattr(config, f.name), CastConfig) and getattr(config, f.name).blockwise
    })


# row name -> config; the block-scaled rows need in and out features that divide by 128
RECIPES = {
    **{r: (lambda r=r: Float8LinearConfig.from_recipe_name(r)) for r in (
        "tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed", "mxfp8", "mxfp8_wgrad_with_hp",
        "mxfp8_square_weights", "blockwise")},
    "mxfp8 (OCP floor)": lambda: floor_rounding("mxfp8"),
}


def fwd_bwd(module: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    out = module(x)
    out.backward(grad)
    return out, x.grad, module.weight.grad


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--in-features", type=int, default=1024)
    p.add_argument("--out-features", type=int, default=512)
    args = p.parse_args()
    print(f"Float8Linear({args.in_features} -> {args.out_features}), input "
          f"[{args.batch}, {args.seq}, {args.in_features}], gaussian, seed 0, "
          f"{torch.__version__}, cpu")
    print("| recipe | dtype | output | grad_input | grad_weight |")
    print("|---|---|---|---|---|")
    for recipe, config in RECIPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            base = nn.Linear(args.in_features, args.out_features, bias=False).to(dtype)
            ours = Float8Linear.from_float(copy.deepcopy(base), config())
            x = torch.randn(args.batch, args.seq, args.in_features, dtype=dtype)
            grad = torch.randn(args.batch, args.seq, args.out_features, dtype=dtype)
            cells = [f"{sqnr(r, a):.1f}" for r, a in zip(fwd_bwd(base, x, grad), fwd_bwd(ours, x, grad))]
            print(f"| {recipe} | {str(dtype).replace('torch.', '')} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
