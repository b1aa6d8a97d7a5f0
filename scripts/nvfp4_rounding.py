"""SQNR of NVFP4's gradient gemms with and without its random Hadamard transform and stochastic
rounding ([Note: random Hadamard transform], [Note: stochastic rounding] in
f8dist/core/scaling.py).

One Float8Linear per variant of the "nvfp4" recipe against the float64 linear on the same data,
in dB, per data kind: gaussian, a few outlier tokens (50x) in the input, rare outlier elements
(1% at 50x). Each variant runs ``--draws`` backward passes (stochastic rounding draws anew each
time): the mean of their SQNRs, and the SQNR of their mean grad_weight ("gw mean"), which only
an unbiased rounding raises.

    PYTHONPATH=$PWD python scripts/nvfp4_rounding.py
"""

from __future__ import annotations

import argparse
import copy
import dataclasses

import torch
import torch.nn as nn

from f8dist import Float8Linear, Float8LinearConfig
from f8dist.core.cast import stochastic_rounding
from f8dist.core.numerics import sqnr
from sqnr_table import fwd_bwd


def variant(random_hadamard: bool, stochastic: bool) -> Float8LinearConfig:
    """The "nvfp4" recipe with its transform and its gradients' rounding switched as given."""
    config = Float8LinearConfig.from_recipe_name("nvfp4")
    fields = {}
    for name in ("cast_config_grad_output", "cast_config_input_for_grad_weight",
                 "cast_config_grad_output_for_grad_weight"):
        cc = getattr(config, name)
        fields[name] = dataclasses.replace(
            cc, random_hadamard=random_hadamard and name.endswith("grad_weight"),
            stochastic_rounding=stochastic and "grad_output" in name)
    return config.replace(**fields)


VARIANTS = {
    "nvfp4 (RHT + SR)": variant(True, True),
    "no RHT": variant(False, True),
    "no SR": variant(True, False),
    "neither": variant(False, False),
}


def data(kind: str, tokens: int, features: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(tokens, features, generator=gen)  # [M, K]
    if kind == "outlier tokens":
        x[torch.randperm(tokens, generator=gen)[: max(tokens // 32, 1)]] *= 50
    elif kind == "outlier elements":
        x[torch.rand(tokens, features, generator=gen) < 0.01] *= 50
    return x


def gemms(config, x, grad, ref: nn.Linear, draws: int):
    """Mean SQNR of (output, grad_input, grad_weight) over ``draws`` backward passes, and the
    SQNR of their mean grad_weight."""
    out, *grads = fwd_bwd(copy.deepcopy(ref).double(), x.double(), grad.double())
    want = out.detach(), *grads
    total, mean = [0.0, 0.0, 0.0], 0.0
    stochastic_rounding.reset()
    for _ in range(draws):
        lin = Float8Linear.from_float(copy.deepcopy(ref).float(), config, fqn="lin")
        y, grad_x, grad_w = fwd_bwd(lin, x, grad)
        for i, (w, g) in enumerate(zip(want, (y.detach(), grad_x, grad_w))):
            total[i] += sqnr(w, g.double()) / draws
        mean = mean + grad_w.double() / draws  # [N, K]
    return (*total, sqnr(want[2], mean))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--draws", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)  # the linear's weight
    gen = torch.Generator().manual_seed(0)
    ref = nn.Linear(args.features, args.features, bias=False)
    print(f"{'data':<18} {'variant':<18} {'output':>8} {'grad_in':>8} {'grad_w':>8} "
          f"{'gw mean':>8}  (dB)")
    for kind in ("gaussian", "outlier tokens", "outlier elements"):
        x = data(kind, args.tokens, args.features, gen)
        grad = torch.randn(args.tokens, args.features, generator=gen)
        for name, config in VARIANTS.items():
            out, gi, gw, gw_mean = gemms(config, x, grad, ref, args.draws)
            print(f"{kind:<18} {name:<18} {out:8.2f} {gi:8.2f} {gw:8.2f} {gw_mean:8.2f}")


if __name__ == "__main__":
    main()
