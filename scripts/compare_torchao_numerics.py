"""Do f8dist and torchao.float8 compute the same numbers? (needs `pip install --no-deps torchao`)

For each recipe and dtype, one Float8Linear of each library with the same weights runs forward and
backward on the same data; prints whether output, grad_input and grad_weight are bit-identical and
their SQNR against each other (dB). The MXFP8 recipes run against torchao's MXFP8 training
(``quantize_`` with ``MXFP8TrainingOpConfig``, the emulated kernels, RCEIL: they run on the CPU);
torchao's DeepSeek-style blockwise training needs Triton on an sm90 GPU, so "blockwise" has no
counterpart here. Used for docs/numerics.md.

    PYTHONPATH=$PWD python scripts/compare_torchao_numerics.py
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn as nn

from f8dist import Float8Linear, Float8LinearConfig
from f8dist.core.numerics import sqnr

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "mxfp8_wgrad_with_hp")


def torchao_linear(base: nn.Module, recipe: str, dtype: torch.dtype) -> nn.Module:
    """torchao's counterpart of the f8dist recipe, in an nn.Sequential."""
    theirs = nn.Sequential(copy.deepcopy(base))
    if not recipe.startswith("mxfp8"):
        import torchao.float8 as ao

        return ao.convert_to_float8_training(
            theirs, config=ao.Float8LinearConfig.from_recipe_name(recipe))
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization import quantize_
    from torchao.quantization.quantize_.common import KernelPreference

    quantize_(theirs, MXFP8TrainingOpConfig(
        kernel_preference=KernelPreference.EMULATED, out_dtype=dtype,
        wgrad_with_hp=recipe == "mxfp8_wgrad_with_hp",
        scale_calculation_mode=ScaleCalculationMode.RCEIL))
    return theirs


def run(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    out = module(x)
    out.backward(grad)
    return out, x.grad, weight.grad


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--in-features", type=int, default=256)
    p.add_argument("--out-features", type=int, default=512)
    args = p.parse_args()
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"this comparison needs torchao: pip install --no-deps torchao ({e})")

    # one table for torchao.float8's recipes, one for the MXFP8 ones (docs/numerics.md shows each)
    for family in ([r for r in RECIPES if not r.startswith("mxfp8")],
                   [r for r in RECIPES if r.startswith("mxfp8")]):
        print("\n| dtype | recipe | output | grad_input | grad_weight |")
        print("|---|---|---|---|---|")
        for dtype, recipe in ((d, r) for d in (torch.bfloat16, torch.float32) for r in family):
            torch.manual_seed(0)
            base = nn.Linear(args.in_features, args.out_features, bias=False).to(dtype)
            ours = Float8Linear.from_float(
                copy.deepcopy(base), Float8LinearConfig.from_recipe_name(recipe)
            )
            theirs = torchao_linear(base, recipe, dtype)
            x = torch.randn(args.tokens, args.in_features, dtype=dtype)
            grad = torch.randn(args.tokens, args.out_features, dtype=dtype)
            a = run(ours, x, grad, ours.weight)
            b = run(theirs, x, grad, theirs[0].weight)
            cells = [
                "identical" if torch.equal(u, v) else f"{sqnr(v, u):.1f} dB" for u, v in zip(a, b)
            ]
            print(f"| {str(dtype).replace('torch.', '')} | {recipe} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
