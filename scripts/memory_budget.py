"""Training memory per parameter and per token: bf16 vs each float8 recipe, each optimizer state
format and float8 activations for backward. The table in docs/performance.md (Memory budget)::

    PYTHONPATH=. python scripts/memory_budget.py

Per parameter: what scripts/train.py holds between steps, per parameter of the model (under FSDP2
each rank holds 1/dp of it): fp32 parameters and buffers, fp32 gradients, the optimizer's state
(torch.optim.AdamW with fp32 moments, or f8dist.optim.AdamW with 8-bit ones), measured with
train.py's own counters ([Note: the memory line]) after one step of its default model, and the
transient of a checkpoint save (``state_dict()`` of the optimizer, held while DCP writes it).

Per token: bytes one transformer block keeps for backward per token (bf16 activations, eager,
``f8dist.testing.measure_fwd_bwd``; scripts/memory_report.py has the full table), plain, under
float8_sac_context_fn and under full activation checkpointing.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import noop_context_fn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train  # noqa: E402  (scripts/train.py)
from memory_report import MODES, RECIPES, build, configs, convert  # noqa: E402

from f8dist import Float8LinearConfig, float8_sac_context_fn  # noqa: E402
from f8dist.core.gemm import block_problems  # noqa: E402
from f8dist.models import Transformer  # noqa: E402
from f8dist.models.data import ByteBatches  # noqa: E402
from f8dist.models.llama import ModelArgs  # noqa: E402
from f8dist.testing import LiveBytes, measure_fwd_bwd  # noqa: E402


def per_parameter(recipe: str, states: str) -> dict:
    """train.py's memory split after one step of its default model, per parameter; plus what the
    optimizer's state_dict() holds (a checkpoint's transient)."""
    args = train.parse_args(["--float8", recipe, "--optim-states", states])
    torch.manual_seed(0)
    model = Transformer(train.model_args(args))
    model.init_weights(seed=0)
    config = train.float8_config(args)
    if config is not None:
        train.convert_to_float8_training(model, config=config,
                                         module_filter_fn=lambda mod, fqn: fqn != "output")
    optimizer = train.build_optimizer(model, args)
    x, y = next(ByteBatches(seq_len=args.seq_len, batch_size=2, seed=0))
    F.cross_entropy(model(x).flatten(0, 1), y.flatten(0, 1)).backward()
    optimizer.step()
    split = train.memory_split(model, optimizer)
    with LiveBytes() as live:
        sd = optimizer.state_dict()
        split["checkpoint"] = live.current
    del sd
    n = sum(p.numel() for p in model.parameters())
    return {k: v / n for k, v in split.items()}


def per_token(dim: int, tokens: int, recipes: Sequence[str] = tuple(RECIPES[1:]),
              modes: Sequence[str] = tuple(MODES)):
    """(recipe, f8 act, {plain, sac, full}: kept bytes per token) of one block, bf16 first; the
    float8 rows of ``recipes`` in the f8 act ``modes`` (default: all of memory_report's)."""
    args = ModelArgs(dim=dim, n_heads=4, max_seq_len=128)
    torch.manual_seed(1)
    x = torch.randn(2, tokens // 2, dim, dtype=torch.bfloat16)
    base, extra = build("block", args, "cpu", torch.bfloat16)
    for recipe, on, config in configs(args, tuple(recipes)):
        if config is not None and on not in modes:
            continue
        module = convert(base, config)
        kept = {
            name: measure_fwd_bwd(module, x, *extra, context_fn=fn).kept_bytes / tokens
            for name, fn in (("plain", None), ("sac", float8_sac_context_fn),
                             ("full", noop_context_fn))
        }
        yield recipe, on, kept


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=64, help="block width for the per-token table")
    p.add_argument("--tokens", type=int, default=64)
    opts = p.parse_args()
    print(f"# torch {torch.__version__}, CPU; bytes per parameter of scripts/train.py's default "
          "model (fp32 parameters and gradients, as FSDP2 with a bf16 compute dtype keeps them)")
    print(f"{'recipe':19} {'params':>7} {'grads':>7} {'AdamW fp32':>10} {'AdamW 8bit':>10} "
          f"{'sum fp32':>9} {'sum 8bit':>9} {'save, 8bit':>10}")
    default = train.model_args(train.parse_args([]))
    for recipe in train.RECIPES:
        config = None if recipe == "none" else Float8LinearConfig.from_recipe_name(recipe)
        bad = config and block_problems(config.cast_specs(), default.dim, default.ffn_hidden_dim)
        if bad:  # train.py refuses it for its default model
            print(f"# {recipe}: left out, {', '.join(bad)}")
            continue
        fp32, eight = per_parameter(recipe, "fp32"), per_parameter(recipe, "8bit")
        print(f"{'bf16' if recipe == 'none' else recipe:19} {fp32['params']:7.3f} "
              f"{fp32['grads']:7.3f} {fp32['optim']:10.3f} {eight['optim']:10.3f} "
              f"{fp32['params'] + fp32['grads'] + fp32['optim']:9.3f} "
              f"{eight['params'] + eight['grads'] + eight['optim']:9.3f} "
              f"{eight['checkpoint']:+10.3f}")
    print(f"\n# bytes kept for backward per token by one transformer block (dim {opts.dim}, bf16 "
          f"activations, {opts.tokens} tokens, eager); ratio = vs bf16")
    print(f"{'recipe':19} {'f8 act':6} {'plain':>8} {'ratio':>6} {'SAC':>8} {'ratio':>6} "
          f"{'full AC':>8} {'ratio':>6}")
    ref = None
    for recipe, on, kept in per_token(opts.dim, opts.tokens):
        ref = ref or kept
        print(f"{recipe:19} {on:6} " + " ".join(
            f"{kept[k]:8.1f} {kept[k] / ref[k]:6.3f}" for k in ("plain", "sac", "full")))


if __name__ == "__main__":
    main()
