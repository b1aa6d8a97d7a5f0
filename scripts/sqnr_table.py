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

from f8dist import Float8Linear, Float8LinearConfig
from f8dist.numerics import sqnr

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed")


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
    for recipe in RECIPES:
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            base = nn.Linear(args.in_features, args.out_features, bias=False).to(dtype)
            ours = Float8Linear.from_float(
                copy.deepcopy(base), Float8LinearConfig.from_recipe_name(recipe)
            )
            x = torch.randn(args.batch, args.seq, args.in_features, dtype=dtype)
            grad = torch.randn(args.batch, args.seq, args.out_features, dtype=dtype)
            cells = [f"{sqnr(r, a):.1f}" for r, a in zip(fwd_bwd(base, x, grad), fwd_bwd(ours, x, grad))]
            print(f"| {recipe} | {str(dtype).replace('torch.', '')} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
