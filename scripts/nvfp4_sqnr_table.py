"""SQNR per gemm of nvfp4 against mxfp8 and tensorwise, on gaussian and on outlier data.

Prints the tables of docs/numerics.md (NVFP4): output, grad_input and grad_weight of one
Float8Linear (float32) against nn.Linear on the same data, in dB; torchao 0.18's emulated NVFP4
(``NVFP4Tensor.to_nvfp4`` then ``dequantize``, 1x16 blocks along each gemm's contraction, the
weight too) on the same tensors; and the SQNR of one e2m1 cast, the figure a gemm's two casts
sum their noise from.

    PYTHONPATH=$PWD python scripts/nvfp4_sqnr_table.py
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn as nn

from f8dist import Float8Linear, Float8LinearConfig
from f8dist.core.cast import cast_to_float8, stochastic_rounding
from f8dist.core.numerics import sqnr
from sqnr_table import fwd_bwd

RECIPES = ("nvfp4", "nvfp4_no_rht", "mxfp8", "tensorwise")


def make_data(kind: str, shape, generator: torch.Generator) -> torch.Tensor:
    """Gaussian, or gaussian with one element in 1000 scaled by 100 (outliers)."""
    x = torch.randn(shape, generator=generator)
    if kind == "outliers":
        x = torch.where(torch.rand(shape, generator=generator) < 1e-3, x * 100, x)
    return x


def torchao_nvfp4(t: torch.Tensor) -> torch.Tensor:
    """``t`` [R, C] through torchao's emulated NVFP4 (1x16 blocks along C), dequantized."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    scale = per_tensor_amax_to_scale(t.abs().max())
    return NVFP4Tensor.to_nvfp4(t.contiguous(), per_tensor_scale=scale).dequantize(torch.float32)


def torchao_gemms(x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor):
    """The three gemms with each operand cast by torchao along the gemm's contraction."""
    q = torchao_nvfp4
    return (q(x) @ q(w).t(),  # output: x [M, K] @ w [N, K].t()
            q(grad) @ q(w.t()).t(),  # grad_input: grad [M, N] @ w [N, K]
            q(grad.t()) @ q(x.t()).t())  # grad_weight: grad.t() [N, M] @ x [M, K]


def one_cast(x: torch.Tensor):
    """(SQNR of one cast of ``x`` by nvfp4's activation cast, 1x16 blocks; whether torchao's
    cast of ``x`` has the same values, bit for bit)."""
    spec = Float8LinearConfig.from_recipe_name("nvfp4").cast_spec("output", "input")
    ours = cast_to_float8(x, spec).to_original_precision()
    return sqnr(x, ours), torch.equal(ours, torchao_nvfp4(x))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--in-features", type=int, default=1024)
    p.add_argument("--out-features", type=int, default=512)
    p.add_argument("--sr-seed", type=int, default=0, help="stochastic rounding's seed")
    args = p.parse_args()
    m, k, n = args.tokens, args.in_features, args.out_features
    print(f"Float8Linear({k} -> {n}) float32, {m} tokens, seed 0, {torch.__version__}, cpu")
    print("| data | recipe | output | grad_input | grad_weight |")
    print("|---|---|---|---|---|")
    casts = {}
    for kind in ("gaussian", "outliers"):
        g = torch.Generator().manual_seed(0)
        x, grad = make_data(kind, (m, k), g), make_data(kind, (m, n), g)
        base = nn.Linear(k, n, bias=False)
        with torch.no_grad():
            base.weight.copy_(make_data(kind, (n, k), g) / k**0.5)
        ref = fwd_bwd(base, x, grad)
        for recipe in RECIPES:
            stochastic_rounding.reset(args.sr_seed)  # each row draws alike, whatever ran before
            ours = Float8Linear.from_float(copy.deepcopy(base),
                                           Float8LinearConfig.from_recipe_name(recipe))
            cells = [f"{sqnr(r, a):.1f}" for r, a in zip(ref, fwd_bwd(ours, x, grad))]
            print(f"| {kind} | {recipe} | " + " | ".join(cells) + " |")
        cells = [f"{sqnr(r, a):.1f}" for r, a in zip(ref, torchao_gemms(x, base.weight.detach(), grad))]
        print(f"| {kind} | torchao NVFP4 (emulated, 1x16 weight blocks) | " + " | ".join(cells) + " |")
        casts[kind] = one_cast(x)
    print()
    print("| data | one e2m1 cast (1x16 e4m3 blocks), dB | torchao's cast bit for bit |")
    print("|---|---|---|")
    for kind, (db, same) in casts.items():
        print(f"| {kind} | {db:.1f} | {'identical' if same else 'differs'} |")


if __name__ == "__main__":
    main()
