"""What the benchmark scripts share: shapes, the timing loop, the machine line, table and CSV output.

Every script prints a markdown table (pasted as is into docs/performance.md) and writes the same
rows to a CSV file. Numbers in both are plain decimals, so a ratio column parses with ``float``.

[Note: timing]
``median_times`` warms every candidate up, then times them *interleaved*: round r runs candidate
A, then B, then C, each once. On a shared machine the load drifts over seconds; interleaving puts
the drift on every candidate alike, so ratios between them stay meaningful even when absolute
times wobble. Each figure is the median of ``repeats`` rounds. On CUDA each call is bracketed by
``torch.cuda.synchronize``.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

__all__ = [
    "GemmShape",
    "llama2_70b_shapes",
    "add_common_args",
    "shapes_from_args",
    "median_times",
    "machine_line",
    "report",
    "cuda_missing",
    "check_device",
]


@dataclass(frozen=True)
class GemmShape:
    """One linear layer: ``[M, K] @ [K, N]`` with M tokens, K = in_features, N = out_features."""

    name: str
    m: int
    k: int
    n: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n


def llama2_70b_shapes(*, tokens: int = 4 * 4096, tp: int = 8) -> List[GemmShape]:
    """The linear layers of LLaMa-2-70B (dim 8192, 64 heads, 8 kv heads, FFN 28672; fused qkv and
    w1/w3), each sharded ``tp`` ways as tensor parallel does (colwise: N / tp; rowwise: K / tp)."""
    dim, n_heads, n_kv_heads, ffn = 8192, 64, 8, 28672
    head_dim = dim // n_heads
    qkv = (n_heads + 2 * n_kv_heads) * head_dim
    return [
        GemmShape("attn.wqkv", tokens, dim, qkv // tp),
        GemmShape("attn.wo", tokens, dim // tp, dim),
        GemmShape("ffn.w13", tokens, dim, 2 * ffn // tp),
        GemmShape("ffn.w2", tokens, ffn // tp, dim),
    ]


# Small enough for a 2-core CPU, large enough that the gemm (not Python) dominates.
CPU_SHAPES = [
    GemmShape("cpu.square", 512, 1024, 1024),
    GemmShape("cpu.wide", 512, 1024, 4096),
    GemmShape("cpu.deep", 512, 4096, 1024),
]
SMOKE_SHAPES = [GemmShape("smoke", 32, 64, 48)]


def cuda_missing() -> Optional[str]:
    """Why this process cannot run on CUDA (a CPU build of torch, or no GPU visible), or None."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None and torch.version.hip is None:
        return f"torch {torch.__version__} is a build without CUDA"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f"torch {torch.__version__} sees no GPU" + (
        f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")


def check_device(device: str, prog: str) -> None:
    """End ``prog`` in one line, before any work, where ``--device`` is CUDA and this process has
    none (torch would fail mid-run with "Torch not compiled with CUDA enabled")."""
    why = cuda_missing() if torch.device(device).type == "cuda" else None
    if why:
        raise SystemExit(f"{prog}: --device {device} needs CUDA and {why}; run with --device cpu")


def add_common_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--shapes", choices=["cpu", "llama70b"], default="cpu",
        help="cpu: small shapes (default); llama70b: LLaMa-2-70B linears sharded --tp ways",
    )
    parser.add_argument("--tokens", type=int, default=4 * 4096,
                        help="M for --shapes llama70b (default: batch 4 x seq 4096)")
    parser.add_argument("--tp", type=int, default=8, help="TP degree for --shapes llama70b")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per candidate")
    parser.add_argument("--repeats", type=int, default=20, help="timed rounds (median is reported)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--csv", default=None, help="where to write the rows (default: print only)")
    parser.add_argument(
        "--smoke", action="store_true",
        help="one tiny shape, one warm-up call and one timed round: checks the script, not speed",
    )
    return parser


def shapes_from_args(args: argparse.Namespace) -> List[GemmShape]:
    """The shapes to run; ``--smoke`` also cuts warm-up and repeats to one."""
    if args.smoke:
        args.warmup, args.repeats = 1, 1
        return SMOKE_SHAPES
    if args.warmup < 1 or args.repeats < 1:
        raise SystemExit("--warmup and --repeats must be >= 1")
    if args.shapes == "llama70b":
        return llama2_70b_shapes(tokens=args.tokens, tp=args.tp)
    return CPU_SHAPES


def torchao_converter() -> Optional[Callable]:
    """``convert(model, recipe)`` with torchao.float8, or None when torchao is absent (it is only
    ever a side-by-side column, never required)."""
    if importlib.util.find_spec("torchao") is None:
        return None
    from torchao.float8 import Float8LinearConfig as AoConfig
    from torchao.float8 import convert_to_float8_training as ao_convert

    def convert(model, recipe):
        if recipe.startswith("mxfp8"):  # torchao's MXFP8 training on its own kernels (sm100)
            if recipe == "mxfp8_square_weights":
                raise RuntimeError("torchao has no MXFP8 recipe with 32x32 weight tiles")
            if next(model.parameters()).device.type != "cuda":
                raise RuntimeError("torchao's MXFP8 kernels (Triton, CUDA sm100) need a GPU")
            from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
            from torchao.quantization import quantize_

            quantize_(model, MXFP8TrainingOpConfig(wgrad_with_hp=recipe == "mxfp8_wgrad_with_hp"))
            return model
        if recipe == "blockwise":  # torchao's DeepSeek-style prototype (sm90)
            from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinearConfig
            from torchao.quantization import quantize_

            quantize_(model, Float8BlockwiseLinearConfig())
            return model
        return ao_convert(model, config=AoConfig.from_recipe_name(recipe))

    return convert


def median_times(
    fns: Dict[str, Callable[[], object]], *, warmup: int, repeats: int, device: str
) -> Dict[str, float]:
    """Median seconds per call of each function, timed interleaved; see [Note: timing]."""
    cuda = torch.device(device).type == "cuda"

    def timed(fn) -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for fn in fns.values():
        for _ in range(warmup):
            timed(fn)
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(timed(fn))
    return {name: statistics.median(s) for name, s in samples.items()}


def machine_line(device: str) -> str:
    """Which machine the figures come from (goes above every table)."""
    if torch.device(device).type == "cuda":
        hw = torch.cuda.get_device_name(device)
    else:
        hw = _cpu_model() or platform.processor() or "unknown CPU"
        hw = f"CPU {hw}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"
    return f"device: {hw}; torch {torch.__version__}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"
    return str(value)


def report(rows: Sequence[dict], columns: Sequence[str], *, title: str, device: str,
           csv_path: str | None) -> None:
    """Print ``rows`` as a markdown table under a title and the machine line; write the CSV."""
    cells = [[_fmt(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print(f"## {title}")
    print(machine_line(device))
    print()
    print("| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        print("| " + " | ".join(v.ljust(w) for v, w in zip(r, widths)) + " |")
    print(flush=True)
    if csv_path:
        os.makedirs(os.path.dirname(os.path.abspath(csv_path)), exist_ok=True)
        with open(csv_path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(columns)
            writer.writerows([_fmt(row.get(c)) for c in columns] for row in rows)
