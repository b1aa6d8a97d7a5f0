"""Float8 mixture-of-experts figures for docs/moe.md.

1. SQNR of the three grouped gemms of one expert layer per recipe, float8 against the bf16 grouped
   gemm (``torch._grouped_mm``) on the same gaussian data, in dB (both against float32 too);
   uneven token groups, one expert without tokens.
2. Under torchrun (2+ ranks): the bytes each rank's token dispatch sends, by the collective
   counter (``f8dist.testing.count_collectives``), float8 dispatch against bf16 dispatch, for an
   expert-parallel MoE layer at several model dims; and that both give the same outputs.

::

    PYTHONPATH=$PWD python scripts/moe_report.py
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 scripts/moe_report.py

The loss table comes from scripts/compare_loss.py with train.py's MoE flags (docs/moe.md).
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist

from f8dist import Float8LinearConfig, convert_to_float8_training
from f8dist.grouped import float8_grouped_mm, grouped_mm
from f8dist.numerics import sqnr
from f8dist.testing import count_collectives

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _fwd_bwd(fn, x, w, offsets, grad):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = fn(x, w, offsets)
    out.backward(grad.to(out.dtype))
    return out, x.grad, w.grad


def sqnr_table(tokens: int, experts: int, k: int, n: int) -> str:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, k, generator=g)
    w = torch.randn(experts, n, k, generator=g) * k ** -0.5
    grad = torch.randn(tokens, n, generator=g)
    sizes = torch.rand(experts, generator=g)
    sizes[1] = 0  # an expert without tokens
    counts = (sizes / sizes.sum() * tokens).floor().long()
    counts[-1] += tokens - counts.sum()
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    fp32 = _fwd_bwd(grouped_mm, x, w, offsets, grad)
    bf16 = _fwd_bwd(grouped_mm, x.bfloat16(), w.bfloat16(), offsets, grad.bfloat16())
    rows = [f"grouped gemm: {experts} experts x [{n}, {k}], {tokens} tokens in groups "
            f"{counts.tolist()}, gaussian, seed 0, torch {torch.__version__}, cpu", "",
            "| recipe | gemm | float8 vs bf16 grouped gemm (dB) | float8 vs fp32 (dB) | "
            "bf16 vs fp32 (dB) |", "|---|---|---|---|---|"]
    for recipe in RECIPES:
        specs = Float8LinearConfig.from_recipe_name(recipe).grouped_cast_specs("experts.w1")
        f8 = _fwd_bwd(lambda a, b, o: float8_grouped_mm(a, b, o, specs), x.bfloat16(),
                      w.bfloat16(), offsets, grad.bfloat16())
        for gemm, ref, hp, ours in zip(("output", "grad_input", "grad_weight"), fp32, bf16, f8):
            rows.append(f"| {recipe} | {gemm} | {sqnr(hp, ours):.1f} | {sqnr(ref, ours):.1f} | "
                        f"{sqnr(ref, hp):.1f} |")
    return "\n".join(rows)


def dispatch_bytes(dims, tokens: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    import f8dist.dispatch as dispatch
    from f8dist.models.moe import MoE, MoEArgs
    from f8dist.models.moe_parallel import parallelize_moe

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    sent = {}
    tokens_of = dispatch._all_to_all_tokens

    def counted(x, send, recv, group):  # the dispatch's all-to-alls only
        with count_collectives() as counts:
            out = tokens_of(x, send, recv, group)
        sent["bytes"] += counts["all_to_all"].input_bytes
        return out

    dispatch._all_to_all_tokens = counted
    rows = [f"token dispatch of an expert-parallel MoE layer (rowwise, {2 * world} experts, "
            f"top-2, {tokens} tokens per rank, {world} ranks): bytes rank 0 sends per forward",
            "", "| dim | bf16 dispatch | float8 dispatch | float8 / bf16 | outputs equal |",
            "|---|---|---|---|---|"]
    try:
        for dim in dims:
            moe = MoE(dim, dim, MoEArgs(num_experts=2 * world, top_k=2, shared_expert=False))
            moe.init_weights(0.02, torch.Generator().manual_seed(0))
            moe.to(torch.bfloat16)
            convert_to_float8_training(moe, config=Float8LinearConfig.from_recipe_name("rowwise"))
            x = torch.randn(1, tokens, dim, generator=torch.Generator().manual_seed(1 + rank))
            result = {}
            for fd in (False, True):
                layer = parallelize_moe(copy.deepcopy(moe), mesh, float8_dispatch=fd)
                sent["bytes"] = 0
                with torch.no_grad():
                    out = layer(x.bfloat16())
                result[fd] = (sent["bytes"], out)
            (hp, out_hp), (f8, out_f8) = result[False], result[True]
            rows.append(f"| {dim} | {hp:,} | {f8:,} | {f8 / hp:.3f} | "
                        f"{torch.equal(out_hp, out_f8)} |")
    finally:
        dispatch._all_to_all_tokens = tokens_of
    return "\n".join(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--in-features", type=int, default=512)
    p.add_argument("--out-features", type=int, default=256)
    p.add_argument("--dispatch-dims", default="64,256,1024")
    p.add_argument("--dispatch-tokens", type=int, default=256)
    args = p.parse_args()
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    if not distributed or dist.get_rank() == 0:
        print(sqnr_table(args.tokens, args.experts, args.in_features, args.out_features), "\n")
    if distributed:
        table = dispatch_bytes([int(d) for d in args.dispatch_dims.split(",")],
                               args.dispatch_tokens)
        if dist.get_rank() == 0:
            print(table)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
