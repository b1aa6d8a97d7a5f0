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
4. Under torchrun: the float8 combine and backward ([Note: float8 combine and backward] in
   f8dist/parallel/ep/dispatch.py): SQNR of an expert-parallel MoE layer's output and gradients
   against one fp32 device, with each combination of the options, and the bytes of each of
   rank 0's all-to-alls in a training step.

::

    PYTHONPATH=$PWD python scripts/moe_report.py
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 scripts/moe_report.py

The loss table comes from scripts/compare_loss.py with train.py's MoE flags (docs/moe.md).
"""

from __future__ import annotations

import argparse
import contextlib
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


def _sqnr_over_ranks(ref: torch.Tensor, x: torch.Tensor) -> float:
    """SQNR in dB of the ranks' pieces ``x`` of a tensor against theirs of ``ref``, over all."""
    ref, x = ref.detach().double(), x.detach().double()
    powers = torch.stack([ref.square().sum(), (ref - x).square().sum()])
    dist.all_reduce(powers)
    return (10 * torch.log10(powers[0] / powers[1])).item()


class _BytesPerAllToAll:
    """Counts the bytes each of the EP all-to-alls sends on this rank (the dispatch's and the
    combine's autograd functions wrapped while it is active)."""

    STEPS = (("_Dispatch", "forward", "dispatch"), ("_Combine", "forward", "combine"),
             ("_Combine", "backward", "combine grad"), ("_Dispatch", "backward", "dispatch grad"))

    def __enter__(self):
        import f8dist.parallel.ep.dispatch as dispatch

        self.bytes, self.saved = {name: 0 for *_, name in self.STEPS}, []
        for cls_name, method, name in self.STEPS:
            cls = getattr(dispatch, cls_name)
            fn = getattr(cls, method)
            self.saved.append((cls, method, fn))
            setattr(cls, method, staticmethod(self._counted(fn, name)))
        return self

    def _counted(self, fn, name):
        def counted(*args):
            with count_collectives() as counts:
                out = fn(*args)
            self.bytes[name] += counts["all_to_all"].input_bytes
            return out
        return counted

    def __exit__(self, *exc):
        for cls, method, fn in self.saved:
            setattr(cls, method, staticmethod(fn))


# (float8_combine, float8_backward, the gradients' float8 dtype: f8dist's e4m3, or e5m2)
COMBINE_OPTIONS = ((False, False, None), (True, False, None), (False, True, "e4m3"),
                   (True, True, "e4m3"), (False, True, "e5m2"), (True, True, "e5m2"))


@contextlib.contextmanager
def _grad_dtype(name):
    """The float8 backward's gradients cast as ``name``: e5m2 where ``GRAD_SPEC`` says e4m3, to
    measure the choice ([Note: float8 combine and backward])."""
    import dataclasses

    import f8dist.parallel.ep.style as style

    spec = style.GRAD_SPEC
    if name == "e5m2":
        style.GRAD_SPEC = dataclasses.replace(spec, dtype=torch.float8_e5m2)
    try:
        yield
    finally:
        style.GRAD_SPEC = spec


def combine_tables(dim: int, hidden: int, experts: int, tokens: int) -> str:
    """SQNR with and without the float8 combine and backward, and the bytes of each all-to-all."""
    from torch.distributed.device_mesh import init_device_mesh

    from f8dist.models.moe import MoE, MoEArgs
    from f8dist.models.moe_parallel import parallelize_moe

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    base = MoE(dim, hidden, MoEArgs(num_experts=experts, top_k=2, shared_expert=False))
    base.init_weights(0.02, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, world * tokens, dim, generator=g)
    grad = torch.randn(1, world * tokens, dim, generator=g)
    mine, local = slice(rank * tokens, (rank + 1) * tokens), slice(
        rank * experts // world, (rank + 1) * experts // world)
    ref, x_ref = copy.deepcopy(base), x.clone().requires_grad_()  # one fp32 device, whole batch
    out_ref = ref(x_ref)
    out_ref.backward(grad)
    names = ("w1", "w2", "w3")
    ref_experts = torch.cat([getattr(ref.experts, w).grad[local].flatten() for w in names])
    title = (f"an expert-parallel MoE layer (dim {dim}, {experts} experts of hidden {hidden}, "
             f"top-2, {tokens} gaussian tokens per rank, {world} ranks, bf16) against one fp32 "
             f"device, torch {torch.__version__}, cpu")
    sqnr_rows = [title, "", "| experts | float8 combine | float8 backward | output (dB) | "
                 "input grad (dB) | experts' weight grads (dB) | router grad (dB) |",
                 "|---|---|---|---|---|---|---|"]
    byte_rows = ["bytes rank 0 sends per training step, same layer", "",
                 "| experts | dispatch | combine | backward | counts | dispatch | combine | "
                 "combine grad | dispatch grad | step | step / bf16 |",
                 "|---|---|---|---|---|---|---|---|---|---|---|"]
    bf16_step = None
    for recipe in (None, "rowwise", "mxfp8"):
        # bf16 experts dispatch bf16 either way; rowwise: today's bf16 dispatch too
        options = [(recipe is not None, *o) for o in COMBINE_OPTIONS]
        if recipe == "rowwise":
            options.insert(0, (False, False, False, None))
        for fd, fc, fb, grad_dtype in options:
            moe = copy.deepcopy(base).to(torch.bfloat16)
            if recipe is not None:
                convert_to_float8_training(moe, config=Float8LinearConfig.from_recipe_name(recipe))
            parallelize_moe(moe, mesh, float8_dispatch=fd, float8_combine=fc, float8_backward=fb)
            xi = x[:, mine].bfloat16().requires_grad_()
            with _grad_dtype(grad_dtype), count_collectives() as counts, \
                    _BytesPerAllToAll() as each:
                o = moe(xi)
                o.backward(grad[:, mine].bfloat16())
            step = counts["all_to_all"].input_bytes
            moved = sum(each.bytes.values())
            bf16_step = step if bf16_step is None else bf16_step
            gate = moe.router.gate.grad.clone()
            dist.all_reduce(gate)
            ours = torch.cat([getattr(moe.experts, w).grad.to_local().flatten() for w in names])
            label = recipe or "bf16"
            if fd == (recipe is not None):
                figures = (_sqnr_over_ranks(out_ref[:, mine], o),
                           _sqnr_over_ranks(x_ref.grad[:, mine], xi.grad),
                           _sqnr_over_ranks(ref_experts, ours), sqnr(ref.router.gate.grad, gate))
                sqnr_rows.append(f"| {label} | {fc} | {grad_dtype or False} | "
                                 + " | ".join(f"{f:.1f}" for f in figures) + " |")
            if grad_dtype == "e5m2":  # the same bytes as e4m3
                continue
            byte_rows.append(
                f"| {label} | {'float8' if fd else 'bf16'} | {'float8' if fc else 'bf16'} | "
                f"{'float8' if fb else 'bf16'} | {step - moved:,} | "
                + " | ".join(f"{each.bytes[name]:,}" for *_, name in _BytesPerAllToAll.STEPS)
                + f" | {step:,} | {step / bf16_step:.3f} |")
    return "\n".join(sqnr_rows) + "\n\n" + "\n".join(byte_rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--in-features", type=int, default=512)
    p.add_argument("--out-features", type=int, default=256)
    p.add_argument("--dispatch-dims", default="64,256,1024")
    p.add_argument("--dispatch-tokens", type=int, default=256)
    p.add_argument("--combine-dim", type=int, default=256)
    p.add_argument("--combine-experts", type=int, default=8)
    p.add_argument("--combine-tokens", type=int, default=512)
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
        table += "\n\n" + combine_tables(args.combine_dim, 2 * args.combine_dim,
                                          args.combine_experts, args.combine_tokens)
        if dist.get_rank() == 0:
            print(table)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
