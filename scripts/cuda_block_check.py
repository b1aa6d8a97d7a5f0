"""The block-scaled float8 gemm on CUDA against f8dist's exact CPU kernel, on the same float8 data.

Three kernels ([Note: the block-scaled gemm] and [Note: MXFP8 on CUDA] in f8dist/core/gemm.py):
DeepSeek's blocks (the ``"blockwise"`` recipe: 1x128 activations and gradients, 128x128 weights) on
sm90, and MXFP8 (the ``"mxfp8"`` recipes: 1x32 blocks with e8m0 scales, the weight in 1x32 blocks
or 32x32 tiles) on sm100+, and NVFP4 (the ``"nvfp4"`` recipe: e2m1 data in 1x16 blocks with e4m3
scales and a float32 tensor scale, 16x16 weight blocks; [Note: NVFP4 on CUDA]) on sm100+, dense
gemms only (grouped NVFP4 has no CUDA kernel f8dist wires up: the part checks that it raises naming
``emulate=True``). For each kernel the device runs, for each of the three gemm shapes of a linear
(output, grad_input, grad_weight with blocks along the tokens), each output dtype and
``use_fast_accum``, this prints the SQNR of CUDA's result against the CPU kernel on the same float8
bytes and scales, and against the high-precision product; then a ``Float8Linear`` with each recipe,
forward and backward, on CUDA against the same layer on the CPU, eager and compiled. A kernel the
device lacks is skipped with the reason f8dist's error gives (MXFP8 on an sm90 GPU; DeepSeek's
blocks on sm100). Other errors are printed per case. Exits non-zero if a supported case falls under
its floor, or a supported bfloat16 gemm or Float8Linear fails.

    python scripts/cuda_block_check.py [--csv OUT.csv]     # needs CUDA (sm90 or sm100+)
    python scripts/cuda_block_check.py --dry               # the CPU pieces: cases, CUDA arguments
"""

from __future__ import annotations

import argparse
import copy
import csv
import sys

import torch
import torch.nn as nn

from bench_common import cuda_missing
from f8dist import Float8LinearConfig, convert_to_float8_training
from f8dist.config import E8M0, ScaledMMConfig
from f8dist.core.cast import cast_to_float8
from f8dist.core.gemm import (
    _has_block_api, cuda_block_problem, cuda_nvfp4_args, float8_mm, kernel_block, scaled_mm,
)
from f8dist.core.numerics import sqnr
from f8dist.core.scaling import block_cast

E4M3 = torch.float8_e4m3fn
# floors: CUDA's kernel sums float8 products with fewer bits than the CPU kernel's float32
# ([Note: exact gemm floor] in tests/floors.py); a float8 gemm is ~28 dB from high precision
FLOOR_VS_CPU_KERNEL, FLOOR_VS_HP = 40.0, 25.0
# NVFP4 against high precision: e2m1 in 1x16 e4m3 blocks is about 17 dB per operand pair on
# gaussian data (tests/core/test_gemm.py holds the CPU kernel above 15)
FLOOR_NVFP4_VS_HP = 12.0


# each kernel: (its recipes, the weight's blocks per gemm (output, grad_input) per recipe, the
# activations' and gradients' contraction block, the scales' dtype)
KERNELS = {
    "deepseek": dict(recipes=["blockwise"], inner=128, scale_dtype=torch.float32,
                     weights={"blockwise": ((128, 128), (128, 128))}),
    "mxfp8": dict(recipes=["mxfp8", "mxfp8_square_weights", "mxfp8_wgrad_with_hp"], inner=32,
                  scale_dtype=E8M0,
                  weights={"mxfp8": ((1, 32), (32, 1)), "mxfp8_square_weights": ((32, 32),) * 2}),
    "nvfp4": dict(recipes=["nvfp4", "nvfp4_no_rht"]),  # its casts are the recipe's: nvfp4_cases
}


def skip_reason(kernel: str):
    """Why this device cannot run ``kernel`` (f8dist's own error), or None."""
    return cuda_block_problem(kernel, torch.cuda.get_device_capability(),
                              api=_has_block_api(kernel), rocm=torch.version.hip is not None)


def cast(x: torch.Tensor, block, scale_dtype=torch.float32):
    """(data, scale) with the scale kept in ``scale_dtype`` as a Float8Tensor keeps it."""
    data, scale = block_cast(x, block, E4M3, scale_dtype=scale_dtype)
    return data, scale.to(scale_dtype)


def gemm_cases(m: int, k: int, n: int, device: str, kernel: str = "deepseek"):
    """(name, a_data, a_scale, a_block, b_data, b_scale, b_block, high-precision a @ b) for the
    three gemms of a linear with ``kernel``'s blocks, each weight blocking of its recipes."""
    spec = KERNELS[kernel]
    inner, sd = spec["inner"], spec["scale_dtype"]
    row = (1, inner)
    x = torch.randn(m, k, device=device)  # [M, K] tokens x in_features
    w = torch.randn(n, k, device=device)  # [N, K]
    go = torch.randn(m, n, device=device)  # [M, N]
    xd, xs = cast(x, row, sd)
    god, gos = cast(go, row, sd)
    gotd, gots = cast(go.t().contiguous(), row, sd)  # [N, M], blocks along the tokens
    xtd, xts = cast(x.t().contiguous(), row, sd)  # [K, M]
    cases = []
    for recipe, (w_out, w_gi) in spec["weights"].items():
        wod, wos = cast(w, w_out, sd)  # [N, K], blocks along K
        wgd, wgs = cast(w, w_gi, sd)  # [N, K], blocks along N
        tag = "" if len(spec["weights"]) == 1 else f" w{w_out[0]}x{w_out[1]}"
        cases += [
            ("output" + tag, xd, xs, row, wod.t(), wos.t(), w_out[::-1], x @ w.t()),
            ("grad_input" + tag, god, gos, row, wgd, wgs, w_gi, go @ w),
        ]
    cases.append(("grad_weight", gotd, gots, row, xtd.t(), xts.t(), row[::-1], go.t() @ x))
    return cases


def nvfp4_cases(m: int, k: int, n: int):
    """(name, float8_mm's operands on the CPU, high-precision a @ b) for the three gemms of an
    "nvfp4" linear, cast by the recipe's own specs: what Float8Tensor's gemm hands float8_mm (e2m1
    values one a byte as e4m3, e4m3 block scales, the tensor scales)."""
    specs = Float8LinearConfig.from_recipe_name("nvfp4").cast_specs()
    x, w, go = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)

    def cast(t, gemm, role):
        return cast_to_float8(t, specs[gemm, role])

    def case(name, fa, fb, hp):  # fa, fb: the operands after the gemm's transposes
        return name, (fa.values().to(E4M3), fa._scale, fa._block, fb.values().to(E4M3),
                      fb._scale, fb._block, (fa._tensor_scale, fb._tensor_scale)), hp

    return [case("output", cast(x, "output", "input"), cast(w, "output", "weight").t(), x @ w.t()),
            case("grad_input", cast(go, "grad_input", "grad_output"),
                 cast(w, "grad_input", "weight"), go @ w),
            case("grad_weight", cast(go, "grad_weight", "grad_output").t(),
                 cast(x, "grad_weight", "input"), go.t() @ x)]


def nvfp4_mm(ops, device, out_dtype):
    ad, as_, ab, bd, bs, bb, (ta, tb) = [o if not isinstance(o, torch.Tensor) else o.to(device)
                                         for o in ops[:6]] + [tuple(t.to(device) for t in ops[6])]
    return float8_mm(ad, as_, ab, bd, bs, bb, out_dtype=out_dtype, mm_config=ScaledMMConfig(),
                     tensor_scales=(ta, tb))


def check_nvfp4_gemms(rows: list, bad: list, m: int, k: int, n: int) -> None:
    """CUDA's NVFP4 gemm against f8dist's exact CPU kernel on the same NVFP4 data, then the
    grouped gemm's refusal ([Note: NVFP4 on CUDA])."""
    for name, ops, hp in nvfp4_cases(m, k, n):
        cpu = nvfp4_mm(ops, "cpu", torch.float32)
        for out_dtype in (torch.bfloat16, torch.float32):
            row = {"check": f"nvfp4 gemm {name}", "M": m, "K": k, "N": n,
                   "dtype": str(out_dtype).removeprefix("torch.")}
            try:
                out = nvfp4_mm(ops, "cuda", out_dtype).float().cpu()
                row["vs_cpu_kernel_db"] = sqnr(cpu, out)
                row["nvfp4_vs_hp_db"] = sqnr(hp, out)
            except Exception as e:  # noqa: BLE001 - reported
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                bad.append(f"{row['check']} {row['dtype']}: {row['error']}")
            rows.append(row)
    ad, as_, ab, bd, bs, bb, ts = nvfp4_cases(32, k, n)[0][1]
    offs = torch.tensor([16, 32], dtype=torch.int32, device="cuda")
    b3 = bd.cuda().unsqueeze(0).expand(2, -1, -1)  # [E, K, N]
    s3 = bs.cuda().unsqueeze(0).expand(2, -1, -1)
    row = {"check": "nvfp4 grouped (refused)", "M": 32, "K": k, "N": n, "dtype": "bfloat16"}
    try:
        float8_mm(ad.cuda(), as_.cuda(), ab, b3, s3, (1, *bb), offs, out_dtype=torch.bfloat16,
                  mm_config=ScaledMMConfig(), tensor_scales=tuple(t.cuda() for t in ts))
        row["error"] = "ran: f8dist wires no grouped NVFP4 kernel, update this check"
        bad.append(row["error"])
    except NotImplementedError as e:
        if "emulate=True" not in str(e):
            bad.append(f"nvfp4 grouped: the error names no emulate=True: {e}")
        row["refusal"] = str(e).splitlines()[0][:160]
    rows.append(row)


def dry_run() -> int:
    """The CPU pieces: each kernel's verdict on sm90 and sm100, the NVFP4 cases through the CPU
    kernel and the arguments CUDA's NVFP4 kernel would get (checked by f8dist's contract)."""
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, block API: " + ", ".join(
        f"{k}={_has_block_api(k)}" for k in KERNELS))
    for kernel in KERNELS:
        for cap in ((9, 0), (10, 0)):
            why = cuda_block_problem(kernel, cap, api=_has_block_api(kernel))
            print(f"{kernel:8} on sm{cap[0]}{cap[1]}: {why or 'runs'}")
    for name, (ad, as_, ab, bd, bs, bb, ts), hp in nvfp4_cases(200, 384, 40):
        out = nvfp4_mm((ad, as_, ab, bd, bs, bb, ts), "cpu", torch.float32)
        (a2, b2, sa, _, sb, _), _ = cuda_nvfp4_args(ad, bd, as_, bs, kernel_block(ab),
                                                    kernel_block(bb), out_dtype=torch.float32)
        print(f"nvfp4 gemm {name:12} CPU kernel vs hp {sqnr(hp, out):.1f} dB; CUDA args "
              f"a {tuple(a2.shape)} b {tuple(b2.shape)} scales {sa.numel()}, {sb.numel()}: ok")
    return 0


def check_gemms(rows: list, bad: list, m: int, k: int, n: int, kernel: str) -> None:
    for name, ad, as_, ab, bd, bs, bb, hp in gemm_cases(m, k, n, "cuda", kernel):
        cpu = scaled_mm(ad.cpu(), as_.cpu(), bd.cpu(), bs.cpu(), out_dtype=torch.float32,
                        mm_config=ScaledMMConfig(), a_block=ab, b_block=bb)
        for out_dtype in (torch.bfloat16, torch.float32, torch.float16):
            for fast in (False, True):  # True: f8dist turns it off for block gemms
                row = {"check": f"{kernel} gemm {name}", "M": m, "K": k, "N": n,
                       "dtype": str(out_dtype).removeprefix("torch."), "fast_accum": fast}
                try:
                    out = scaled_mm(ad, as_, bd, bs, out_dtype=out_dtype,
                                    mm_config=ScaledMMConfig(use_fast_accum=fast), a_block=ab,
                                    b_block=bb)
                    row["vs_cpu_kernel_db"] = sqnr(cpu.float(), out.float().cpu())
                    row["vs_hp_db"] = sqnr(hp.float().cpu(), out.float().cpu())
                except Exception as e:  # noqa: BLE001 - reported, the table says what runs
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    if out_dtype == torch.bfloat16:  # every kernel writes bf16
                        bad.append(f"{row['check']} bf16 fast_accum={fast}: {row['error']}")
                rows.append(row)


def check_linear(rows: list, recipe: str, tokens: int, k: int, n: int) -> None:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(k, n, bias=False)).to(torch.bfloat16)
    x = torch.randn(tokens, k, dtype=torch.bfloat16)
    go = torch.randn(tokens, n, dtype=torch.bfloat16)
    cfg = Float8LinearConfig.from_recipe_name(recipe)

    def run(model, device, compiled):
        model = copy.deepcopy(model).to(device)
        model = torch.compile(model, fullgraph=True) if compiled else model
        xi = x.to(device).detach().requires_grad_()  # a leaf on each device
        out = model(xi)
        out.backward(go.to(device))
        w = next(model.parameters())
        return [t.float().cpu() for t in (out, xi.grad, w.grad)]

    f8 = convert_to_float8_training(copy.deepcopy(base), config=cfg)
    ref_hp = run(base, "cpu", False)
    ref_cpu = run(f8, "cpu", False)
    for compiled in (False, True):
        row = {"check": f"Float8Linear {recipe}" + (" compiled" if compiled else ""),
               "M": tokens, "K": k, "N": n, "dtype": "bfloat16"}
        try:
            got = run(f8, "cuda", compiled)
            for what, a, b, hp in zip(("out", "grad_input", "grad_weight"), ref_cpu, got, ref_hp):
                row[f"{what}_vs_cpu_db"] = sqnr(a, b)
                row[f"{what}_vs_bf16_db"] = sqnr(hp, b)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        rows.append(row)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--csv", default=None)
    parser.add_argument("--dry", action="store_true", help="the CPU pieces only, no CUDA")
    args = parser.parse_args(argv)
    if args.dry:
        return dry_run()
    why = cuda_missing()
    if why:
        print(f"cuda_block_check: needs CUDA and {why}")
        return 2
    print(f"device: {torch.cuda.get_device_name()} (sm{''.join(map(str, torch.cuda.get_device_capability()))}), torch {torch.__version__}")
    torch.manual_seed(0)
    rows: list = []
    bad: list = []
    for kernel, spec in KERNELS.items():
        reason = skip_reason(kernel)
        if reason is not None:
            print(f"skip {kernel} ({', '.join(spec['recipes'])}): {reason}")
            continue
        if kernel == "nvfp4":  # K = 200 tokens in grad_weight: padded to 224; N = 40 to 48
            check_nvfp4_gemms(rows, bad, 256, 512, 384)
            check_nvfp4_gemms(rows, bad, 200, 384, 40)
        else:
            check_gemms(rows, bad, 256, 512, 384, kernel)
            # tokens not a multiple of 16 (nor of the block: grad_weight's K padded)
            check_gemms(rows, bad, 200, 384, 256, kernel)
        if kernel == "mxfp8":  # N = 40: the output gemm pads N to 48, grad_input K to 64
            check_gemms(rows, bad, 200, 384, 40, kernel)
        for recipe in spec["recipes"]:
            check_linear(rows, recipe, 200, 512, 256)
    if not rows:
        print("cuda_block_check: this device runs no block-scaled kernel")
    for row in rows:
        dbs = {k: v for k, v in row.items() if k.endswith("_db")}
        line = " ".join(f"{k}={v:.1f}" for k, v in dbs.items())
        print(f"{row['check']:32} M={row['M']} K={row['K']} N={row['N']} {row.get('dtype', '')} "
              f"fast_accum={row.get('fast_accum', '-')}: "
              f"{row.get('error') or row.get('refusal') or line}")
        if "error" in row and row["check"].startswith("Float8Linear"):
            bad.append(f"{row['check']}: {row['error']}")
        nvfp4 = "nvfp4" in row["check"]
        for k, v in dbs.items():
            floor = FLOOR_NVFP4_VS_HP if nvfp4 else FLOOR_VS_HP
            if v < (floor if ("hp" in k or "bf16" in k) else FLOOR_VS_CPU_KERNEL):
                bad.append(f"{row['check']} {k}={v:.1f}")
    if args.csv and rows:
        names = sorted({k for row in rows for k in row}, key=lambda c: (c not in rows[0], c))
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=names)
            writer.writeheader()
            writer.writerows(rows)
    if bad:
        print("failed:", "; ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
