"""The block-scaled float8 gemm on CUDA against f8dist's exact CPU kernel, on the same float8 data.

DeepSeek's blocks (the ``"blockwise"`` recipe: 1x128 activations and gradients, 128x128 weights)
run on CUDA's sm90 kernel ([Note: the block-scaled gemm] in f8dist/gemm.py). For each of the three
gemm shapes of a linear (output: 1x128 x 128x128, grad_input: the same, grad_weight: 1x128 x
1x128 along the tokens), each output dtype and ``use_fast_accum``, this prints the SQNR of CUDA's
result against the CPU kernel on the same float8 bytes and scales, and against the
high-precision product; then a ``Float8Linear`` with the recipe, forward and backward, on CUDA
against the same layer on the CPU, eager and compiled. Unsupported cases print the error torch
gives. Exits non-zero if a supported case falls under its floor.

    python scripts/cuda_block_check.py [--csv OUT.csv]     # needs CUDA (sm90 for the kernel)
"""

from __future__ import annotations

import argparse
import copy
import csv
import sys

import torch
import torch.nn as nn

from f8dist import Float8LinearConfig, convert_to_float8_training
from f8dist.config import ScaledMMConfig
from f8dist.gemm import scaled_mm
from f8dist.numerics import sqnr
from f8dist.scaling import block_cast

E4M3 = torch.float8_e4m3fn
# floors: CUDA's kernel sums float8 products with fewer bits than the CPU kernel's float32
# ([Note: exact gemm floor] in tests/floors.py); a float8 gemm is ~28 dB from high precision
FLOOR_VS_CPU_KERNEL, FLOOR_VS_HP = 40.0, 25.0


def cast(x: torch.Tensor, block):
    return block_cast(x, block, E4M3)  # (data, scale)


def gemm_cases(m: int, k: int, n: int, device: str):
    """(name, a_data, a_scale, a_block, b_data, b_scale, b_block, high-precision a @ b)."""
    x = torch.randn(m, k, device=device)  # [M, K] tokens x in_features
    w = torch.randn(n, k, device=device)  # [N, K]
    go = torch.randn(m, n, device=device)  # [M, N]
    xd, xs = cast(x, (1, 128))
    wd, ws = cast(w, (128, 128))
    god, gos = cast(go, (1, 128))
    gotd, gots = cast(go.t().contiguous(), (1, 128))  # [N, M], blocks along the tokens
    xtd, xts = cast(x.t().contiguous(), (1, 128))  # [K, M]
    return [
        ("output", xd, xs, (1, 128), wd.t(), ws.t(), (128, 128), x @ w.t()),
        ("grad_input", god, gos, (1, 128), wd, ws, (128, 128), go @ w),
        ("grad_weight", gotd, gots, (1, 128), xtd.t(), xts.t(), (128, 1), go.t() @ x),
    ]


def check_gemms(rows: list, m: int, k: int, n: int) -> None:
    for name, ad, as_, ab, bd, bs, bb, hp in gemm_cases(m, k, n, "cuda"):
        cpu = scaled_mm(ad.cpu(), as_.cpu(), bd.cpu(), bs.cpu(), out_dtype=torch.float32,
                        mm_config=ScaledMMConfig(), a_block=ab, b_block=bb)
        for out_dtype in (torch.bfloat16, torch.float32, torch.float16):
            for fast in (False, True):  # True: f8dist turns it off for block gemms
                row = {"check": f"gemm {name}", "M": m, "K": k, "N": n,
                       "dtype": str(out_dtype).removeprefix("torch."), "fast_accum": fast}
                try:
                    out = scaled_mm(ad, as_, bd, bs, out_dtype=out_dtype,
                                    mm_config=ScaledMMConfig(use_fast_accum=fast), a_block=ab,
                                    b_block=bb)
                    row["vs_cpu_kernel_db"] = sqnr(cpu.float(), out.float().cpu())
                    row["vs_hp_db"] = sqnr(hp.float().cpu(), out.float().cpu())
                except Exception as e:  # noqa: BLE001 - reported, the table says what runs
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                rows.append(row)


def check_linear(rows: list, tokens: int, k: int, n: int) -> None:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(k, n, bias=False)).to(torch.bfloat16)
    x = torch.randn(tokens, k, dtype=torch.bfloat16)
    go = torch.randn(tokens, n, dtype=torch.bfloat16)
    cfg = Float8LinearConfig.from_recipe_name("blockwise")

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
        row = {"check": "Float8Linear blockwise" + (" compiled" if compiled else ""),
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
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_block_check: needs CUDA")
        return 2
    print(f"device: {torch.cuda.get_device_name()} (sm{''.join(map(str, torch.cuda.get_device_capability()))}), torch {torch.__version__}")
    torch.manual_seed(0)
    rows: list = []
    check_gemms(rows, 256, 512, 384)
    check_gemms(rows, 200, 384, 256)  # tokens not a multiple of 16 (nor of 128: grad_weight's K)
    check_linear(rows, 200, 512, 256)
    bad = []
    for row in rows:
        dbs = {k: v for k, v in row.items() if k.endswith("_db")}
        line = " ".join(f"{k}={v:.1f}" for k, v in dbs.items())
        print(f"{row['check']:32} M={row['M']} K={row['K']} N={row['N']} {row.get('dtype', '')} "
              f"fast_accum={row.get('fast_accum', '-')}: {row.get('error') or line}")
        if "error" in row and row["check"].startswith("Float8Linear"):
            bad.append(f"{row['check']}: {row['error']}")
        for k, v in dbs.items():
            if v < (FLOOR_VS_HP if ("hp" in k or "bf16" in k) else FLOOR_VS_CPU_KERNEL):
                bad.append(f"{row['check']} {k}={v:.1f}")
    if args.csv:
        names = sorted({k for row in rows for k in row}, key=lambda c: (c not in rows[0], c))
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=names)
            writer.writeheader()
            writer.writerows(rows)
    if bad:
        print("under the floor:", "; ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
