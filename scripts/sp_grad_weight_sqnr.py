"""The grad_weight gemm's operands of the block recipes, cast directly or derived: the SQNR of a
Float8Linear's weight gradient against float64, per recipe, ``sp_grad_weight`` and data
([Note: the grad_weight operand of a gathered tensor] in f8dist/config/cells.py).

* ``forward_gather`` (the default): the grad_weight gemm casts the high-precision input and
  grad_output in token blocks, as the output and grad_input gemms cast them in row blocks;
* ``derive``: it re-casts the row-block float8 of the other gemms (dequantize, re-cast in token
  blocks: DeepSeek-V3's way), so TP+SP sends one cast (tests/sim/parallel/tp/test_derive.py);
  nvfp4's re-casts take its grad_weight casts' Hadamard transform and stochastic rounding (one
  draw, seed 0).

Data (seed 0): ``gaussian`` input and grad_output; ``outliers``: the input's channels scaled by a
log-normal factor (sigma 2) and one channel in 64 by 100 more, grad_output's tokens by a
log-normal factor (sigma 2). bf16 tensors, as a bf16 model feeds its linears.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python scripts/sp_grad_weight_sqnr.py
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import report  # noqa: E402
from f8dist import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from f8dist.core.cast import stochastic_rounding  # noqa: E402
from f8dist.core.numerics import sqnr  # noqa: E402

COLUMNS = ["recipe", "data", "forward_gather_db", "derive_db", "derive_minus_direct_db"]
RECIPES = ("mxfp8", "blockwise", "nvfp4")
MODES = ("forward_gather", "derive")


def data(kind: str, tokens: int, dim: int):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dim, generator=g, dtype=torch.float64)  # [M, K]
    grad = torch.randn(tokens, dim, generator=g, dtype=torch.float64)  # [M, N]
    if kind == "outliers":
        x = x * torch.randn(1, dim, generator=g, dtype=torch.float64).mul(2).exp()
        x[:, ::64] *= 100
        grad = grad * torch.randn(tokens, 1, generator=g, dtype=torch.float64).mul(2).exp()
    return x.bfloat16(), grad.bfloat16()


def grad_weight(recipe: str, mode: str, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    linear = torch.nn.Sequential(torch.nn.Linear(x.shape[1], grad.shape[1], bias=False))
    linear = linear.bfloat16()
    config = Float8LinearConfig.from_recipe_name(recipe).replace(sp_grad_weight=mode, emulate=True)
    convert_to_float8_training(linear, config=config)
    stochastic_rounding.reset()  # nvfp4's grad_output rounds stochastically: seed 0's draws
    linear(x).backward(grad)
    return linear[0].weight.grad  # [N, K]


def rows(tokens: int, dim: int) -> list:
    out = []
    for kind in ("gaussian", "outliers"):
        x, grad = data(kind, tokens, dim)
        exact = grad.double().t() @ x.double()  # [N, K]
        for recipe in RECIPES:
            db = {m: sqnr(exact, grad_weight(recipe, m, x, grad).double()) for m in MODES}
            out.append({"recipe": recipe, "data": kind, "forward_gather_db": db["forward_gather"],
                        "derive_db": db["derive"],
                        "derive_minus_direct_db": db["derive"] - db["forward_gather"]})
    return out


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args(argv)
    out = rows(args.tokens, args.dim)
    report(out, COLUMNS, title=f"grad_weight SQNR against float64 ({args.tokens} tokens, "
           f"{args.dim} x {args.dim})", device="cpu", csv_path=args.csv)
    return out


if __name__ == "__main__":
    main()
