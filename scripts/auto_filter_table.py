"""Print what f8dist's auto filter decides for common linear shapes, per recipe, with the speedup
its cost model predicts ([Note: the auto filter's cost model] in f8dist/policy/filters.py), next to the
decision of torchao's measured heuristic (``torchao.float8._auto_filter_for_recipe``; "-" when
torchao is not installed, or for recipes it has no filter for; "-" for the FP4 recipes, which H100
cannot run natively), then the per-layer choice among nvfp4, mxfp8 and bf16 on a B200
(``auto_recipe_filters``, outside nvfp4's high-precision tail).

    python scripts/auto_filter_table.py                 # M = 8192 tokens per gemm, H100 SXM
    python scripts/auto_filter_table.py --tokens 4096

The tables in docs/auto_filter.md are this script's output.
"""

from __future__ import annotations

import argparse
import importlib.util

import torch.nn as nn

from f8dist.config import Float8LinearRecipeName
from f8dist.policy.filters import (
    B200,
    H100_SXM,
    auto_filter_for_recipe,
    auto_recipe_filters,
    predicted_speedup,
)

RECIPES = [r.value for r in Float8LinearRecipeName]
CHOICES = ("nvfp4", "mxfp8")  # the per-layer choice on B200, bf16 when neither gains
TORCHAO_RECIPES = ("tensorwise", "rowwise")  # torchao 0.18 has no auto filter for the others

# (name, K = in_features, N = out_features)
SHAPES = [
    ("llama3 debugmodel wqkv", 256, 768),
    ("llama3 debugmodel w2", 768, 256),
    ("square 1024", 1024, 1024),
    ("square 2048", 2048, 2048),
    ("llama3 8B wqkv", 4096, 6144),
    ("llama3 8B wo", 4096, 4096),
    ("llama3 8B w1/w3", 4096, 14336),
    ("llama3 8B w2", 14336, 4096),
    ("llama3 70B wqkv", 8192, 10240),
    ("llama3 70B w1/w3", 8192, 28672),
    ("llama3 70B w2", 28672, 8192),
    ("narrow 8192 -> 512", 8192, 512),
]

COLUMNS = ["shape", "K", "N"] + RECIPES + [f"torchao_{r}" for r in TORCHAO_RECIPES]
CHOICE_COLUMNS = ["shape", "K", "N"] + list(CHOICES) + ["choice", "choice in the tail"]


def _gpu_line(gpu, tokens: int) -> str:
    fp4 = f"fp4 {gpu.fp4_flops / 1e12:g} TFLOP/s, " if gpu.fp4_flops else ""
    return (f"model: {gpu.name} peaks (bf16 {gpu.bf16_flops / 1e12:g} TFLOP/s, fp8 "
            f"{gpu.fp8_flops / 1e12:g} TFLOP/s, {fp4}{gpu.memory_bandwidth / 1e12:g} TB/s), "
            f"M = {tokens} tokens")


def _torchao_filters(filter_fqns=()):
    if importlib.util.find_spec("torchao") is None:
        return {}
    from torchao.float8 import _auto_filter_for_recipe

    return {r: _auto_filter_for_recipe(r, filter_fqns=list(filter_fqns)) for r in TORCHAO_RECIPES}


def rows(tokens: int) -> list:
    """One dict per shape: f8dist's predicted speedup and decision per recipe, and torchao's."""
    ours = {r: auto_filter_for_recipe(r, tokens=tokens) for r in RECIPES
            if H100_SXM.fp4_flops or r not in _FP4}
    theirs = _torchao_filters()
    out = []
    for name, k, n in SHAPES:
        row = {"shape": name, "K": k, "N": n}
        meta_linear = nn.Linear(k, n, bias=False, device="meta")
        for r in RECIPES:
            if r not in ours:
                row[r] = "-"
                continue
            decision = "float8" if ours[r](meta_linear, name) else "keep"
            row[r] = f"{predicted_speedup(r, k, n, tokens=tokens):.2f} {decision}"
        for r in TORCHAO_RECIPES:
            f = theirs.get(r)
            decision = "float8" if f is not None and f(meta_linear, name) else "keep"
            row[f"torchao_{r}"] = "-" if f is None else decision
        out.append(row)
    return out


_FP4 = ("nvfp4", "nvfp4_no_rht")


def choice_rows(tokens: int) -> list:
    """One dict per shape: the predicted speedup of each of CHOICES on B200 and the recipe
    ``auto_recipe_filters`` picks for a linear outside nvfp4's high-precision tail and in it."""
    filters = auto_recipe_filters(CHOICES, num_layers=1, tokens=tokens, gpu=B200)  # tail: block 0
    out = []
    for name, k, n in SHAPES:
        row = {"shape": name, "K": k, "N": n}
        meta_linear = nn.Linear(k, n, bias=False, device="meta")
        for r in CHOICES:
            row[r] = f"{predicted_speedup(r, k, n, tokens=tokens, gpu=B200):.2f}"
        for column, fqn in (("choice", "w"), ("choice in the tail", "layers.0.w")):
            picked = [r for r, f in zip(CHOICES, filters) if f(meta_linear, fqn)]
            row[column] = picked[0] if picked else "bf16"
        out.append(row)
    return out


def _print(columns, table):
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join("---" for _ in columns) + "|")
    for row in table:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="M, tokens per gemm")
    args = parser.parse_args(argv)
    table = rows(args.tokens)
    print(f"{_gpu_line(H100_SXM, args.tokens)}; cells: predicted bf16/float8 time of fwd+bwd, "
          f"decision")
    _print(COLUMNS, table)
    print()
    print(f"{_gpu_line(B200, args.tokens)}; cells: predicted bf16/low-precision time of "
          f"fwd+bwd, the per-layer choice outside nvfp4's high-precision tail and in it")
    _print(CHOICE_COLUMNS, choice_rows(args.tokens))
    return table


if __name__ == "__main__":
    main()
