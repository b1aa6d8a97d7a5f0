"""Count the collectives of one training step (forward, backward, optimizer step and, where used,
the FSDP scale precompute) per kind, on rank 0, with f8dist's collective counter
(``f8dist.testing.count_collectives``), for bf16 and float8 under FSDP2, TP+SP and 2-D FSDP x TP.

Run with torchrun (gloo on CPU, nccl on GPU); 4 ranks give a 2 x 2 mesh for 2-D:

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD torchrun --standalone --nproc_per_node=4 \\
        scripts/bench_comm.py --csv docs/bench/comm_cpu.csv

Scenarios (every float8 variant uses the tensorwise recipe):
  fsdp mlp     a stack of linears only, so the all-gather ratio is the float8 weights' own
  fsdp llama   the LLaMA-style model (embedding, norms, output projection stay high precision)
  tp llama     TP+SP with f8dist's float8 styles (activations all-gathered in float8)
  2d llama     FSDP2 over dp x TP+SP over tp
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
from f8dist.models.llama import ModelArgs, Transformer  # noqa: E402
from f8dist.models import parallelize_llama  # noqa: E402

COLUMNS = [
    "scenario", "variant", "kind", "fwd_calls", "fwd_bytes", "step_calls", "step_bytes",
    "bytes_vs_bf16", "note",
]
SCENARIOS = ["fsdp mlp", "fsdp llama", "tp llama", "2d llama"]
HAS_FSDP_FLOAT8 = importlib.util.find_spec("f8dist.fsdp") is not None
FP8_RS = "float8+fp8-ag+precompute+fp8-rs"
RS_NOTE = "input bytes / those of the fp32 FSDP reduce-scatters it replaced"
PENDING = "pending: f8dist.fsdp (FSDP2 float8 all-gather) is not in this checkout"


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--dim", type=int, default=128, help="model width")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=SCENARIOS)
    parser.add_argument("--csv", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny model (dim 64, 1 layer, seq 16)")
    return parser


def _variants(parallel: str):
    """(variant name, float8?, float8 all-gather?, precompute?) of one parallelism."""
    out = [("bf16", False, False, False), ("float8", True, False, False)]
    if parallel in ("fsdp", "2d"):
        out += [("float8+fp8-ag", True, True, False), ("float8+fp8-ag+precompute", True, True, True),
                (FP8_RS, True, True, True)]
    return out


def _build(scenario: str, args, float8: bool, fp8_ag: bool, mesh):
    """A fresh model laid out for ``scenario``, and its input factory."""
    parallel, model_name = scenario.split()
    device = mesh.device_type
    torch.manual_seed(0)
    if model_name == "mlp":
        model = nn.Sequential(*[nn.Linear(args.dim, args.dim, bias=False) for _ in range(4)])
        tokens = torch.randn(args.batch * args.seq, args.dim)
    else:
        margs = ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=4, multiple_of=64,
                          max_seq_len=args.seq)
        model = Transformer(margs)
        model.init_weights(seed=0)
        tokens = torch.randint(0, margs.vocab_size, (args.batch, args.seq))
    model, tokens = model.to(device), tokens.to(device)
    if float8:
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_ag)
        convert_to_float8_training(model, config=config,
                                   module_filter_fn=lambda mod, fqn: fqn != "output")
    if parallel in ("tp", "2d"):
        parallelize_llama(model, mesh["tp"], float8=float8)
    if parallel == "tp":
        model = model.to(torch.bfloat16)
    if parallel in ("fsdp", "2d"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dp_mesh = mesh["dp"]
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for child in (model if model_name == "mlp" else model.layers.values()):
            fully_shard(child, mesh=dp_mesh, mp_policy=mp)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    return model, tokens


def _loss(model, tokens):
    out = model(tokens)
    if tokens.dtype != torch.long:  # the mlp: activations in, activations out
        return out.float().square().mean()
    return F.cross_entropy(out.flatten(0, 1).float(), tokens.flatten())  # [B * S, vocab]


def measure(scenario: str, variant, args, mesh) -> tuple:
    """Forward and whole-step counts of one training step (after one uncounted warm-up step)."""
    name, float8, fp8_ag, precompute = variant
    model, tokens = _build(scenario, args, float8, fp8_ag, mesh)
    if name == FP8_RS:
        from f8dist.fsdp import enable_float8_reduce_scatter

        enable_float8_reduce_scatter(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad()
        with count_collectives() as fwd:
            loss = _loss(model, tokens)
        loss.backward()
        opt.step()
        if precompute:
            from f8dist.fsdp import precompute_float8_dynamic_scale_for_fsdp

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
        args.dim, args.layers, args.seq = 64, 1, 16
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
        for variant in _variants(parallel):
            name, _, fp8_ag, _ = variant
            if fp8_ag and not HAS_FSDP_FLOAT8:
                rows.append({"scenario": scenario, "variant": name, "note": PENDING})
                continue
            fwd, whole = measure(scenario, variant, args, meshes[parallel])
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
