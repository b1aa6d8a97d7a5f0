"""Benchmark the float8 gemm alone: ``torch._scaled_mm`` (tensorwise and rowwise scales; DeepSeek's
1x128 x 128x128 and MXFP8's 1x32 block scales where the device has the kernel) vs bf16 mm.

Prints TFLOP/s of each and its ratio to bf16 (> 1: float8 is faster), and writes them to CSV.

    python scripts/bench_matmul.py                          # CPU-sized shapes
    python scripts/bench_matmul.py --shapes llama70b        # LLaMa-2-70B linears, TP=8, M=16384
    python scripts/bench_matmul.py --csv /tmp/matmul.csv
"""

from __future__ import annotations

import argparse

import torch

from bench_common import GemmShape, add_common_args, check_device, median_times, report, shapes_from_args

COLUMNS = [
    "shape", "M", "K", "N",
    "bf16_tflops", "tensorwise_tflops", "rowwise_tflops", "blockwise_tflops", "mxfp8_tflops",
    "tensorwise_vs_bf16", "rowwise_vs_bf16", "blockwise_vs_bf16", "mxfp8_vs_bf16",
]
FLOAT8 = ("tensorwise", "rowwise", "blockwise", "mxfp8")


def gemm_candidates(shape: GemmShape, device: str, fast_accum: bool) -> dict:
    """The three gemms of one shape, operands laid out as ``_scaled_mm`` wants them
    (A row-major, B column-major), with unit scales of the right shape."""
    m, k, n = shape.m, shape.k, shape.n
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)  # [M, K]
    b = torch.randn(n, k, device=device, dtype=torch.bfloat16).t()  # [K, N], column-major
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    row_a = torch.ones(m, 1, device=device)  # [M, 1]
    col_b = torch.ones(1, n, device=device)  # [1, N]

    def scaled(scale_a, scale_b):
        return lambda: torch._scaled_mm(
            a8, b8, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16,
            use_fast_accum=fast_accum,
        )

    candidates = {"bf16": lambda: torch.mm(a, b), "tensorwise": scaled(one, one)}
    rowwise = scaled(row_a, col_b)
    if _runs(rowwise):  # the CPU's _scaled_mm has per-row scales from torch 2.13
        candidates["rowwise"] = rowwise
    # CUDA: blockwise on sm90, mxfp8 on sm100+ ([Note: the block-scaled gemm] in f8dist/core/gemm.py)
    for name, fn in (("blockwise", _block_gemm(a8, b8, (128, 128), torch.float32)),
                     ("mxfp8", _block_gemm(a8, b8, (32, 1), torch.float8_e8m0fnu))):
        if _runs(fn):
            candidates[name] = fn
    return candidates


def _block_gemm(a8, b8, b_block, scale_dtype):
    """f8dist's gemm of 1 x bk activation blocks and ``b_block`` weight blocks (bk = b_block[0]),
    unit scales in ``scale_dtype`` (CUDA's block kernels have no fast accumulation): "blockwise"
    is 1x128 x 128x128 float32, "mxfp8" 1x32 x 32x1 e8m0."""
    from f8dist.config import ScaledMMConfig
    from f8dist.core.gemm import scaled_mm

    (m, k), n, (bk, bn) = a8.shape, b8.shape[1], b_block
    sa = torch.ones(m, -(-k // bk), device=a8.device).to(scale_dtype)  # [M, K/bk]
    sb = torch.ones(-(-k // bk), -(-n // bn), device=a8.device).to(scale_dtype)  # [K/bk, N/bn]
    cfg = ScaledMMConfig()
    return lambda: scaled_mm(a8, sa, b8, sb, out_dtype=torch.bfloat16, mm_config=cfg,
                             a_block=(1, bk), b_block=b_block)


def _runs(fn) -> bool:
    try:
        fn()
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    return True


def main(argv=None) -> list:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--fast-accum", action="store_true",
                        help="use_fast_accum=True in _scaled_mm (CUDA only makes use of it)")
    args = parser.parse_args(argv)
    check_device(args.device, parser.prog)
    shapes = shapes_from_args(args)
    torch.manual_seed(0)

    rows = []
    for shape in shapes:
        times = median_times(
            gemm_candidates(shape, args.device, args.fast_accum),
            warmup=args.warmup, repeats=args.repeats, device=args.device,
        )
        tflops = {name: shape.flops / t / 1e12 for name, t in times.items()}
        row = {"shape": shape.name, "M": shape.m, "K": shape.k, "N": shape.n}
        for name in ("bf16", *FLOAT8):  # None: this torch or device cannot run it here
            row[f"{name}_tflops"] = tflops.get(name)
        for name in FLOAT8:
            row[f"{name}_vs_bf16"] = tflops[name] / tflops["bf16"] if name in tflops else None
        rows.append(row)
    report(rows, COLUMNS, title="torch._scaled_mm vs bf16 mm (TFLOP/s; ratio > 1: float8 faster)",
           device=args.device, csv_path=args.csv)
    return rows


if __name__ == "__main__":
    main()
