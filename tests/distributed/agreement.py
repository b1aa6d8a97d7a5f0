"""torchrun program (2 ranks): ranks whose float8 settings disagree fail at the first step with a
message naming the difference; ranks that agree run no collective for the check (f8dist/core/agreement.py).

Each case builds the LLaMA-style model on every rank with a rank-dependent float8 setting (None:
the rank never converts), shards it (FSDP2 over both ranks, tensor parallel with the ready plan or
a custom one, or DDP) and trains two steps as scripts/train.py does. Each case runs on a fresh
gloo group with a short timeout, and the check waits at most 5 s (``F8DIST_AGREEMENT_TIMEOUT_S``;
2 s where rank 1 never checks): a rank that never converts is stuck in a collective the other never joins until its group times
out, and the ranks then go on to the next case. ``--cases`` picks cases (default: all).

Rank 0 reports, per case, the error message and the seconds until it was raised; for the
matching case, the collectives of the first step minus those of the second (the check's cost).
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel

import f8dist
from f8dist import Float8LinearConfig, convert_to_float8_training
from f8dist.models import ModelArgs, Transformer, parallelize_llama
from f8dist.parallel.tp import Float8ColwiseParallel, Float8RowwiseParallel
from f8dist.testing import count_collectives
from tests.distributed.common import init, main, write_result

ARGS = ModelArgs(dim=64, n_layers=1, n_heads=4, multiple_of=32, max_seq_len=16)
# the check waits 5 s for a rank (a loaded 2-core CI machine may start one rank's forward seconds
# after the other's); a rank stuck in a collective the other never joins gives up after 4 s
AGREEMENT_TIMEOUT_S, GROUP_TIMEOUT_S = 5, 4
# a case where rank 1 never checks waits out both, whatever they are: shorter ones keep the claim
# (rank 1 is named, within seconds) and the launch short
NEVER_CHECKS_TIMEOUT_S = 2


def recipe(name: str, **changes) -> Float8LinearConfig:
    return Float8LinearConfig.from_recipe_name(name).replace(**changes)


# case -> (layout, {rank: config}, float8 TP styles on rank 1); rank 0 uses TP styles when "tp"
CASES = {
    "float8_all_gather_on_rank0_only": (
        "fsdp", {0: recipe("tensorwise", enable_fsdp_float8_all_gather=True), 1: recipe("tensorwise")}, True),
    "delayed_vs_dynamic_fsdp": ("fsdp", {0: recipe("delayed"), 1: recipe("tensorwise")}, True),
    "recipes_fsdp": ("fsdp", {0: recipe("tensorwise"), 1: recipe("rowwise")}, True),
    "recipes_tp": ("tp", {0: recipe("tensorwise"), 1: recipe("rowwise")}, True),
    "delayed_vs_dynamic_tp": ("tp", {0: recipe("delayed"), 1: recipe("tensorwise")}, True),
    "float8_styles_on_rank0_only": ("tp", {0: recipe("tensorwise"), 1: recipe("tensorwise")}, False),
    "ddp_recipes": ("ddp", {0: recipe("tensorwise"), 1: recipe("rowwise")}, True),
    "ddp_delayed_vs_dynamic": ("ddp", {0: recipe("delayed"), 1: recipe("tensorwise")}, True),
    "custom_tp_plan_delayed_vs_dynamic": ("tp_plan", {0: recipe("delayed"), 1: recipe("tensorwise")}, True),
    "matching": ("fsdp", {0: recipe("tensorwise"), 1: recipe("tensorwise")}, True),
    # rank 1 never converts: it waits in a collective until its group times out
    "rank1_never_converts_fsdp": ("fsdp", {0: recipe("tensorwise"), 1: None}, True),
    "rank1_never_converts_fsdp_float8_all_gather": (
        "fsdp", {0: recipe("tensorwise", enable_fsdp_float8_all_gather=True), 1: None}, True),
    "rank1_never_converts_delayed": ("fsdp", {0: recipe("delayed"), 1: None}, True),
    "rank1_never_converts_ddp": ("ddp", {0: recipe("delayed"), 1: None}, True),
}


def step(model, tokens, targets):
    logits = model(tokens)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1)).backward()
    f8dist.sync_float8_amax_and_scale_history(model)


def build(layout: str, config, float8_styles: bool, mesh):
    model = Transformer(ARGS)
    model.init_weights(seed=0)
    if config is not None:
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn != "output")
    if layout == "tp":
        parallelize_llama(model, mesh, float8=float8_styles)
    elif layout == "tp_plan":  # a plan of the user's own: no agreement.check before it
        ffn = "layers.0.feed_forward."
        parallelize_module(model, mesh, {ffn + "w1": Float8ColwiseParallel(), ffn + "w3": Float8ColwiseParallel(),
                                         ffn + "w2": Float8RowwiseParallel()})
    elif layout == "ddp":
        model = DistributedDataParallel(model, process_group=mesh.get_group())
    else:
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def run_case(name: str, mesh, rank: int) -> dict:
    layout, configs, rank1_styles = CASES[name]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len), generator=gen)
    targets = torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len), generator=gen)
    start = time.perf_counter()
    try:  # sharding time (TP) or the first step (FSDP2) must raise
        model = build(layout, configs[rank], rank == 0 or rank1_styles, mesh)
        with count_collectives() as first:
            step(model, tokens, targets)
        with count_collectives() as second:
            step(model, tokens, targets)
    except RuntimeError as e:  # the check's error, or (a rank that never converts) its group's timeout
        return {"error": str(e), "seconds": time.perf_counter() - start}
    return {"error": None, "first": first.as_dict(), "second": second.as_dict()}


def run(args):
    rank, world, device = init(timeout_s=args.pg_timeout)
    names = args.cases.split(",") if args.cases else list(CASES)
    results = {}
    for name in names:  # a fresh group per case: a case's stuck collective times out apart
        never_checks = CASES[name][1][1] is None
        agreement_s, group_s = ((NEVER_CHECKS_TIMEOUT_S,) * 2 if never_checks
                                else (AGREEMENT_TIMEOUT_S, GROUP_TIMEOUT_S))
        os.environ["F8DIST_AGREEMENT_TIMEOUT_S"] = str(agreement_s)
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=group_s))
        results[name] = run_case(name, DeviceMesh.from_group(group, device.type), rank)
    write_result(args, results)


def extra_args(parser):
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--pg-timeout", type=float, default=60.0)


if __name__ == "__main__":
    main(run, extra_args)
