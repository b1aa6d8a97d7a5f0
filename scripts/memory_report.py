"""Bytes kept for backward and peak bytes of a fwd+bwd: bf16 vs each float8 recipe, without and
with ``float8_activations_for_backward`` ("f8 act" off / on; on+rc: also
``recompute_swiglu_product``; on+rc+n: also ``recompute_norm_output``), plain, under
``float8_sac_context_fn`` (SAC)
and under full activation checkpointing (full AC), for a SwiGLU FFN and a LLaMA-style
transformer block.

    PYTHONPATH=. python scripts/memory_report.py                    # CPU, small shapes
    PYTHONPATH=. python scripts/memory_report.py --device cuda --dim 4096 --seq 8192
    PYTHONPATH=. python scripts/memory_report.py --dim 384 --recipes blockwise  # 128-wide blocks

kept: bytes allocated in the forward still alive at its end, output excluded (input included:
it stands for the previous layer's output); scales: the part of kept made by amax reductions;
peak: most bytes alive at once over fwd+bwd (CPU: live storages, see f8dist/testing/memory.py; CUDA:
also torch.cuda.max_memory_allocated). --compiled adds what torch.compile's partitioner saves for
backward (f8dist.testing.compiled_saved_bytes; input included, parameters excluded). The last section compares the two axiswise choices for the
grad_weight input (keep high precision, cast in forward with f8 act, requantize the float8
forward copy), and "f8 act" on the FFN's gradients (SQNR against fp32): the SwiGLU inputs it
keeps in float8 (f8dist/nn/swiglu.py) are the only numerics it changes.
"""

from __future__ import annotations

import argparse
import copy

import torch

from torch.utils.checkpoint import noop_context_fn

from bench_common import check_device
from f8dist import Float8LinearConfig, convert_to_float8_training, float8_sac_context_fn
from f8dist.config.recipe_names import Float8LinearRecipeName
from f8dist.core.gemm import block_problems
from f8dist.testing import compiled_saved_bytes, measure_fwd_bwd
from f8dist.models.llama import FeedForward, ModelArgs, TransformerBlock, precompute_rope

# bf16, then every recipe (one list: f8dist/config/recipe_names.py)
RECIPES = ["bf16", *(name.value for name in Float8LinearRecipeName)]
# the "f8 act" column: float8_activations_for_backward off, on, on with recompute_swiglu_product,
# and with recompute_norm_output too
MODES = {"off": {"float8_activations_for_backward": False},
         "on": {"float8_activations_for_backward": True},
         "on+rc": {"float8_activations_for_backward": True, "recompute_swiglu_product": True},
         "on+rc+n": {"float8_activations_for_backward": True, "recompute_swiglu_product": True,
                     "recompute_norm_output": True}}


def build(kind: str, args: ModelArgs, device, dtype):
    torch.manual_seed(0)
    if kind == "ffn":
        return FeedForward(args.dim, args.ffn_hidden_dim).to(device, dtype), ()
    rope = precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta).to(device)
    return TransformerBlock(0, args).to(device, dtype), (rope,)


def convert(module, config):
    module = copy.deepcopy(module)
    if config is not None:
        convert_to_float8_training(module, config=config)
    return module


def configs(args: ModelArgs, recipes=tuple(RECIPES[1:]), keep_weight=False):
    """(recipe, f8 act, config) rows: bf16, then each recipe in each of MODES; a block-scaled
    recipe whose blocks the model's dims do not divide into is left out, said so.
    ``keep_weight``: with ``float8_weight_for_backward`` (recipes whose weight casts allow it)."""
    yield "bf16", "off", None
    for recipe in recipes:
        config = Float8LinearConfig.from_recipe_name(recipe)
        bad = block_problems(config.cast_specs(), args.dim, args.ffn_hidden_dim)
        if bad:
            print(f"# {recipe}: left out, {', '.join(bad)}; try --dim 128")
            continue
        if keep_weight:
            if not config.cast_specs().weight_same_bytes:
                print(f"# {recipe}: left out, its two weight casts differ")
                continue
            config = config.replace(float8_weight_for_backward=True)
        for mode, change in MODES.items():
            yield recipe, mode, config.replace(**change)


def report(kind, args, x, device, dtype, compiled=False, recipes=tuple(RECIPES[1:]),
           keep_weight=False):
    base, extra = build(kind, args, device, dtype)
    cuda = x.is_cuda
    head = (f"{'model':6} {'recipe':19} {'f8 act':7} {'plain kept':>11} {'ratio':>6} "
            f"{'plain peak':>11} {'SAC kept':>10} {'scales':>7} {'ratio':>6} {'SAC peak':>10} "
            f"{'full AC kept':>12} {'ratio':>6}")
    if cuda:
        head += f" {'cuda peak plain':>15} {'cuda peak SAC':>14}"
    if compiled:
        head += f" {'compiled plain':>14} {'ratio':>6} {'compiled SAC':>12}"
    print(head)
    ref = {}
    for recipe, on, config in configs(args, recipes, keep_weight):
        module = convert(base, config)
        plain = measure_fwd_bwd(module, x, *extra)
        sac = measure_fwd_bwd(module, x, *extra, context_fn=float8_sac_context_fn)
        full = measure_fwd_bwd(module, x, *extra, context_fn=noop_context_fn)
        saved = [
            compiled_saved_bytes(module, x, *extra, context_fn=fn)
            for fn in (None, float8_sac_context_fn)
        ] if compiled else []
        if recipe == "bf16":
            ref = {"plain": plain.kept_bytes, "sac": sac.kept_bytes, "full": full.kept_bytes,
                   "compiled": saved[0] if saved else None}
        line = (
            f"{kind:6} {recipe:19} {on:7} {plain.kept_bytes:11d} "
            f"{plain.kept_bytes / ref['plain']:6.3f} {plain.peak_bytes:11d} {sac.kept_bytes:10d} "
            f"{sac.scale_bytes:7d} {sac.kept_bytes / ref['sac']:6.3f} {sac.peak_bytes:10d} "
            f"{full.kept_bytes:12d} {full.kept_bytes / ref['full']:6.3f}"
        )
        if cuda:
            line += f" {plain.cuda_peak_bytes:15d} {sac.cuda_peak_bytes:14d}"
        if compiled:
            line += f" {saved[0]:14d} {saved[0] / ref['compiled']:6.3f} {saved[1]:12d}"
        print(line)


def _sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    return (20 * torch.log10(ref.norm() / (ref - x.float()).norm())).item()


def _grad_sqnr(ref, xf, module, x):
    """min SQNR over the weight gradients, and the input gradient's, against the fp32 run."""
    for p in module.parameters():
        p.grad = None
    xi = x.detach().clone().requires_grad_()
    module(xi).float().sum().backward()
    dw = min(_sqnr(r.grad, p.grad) for r, p in zip(ref.parameters(), module.parameters()))
    return dw, _sqnr(xf.grad, xi.grad)


def axiswise_choices(args, x, device):
    """grad SQNR (vs fp32) and kept bytes of rowwise's three grad_weight inputs, on the FFN."""
    ref, _ = build("ffn", args, device, torch.float32)
    xf = x.float().detach().requires_grad_()
    ref(xf).sum().backward()
    print(f"{'rowwise grad_weight input':26} {'pow2 scales':>11} {'kept':>8} "
          f"{'SQNR dW min (dB)':>16} {'SQNR dx (dB)':>12}")
    for pow2 in (True, False):
        rowwise = Float8LinearConfig.from_recipe_name("rowwise").replace(
            round_scales_to_power_of_2=pow2
        )
        for name, change in (
            ("high precision (default)", {}),
            ("f8 act (SwiGLU too)", {"float8_activations_for_backward": True}),
            ("requantized float8", {"axiswise_requantize_input_for_grad_weight": True}),
        ):
            module = convert(ref, rowwise.replace(**change)).to(x.dtype)
            dw, dx = _grad_sqnr(ref, xf, module, x)
            kept = measure_fwd_bwd(module, x).kept_bytes
            print(f"{name:26} {str(pow2):>11} {kept:8d} {dw:16.2f} {dx:12.2f}")


def swiglu_fit(args, x, device, recipes=tuple(RECIPES[1:]), keep_weight=False):
    """What keeping SwiGLU's inputs in float8 costs: FFN gradient SQNR vs fp32, f8 act off/on
    (the linears' gradients are the same either way: only the SwiGLU changes)."""
    ref, _ = build("ffn", args, device, torch.float32)
    xf = x.float().detach().requires_grad_()
    ref(xf).sum().backward()
    print(f"{'FFN gradients vs fp32':26} {'f8 act':7} {'SQNR dW min (dB)':>16} "
          f"{'SQNR dx (dB)':>12}")
    for recipe, on, config in configs(args, recipes, keep_weight):
        dw, dx = _grad_sqnr(ref, xf, convert(ref, config).to(x.dtype), x)
        print(f"{recipe:26} {on:7} {dw:16.2f} {dx:12.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compiled", action="store_true",
                        help="add the bytes torch.compile saves for backward (aot_eager partition)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--recipes", type=lambda s: tuple(s.split(",")), default=tuple(RECIPES[1:]),
                        help="comma-separated float8 recipes to report after bf16 (default: all)")
    parser.add_argument("--float8-weight-for-backward", action="store_true",
                        help="keep the forward's float8 weight for backward (recipes that allow it)")
    opts = parser.parse_args()
    check_device(opts.device, parser.prog)
    dtype = getattr(torch, opts.dtype)
    args = ModelArgs(dim=opts.dim, n_heads=opts.n_heads, max_seq_len=max(opts.seq, 128))
    torch.manual_seed(1)
    x = torch.randn(opts.batch, opts.seq, opts.dim, device=opts.device, dtype=dtype)
    print(f"# dim={args.dim} ffn_hidden={args.ffn_hidden_dim} heads={args.n_heads} "
          f"tokens={opts.batch}x{opts.seq} {opts.dtype} {opts.device}; bytes; ratio = vs bf16")
    for kind in ("ffn", "block"):
        report(kind, args, x, opts.device, dtype, opts.compiled, opts.recipes,
               opts.float8_weight_for_backward)
    print()
    axiswise_choices(args, x, opts.device)
    print()
    swiglu_fit(args, x, opts.device, opts.recipes, opts.float8_weight_for_backward)


if __name__ == "__main__":
    main()
