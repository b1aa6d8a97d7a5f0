"""Float8 mixture-of-experts figures for docs/moe.md.

1. SQNR of the three grouped gemms of one expert layer per recipe, float8 against the bf16 grouped
   gemm (``torch._grouped_mm``) on the same gaussian data, in dB (both against float32 too);
   uneven token groups, one expert without tokens.
2. The MXFP8 grouped gemms against torchao's emulated MXFP8 grouped gemm
   (``torchao.prototype.moe_training``, ``KernelPreference.EMULATED``, which runs on the CPU) on
   the same tensors: SQNR between the two per gemm and whether they are bit-identical, with token
   groups that are multiples of 32 and uneven ones (torchao with and without padding its groups).
3. Under torchrun (2+ ranks): the bytes each rank's token dispatch sends, by the collective
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
from f8dist.nn.grouped import float8_grouped_mm, grouped_mm
from f8dist.core.numerics import sqnr
from f8dist.testing import count_collectives

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "mxfp8_wgrad_with_hp",
           "mxfp8_square_weights", "blockwise")


def _fwd_bwd(fn, x, w, offsets, grad):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = fn(x, w, offsets)
    out.backward(grad.to(out.dtype))
    return out, x.grad, w.grad


def _problem(tokens: int, experts: int, k: int, n: int):
    """x [T, K], w [E, N, K], grad [T, N] (gaussian, seed 0) and uneven token counts [E], one
    expert without tokens."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, k, generator=g)
    w = torch.randn(experts, n, k, generator=g) * k ** -0.5
    grad = torch.randn(tokens, n, generator=g)
    sizes = torch.rand(experts, generator=g)
    sizes[1] = 0  # an expert without tokens
    counts = (sizes / sizes.sum() * tokens).floor().long()
    counts[-1] += tokens - counts.sum()
    return x, w, grad, counts


def sqnr_table(tokens: int, experts: int, k: int, n: int) -> str:
    x, w, grad, counts = _problem(tokens, experts, k, n)
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


def torchao_table(tokens: int, experts: int, k: int, n: int) -> str:
    """f8dist's "mxfp8" grouped gemms against torchao's emulated MXFP8 grouped gemm."""
    import warnings

    from torchao.prototype.moe_training.config import KernelPreference
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm

    x, w, grad, uneven = _problem(tokens, experts, k, n)
    x, w, grad = x.bfloat16(), w.bfloat16(), grad.bfloat16()
    aligned = torch.full((experts,), tokens // experts)
    specs = Float8LinearConfig.from_recipe_name("mxfp8").grouped_cast_specs("experts.w1")
    rows = [f"f8dist \"mxfp8\" vs torchao {_torchao_version()} emulated MXFP8 grouped gemm "
            f"(KernelPreference.EMULATED, RCEIL), {experts} experts x [{n}, {k}], {tokens} tokens, "
            "bf16 operands, cpu", "",
            "| token groups | torchao pads groups | gemm | f8dist vs torchao (dB) | bit-identical | "
            "f8dist vs fp32 (dB) | torchao vs fp32 (dB) |", "|---|---|---|---|---|---|---|"]
    for label, counts in ((f"{tokens // experts} each", aligned), ("uneven, one empty", uneven)):
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        fp32 = _fwd_bwd(grouped_mm, x.float(), w.float(), offsets, grad.float())
        ours = _fwd_bwd(lambda a, b, o: float8_grouped_mm(a, b, o, specs), x, w, offsets, grad)
        for pad in (False, True):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                theirs = _fwd_bwd(lambda a, b, o: _to_mxfp8_then_scaled_grouped_mm(
                    a, b.transpose(-2, -1), o, out_dtype=torch.bfloat16,
                    kernel_preference=KernelPreference.EMULATED,
                    pad_token_groups_for_grouped_mm=pad), x, w, offsets, grad)
            for gemm, ref, a, b in zip(("output", "grad_input", "grad_weight"), fp32, ours, theirs):
                rows.append(f"| {label} | {pad} | {gemm} | {sqnr(b, a):.1f} | {torch.equal(a, b)} "
                            f"| {sqnr(ref, a):.1f} | {sqnr(ref, b):.1f} |")
    return "\n".join(rows)


def _torchao_version() -> str:
    import torchao

    return torchao.__version__


def dispatch_bytes(dims, tokens: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    import f8dist.parallel.ep.dispatch as dispatch
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
    rows = [f"token dispatch of an expert-parallel MoE layer ({2 * world} experts, "
            f"top-2, {tokens} tokens per rank, {world} ranks): bytes rank 0 sends per forward",
            "", "| recipe | dim | bf16 dispatch | float8 dispatch | float8 / bf16 | outputs equal |",
            "|---|---|---|---|---|---|"]
    try:
        for recipe, dim in ((r, d) for r in ("rowwise", "mxfp8") for d in dims):
            moe = MoE(dim, dim, MoEArgs(num_experts=2 * world, top_k=2, shared_expert=False))
            moe.init_weights(0.02, torch.Generator().manual_seed(0))
            moe.to(torch.bfloat16)
            convert_to_float8_training(moe, config=Float8LinearConfig.from_recipe_name(recipe))
            x = torch.randn(1, tokens, dim, generator=torch.Generator().manual_seed(1 + rank))
            result = {}
            for fd in (False, True):
                layer = parallelize_moe(copy.deepcopy(moe), mesh, float8_dispatch=fd)
                sent["bytes"] = 0
                with torch.no_grad():
                    out = layer(x.bfloat16())
                result[fd] = (sent["bytes"], out)
            (hp, out_hp), (f8, out_f8) = result[False], result[True]
            rows.append(f"| {recipe} | {dim} | {hp:,} | {f8:,} | {f8 / hp:.3f} | "
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
        print(sqnr_table(args.tokens, args.experts, args.in_features, args.out_features) + "\n")
        try:
            table = torchao_table(args.tokens, args.experts, args.in_features, args.out_features)
        except ImportError as e:  # torchao is optional: pip install --no-deps torchao==0.18.0
            table = f"(no torchao comparison: {e})"
        print(table + "\n")  # a blank line after a table, no space at the end of its last row
    if distributed:
        table = dispatch_bytes([int(d) for d in args.dispatch_dims.split(",")],
                               args.dispatch_tokens)
        if dist.get_rank() == 0:
            print(table)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
