"""Count the collectives of one training step (forward, backward, optimizer step and, where used,
the FSDP scale precompute) per kind, on rank 0, with f8dist's collective counter
(``f8dist.testing.count_collectives``), for bf16 and float8 under FSDP2, TP+SP and 2-D FSDP x TP.

Run with torchrun (gloo on CPU, nccl on GPU); 4 ranks give a 2 x 2 mesh for 2-D:

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD torchrun --standalone --nproc_per_node=4 \\
        scripts/bench_comm.py --csv /tmp/comm_cpu.csv   # the recorded run: docs/bench/comm_cpu.csv

Scenarios:
  fsdp mlp     a stack of linears only, so the all-gather ratio is the float8 weights' own
  fsdp llama   the LLaMA-style model (embedding, norms, output projection stay high precision)
  tp llama     TP+SP with f8dist's float8 styles (activations all-gathered in float8)
  2d llama     FSDP2 over dp x TP+SP over tp
  tp ffn       residual SwiGLU FFNs (width --ffn-dim, hidden 2x, --ffn-seq tokens per sequence)
               under TP+SP: every all-gather is a float8 linear's activation (forward) or gradient
               (backward), so the ratio is theirs
  2d ffn       the same under FSDP2 x TP: adds the weights' FSDP2 all-gathers
Variants: "float8" is the tensorwise recipe; "mxfp8", "blockwise" and "mxfp8_square_weights" are
block-scaled recipes (their scales travel with the bytes: [Note: float8 on the wire] in
f8dist/core/tensor.py), run where the scenario's shards hold whole blocks (a row says so otherwise);
"+recast" and "+backward_gather" set ``Float8LinearConfig.sp_grad_weight`` (tp ffn: [Note: the
grad_weight operand of a gathered tensor] in f8dist/config/cells.py).
FSDP variants shard fp32 master weights and all-gather in bf16 (MixedPrecisionPolicy(param_dtype=
bfloat16)); "fp8-ag" all-gathers float8 weights instead, "+precompute" computes their scales in
one all-reduce after the optimizer step, "+fp8-rs" reduce-scatters gradients in float8
(``enable_float8_reduce_scatter``: one uint8 all-to-all per FSDP unit). ``bytes`` is the per-rank
output bytes of the kind (f8dist/testing/collectives.py [Note: what is counted]); ``bytes_vs_bf16`` divides it
by the bf16 variant's; for the float8 reduce-scatter's all-to-all it divides its input bytes by
those of the FSDP reduce-scatters it replaced in the bf16 variant (each rank's whole gradient
buffer, reduced in fp32; under 2-D, TP's reduce-scatters stay and are not counted).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import report  # noqa: E402
from f8dist import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from f8dist.testing import count_collectives  # noqa: E402
from teardown import exit_cleanly, one_gpu_per_rank  # noqa: E402
from f8dist.models.llama import FeedForward, ModelArgs, Transformer  # noqa: E402
from f8dist.models import parallelize_llama  # noqa: E402

COLUMNS = [
    "scenario", "variant", "kind", "fwd_calls", "fwd_bytes", "step_calls", "step_bytes",
    "bytes_vs_bf16", "note",
]
SCENARIOS = ["fsdp mlp", "fsdp llama", "tp llama", "2d llama", "tp ffn", "2d ffn"]
HAS_FSDP_FLOAT8 = importlib.util.find_spec("f8dist.parallel.fsdp") is not None
FP8_RS = "float8+fp8-ag+precompute+fp8-rs"
RS_NOTE = "input bytes / those of the fp32 FSDP reduce-scatters it replaced"
PENDING = "pending: f8dist.parallel.fsdp (FSDP2 float8 all-gather) is not in this checkout"
SPLIT = "not run: this model's dims or shards do not divide into its blocks (see the ffn rows)"
BLOCK_RECIPES = ("mxfp8", "blockwise", "mxfp8_square_weights")


SP_GRAD_WEIGHT = ("recast", "backward_gather")


def recipe_of(variant) -> str:
    return variant[1]


def sp_grad_weight_of(name: str) -> str:
    """The ``sp_grad_weight`` a variant's name asks for ([Note: the grad_weight operand of a
    gathered tensor] in f8dist/config/cells.py): its last "+" part, or the default."""
    mode = name.split("+")[-1]
    return mode if mode in SP_GRAD_WEIGHT else "forward_gather"


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--dim", type=int, default=128, help="model width")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=SCENARIOS)
    parser.add_argument("--csv", default=None)
    parser.add_argument("--ffn-dim", type=int, default=512,
                        help="width of the ffn scenarios (their TP shards must hold whole 128x128 "
                             "blocks for the blockwise rows)")
    parser.add_argument("--ffn-seq", type=int, default=512,
                        help="sequence length of the ffn scenarios (their sequence shards must hold "
                             "whole 128-token blocks for the block recipes' float8 grad_weight "
                             "casts to travel: [Note: the grad_weight gemm under sequence "
                             "parallelism] in f8dist/parallel/tp/style.py)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model (dim 64, 1 layer, seq 16, ffn seq 64)")
    return parser


def _variants(scenario: str):
    """(variant name, float8 recipe or None, float8 all-gather?, precompute?) of one scenario."""
    parallel, model_name = scenario.split()
    out = [("bf16", None, False, False), ("float8", "tensorwise", False, False)]
    if parallel in ("fsdp", "2d"):
        out += [("float8+fp8-ag", "tensorwise", True, False)]
    if parallel in ("fsdp", "2d") and model_name != "ffn":
        out += [("float8+fp8-ag+precompute", "tensorwise", True, True),
                (FP8_RS, "tensorwise", True, True)]
    if parallel in ("tp", "2d"):  # block scales: no amax collective, scales on the wire
        out += [("mxfp8", "mxfp8", False, False), ("blockwise", "blockwise", False, False)]
    if scenario == "tp ffn":  # Float8LinearConfig.sp_grad_weight's other choices
        out += [(f"{r}+{mode}", r, False, False) for mode in SP_GRAD_WEIGHT
                for r in ("mxfp8", "blockwise")]
    if parallel == "2d":  # square weight blocks all-gathered in float8 by FSDP2
        out += [("mxfp8_square_weights+fp8-ag", "mxfp8_square_weights", True, False),
                ("blockwise+fp8-ag", "blockwise", True, False)]
    return out


class ResidualFFNs(nn.Module):
    """``x + ffn(x)`` for each SwiGLU FFN of ``layers``: the ffn scenarios' model."""

    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(FeedForward(dim, 2 * dim) for _ in range(layers))

    def forward(self, x):
        for ffn in self.layers:
            x = x + ffn(x)  # [B, S, dim] (sequence-sharded under SP)
        return x


def _ffn_tp_plan(model: ResidualFFNs, float8: bool) -> dict:
    """Sequence parallel FFNs: one all-gather of each FFN's input (in float8 with ``float8``),
    w1/w3 colwise, w2 rowwise reduce-scattered back to sequence shards."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    from f8dist.parallel.tp import Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput

    layouts = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = {}
    for i in range(len(model.layers)):
        p = f"layers.{i}"
        if float8:
            plan[p] = PrepareFloat8ModuleInput(fwd_config_submodule_fqn="w1", **layouts)
            col, row = Float8ColwiseParallel, Float8RowwiseParallel
        else:
            plan[p] = PrepareModuleInput(**layouts)
            col, row = ColwiseParallel, RowwiseParallel
        plan.update({f"{p}.w1": col(), f"{p}.w3": col(), f"{p}.w2": row(output_layouts=Shard(1))})
    return plan


def _build(scenario: str, args, recipe, fp8_ag: bool, mesh, sp_grad_weight="forward_gather"):
    """A fresh model laid out for ``scenario``, and its input factory."""
    parallel, model_name = scenario.split()
    device = mesh.device_type
    float8 = recipe is not None
    torch.manual_seed(0)
    if model_name == "mlp":
        model = nn.Sequential(*[nn.Linear(args.dim, args.dim, bias=False) for _ in range(4)])
        tokens = torch.randn(args.batch * args.seq, args.dim)
    elif model_name == "ffn":
        model = ResidualFFNs(args.ffn_dim, args.layers)
        tokens = torch.randn(args.batch, args.ffn_seq // mesh["tp"].size(), args.ffn_dim)  # SP shard
    else:
        margs = ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=4, multiple_of=64,
                          max_seq_len=args.seq)
        model = Transformer(margs)
        model.init_weights(seed=0)
        tokens = torch.randint(0, margs.vocab_size, (args.batch, args.seq))
    model, tokens = model.to(device), tokens.to(device)
    if float8:
        config = Float8LinearConfig.from_recipe_name(recipe).replace(
            enable_fsdp_float8_all_gather=fp8_ag, sp_grad_weight=sp_grad_weight)
        convert_to_float8_training(model, config=config,
                                   module_filter_fn=lambda mod, fqn: fqn != "output",
                                   skip_incompatible=recipe not in BLOCK_RECIPES)
    if parallel in ("tp", "2d") and model_name == "ffn":
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, mesh["tp"], _ffn_tp_plan(model, float8))
    elif parallel in ("tp", "2d"):
        parallelize_llama(model, mesh["tp"], float8=float8)
    if parallel == "tp":
        model = model.to(torch.bfloat16)
        tokens = tokens.bfloat16() if tokens.is_floating_point() else tokens
    if parallel in ("fsdp", "2d"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dp_mesh = mesh["dp"]
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for child in (model if model_name == "mlp" else
                      model.layers if model_name == "ffn" else model.layers.values()):
            fully_shard(child, mesh=dp_mesh, mp_policy=mp)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    return model, tokens


def _loss(model, tokens):
    out = model(tokens)
    if tokens.dtype != torch.long:  # mlp, ffn: activations in, activations out
        return out.float().square().mean()
    return F.cross_entropy(out.flatten(0, 1).float(), tokens.flatten())  # [B * S, vocab]


def measure(scenario: str, variant, args, mesh) -> tuple:
    """Forward and whole-step counts of one training step (after one uncounted warm-up step)."""
    name, recipe, fp8_ag, precompute = variant
    model, tokens = _build(scenario, args, recipe, fp8_ag, mesh, sp_grad_weight_of(name))
    if name == FP8_RS:
        from f8dist.parallel.fsdp import enable_float8_reduce_scatter

        enable_float8_reduce_scatter(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad()
        with count_collectives() as fwd:
            loss = _loss(model, tokens)
        loss.backward()
        opt.step()
        if precompute:
            from f8dist.parallel.fsdp import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)
        return fwd

    step()  # FSDP2's lazy init and the first precompute happen here, uncounted
    with count_collectives() as whole:
        fwd = step()
    return fwd, whole


def run(args) -> list:
    from torch.distributed.device_mesh import init_device_mesh

    cuda = one_gpu_per_rank()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if args.smoke:
        args.dim, args.layers, args.seq, args.ffn_dim, args.ffn_seq = 64, 1, 16, 64, 64
    world = dist.get_world_size()
    device = "cuda" if cuda else "cpu"
    if world % 2:
        raise SystemExit(f"bench_comm needs an even number of ranks (TP over 2), got {world}")
    meshes = {
        "fsdp": init_device_mesh(device, (world,), mesh_dim_names=("dp",)),
        "tp": init_device_mesh(device, (world,), mesh_dim_names=("tp",)),
        "2d": init_device_mesh(device, (world // 2, 2), mesh_dim_names=("dp", "tp")),
    }

    rows = []
    for scenario in args.scenarios:
        parallel = scenario.split()[0]
        baseline, baseline_input = {}, {}
        for variant in _variants(scenario):
            name, _, fp8_ag, _ = variant
            if fp8_ag and not HAS_FSDP_FLOAT8:
                rows.append({"scenario": scenario, "variant": name, "note": PENDING})
                continue
            try:
                fwd, whole = measure(scenario, variant, args, meshes[parallel])
            except ValueError as e:  # blocks the model's dims or shards would split
                if recipe_of(variant) not in BLOCK_RECIPES or "blocks" not in str(e):
                    raise
                rows.append({"scenario": scenario, "variant": name, "note": SPLIT})
                continue
            for kind, stats in whole.as_dict().items():
                if name == "bf16":
                    baseline[kind] = stats["output_bytes"]
                    baseline_input[kind] = stats["input_bytes"]
                base = baseline.get(kind)
                ratio = stats["output_bytes"] / base if base else None
                rs_wire = name == FP8_RS and kind == "all_to_all"
                if rs_wire:  # vs the reduce-scatters it replaced (TP's stay, under 2-D)
                    replaced = baseline_input["reduce_scatter"] - whole["reduce_scatter"].input_bytes
                    ratio = stats["input_bytes"] / replaced
                rows.append({
                    "scenario": scenario, "variant": name, "kind": kind,
                    "fwd_calls": fwd[kind].calls, "fwd_bytes": fwd[kind].output_bytes,
                    "step_calls": stats["calls"], "step_bytes": stats["output_bytes"],
                    "bytes_vs_bf16": ratio, "note": RS_NOTE if rs_wire else "",
                })
    if dist.get_rank() == 0:
        title = (f"Collectives per training step on rank 0 of {world} "
                 f"(dim {args.dim}, {args.layers} layers, batch {args.batch} x seq {args.seq})")
        report(rows, COLUMNS, title=title, device=device, csv_path=args.csv)
    return rows


def main(argv=None) -> list:
    args = add_args(argparse.ArgumentParser(description=__doc__.split("\n")[0])).parse_args(argv)
    return run(args)


if __name__ == "__main__":
    with exit_cleanly():  # [Note: gloo teardown] in scripts/teardown.py
        main()
