"""Bytes a compiled forward + backward moves: inductor's own accounting, bf16 vs f8dist vs torchao.

For each block (the FFN half of a LLaMA-like transformer block, its attention half, the whole block,
or one linear) and each recipe, the block is ``torch.compile``'d and one training step (forward, then
backward of a given output gradient) is run. Inductor counts what every kernel of the compiled
forward and backward graphs reads and writes, gemms included; the table gives the sum and the
ratio to bf16 (< 1: float8 moves less memory than bf16), and the number of generated kernels.

    PYTHONPATH=. python scripts/bench_bytes.py                        # LLaMA-like shapes, on CPU
    PYTHONPATH=. python scripts/bench_bytes.py --blocks ffn --breakdown f8dist:rowwise
    PYTHONPATH=. python scripts/bench_bytes.py --small                # tiny shapes (tests)

[Note: inductor accounting]
The figures are the ones ``TORCH_LOGS=inductor_metrics`` logs: ``GraphLowering.count_bytes`` sums,
over the scheduler nodes of a graph (a fused kernel, or an extern kernel such as a gemm), the bytes
of every buffer the node reads or writes, where a buffer fused away inside a kernel costs nothing.
It is the minimum traffic of the kernels inductor chose ("best-case optimization, worst-case
inputs"), not a measurement, so it is deterministic and the same on every machine of a device type
with the same torch (CPU kernels fuse differently from Triton's, and torch 2.11's inductor lowers
the same FFN differently from 2.13's). The kernel count is ``generated_kernel_count``.
Caches are off and autotuning is off, so every run lowers and counts afresh. One exception: the
first float8 candidate compiled in a process can come out a few kB different from the same
candidate compiled later (at ``--small``, tensorwise 1,415,204 bytes first and 1,411,108 after
another recipe: inductor fused the cast of the input shared by w1 and w3 differently). The FX
graphs inductor receives are identical both times (checked with aot_eager), so this is inductor's
process state, not f8dist's. A given list of candidates always gives the same figures.

Counting needs the lowered graphs, not their kernels: by default the generated code is written
but neither compiled (C++ compilation of the CPU kernels takes minutes) nor run, and each graph
returns uninitialized tensors of its outputs' shapes, strides and dtypes (no figure depends on a
value; float8 gemms on a CPU run oneDNN's reference kernel, minutes per step at these shapes).
``--run-compiled`` compiles and runs the kernels instead; the figures are the same.

A step is what a user runs: ``out = compiled(x); out.backward(grad)``. Delayed scaling warms up
first (one step and ``sync_float8_amax_and_scale_history`` outside the compiled region: the first
step initializes the amax history and compiles its own graph); the step counted is the second.
Each candidate then runs one more step, which must compile nothing: the graphs counted are the
ones every later step runs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import os
import re
import sys
import warnings
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple
from unittest import mock

import torch
import torch.nn as nn

from bench_common import check_device, report, torchao_converter
from f8dist import Float8LinearConfig, convert_to_float8_training, sync_float8_amax_and_scale_history
from f8dist.config import DelayedScalingConfig
from f8dist.models.llama import Attention, FeedForward, ModelArgs, TransformerBlock, precompute_rope

RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed", "delayed_rescaled"]
# "delayed" whose out-of-range casts re-scale in their step ([Note: the price of re-scaling])
VARIANTS = {"delayed_rescaled": ("delayed", {"delayed_scaling_config": DelayedScalingConfig(
    rescale_out_of_range=True)}),
    # the square weight's forward cast kept for the grad_input gemm (float8_weight_for_backward)
    "mxfp8_square_weights_kept": ("mxfp8_square_weights", {"float8_weight_for_backward": True})}
# block-scaled recipes ([Note: block scales] in f8dist/config/cells.py); "blockwise" needs dims that
# divide by 128 (not --small's)
BLOCK_RECIPES = ["mxfp8", "mxfp8_wgrad_with_hp", "mxfp8_square_weights", "blockwise"]
TORCHAO_RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]  # torchao 0.18 has no delayed
BLOCKS = ["ffn", "attention", "layer", "linear"]
COLUMNS = [
    "block", "recipe", "bf16_bytes", "f8dist_bytes", "f8dist_vs_bf16", "torchao_vs_bf16",
    "bf16_kernels", "f8dist_kernels", "torchao_kernels",
]
# aten gemms, and f8dist's float8 gemm on the CPU (f8dist/core/gemm.py: torch._scaled_mm's stand-in)
GEMMS = ("mm", "addmm", "bmm", "_scaled_mm", "_int_mm", "f8dist.cpu_scaled_mm",
         "f8dist.cpu_block_scaled_mm")


# -------------------------------------------------------------------------------------------
# the accounting
# -------------------------------------------------------------------------------------------


@dataclass
class Buffer:
    """One buffer a kernel reads or writes: a graph input (``primals_*`` in forward,
    ``tangents_*`` or a saved activation in backward) or an intermediate (``buf*``)."""

    name: str
    shape: List[int]
    dtype: str
    bytes: int  # what this kernel accesses of it

    def __str__(self):
        return f"{self.name}{self.shape}:{self.dtype}={self.bytes}"


@dataclass
class Kernel:
    """One scheduler node: a generated (fused) kernel or an extern kernel (gemm, attention)."""

    graph: str  # "forward" or "backward"
    name: str
    kind: str  # "kernel" (generated), "gemm" or "extern"
    op: str  # extern: the aten op; kernel: the reductions and casts it fuses
    bytes: int  # inductor's figure for the node (reads and writes)
    reads: List[Buffer] = field(default_factory=list)
    writes: List[Buffer] = field(default_factory=list)
    ops: List[str] = field(default_factory=list)  # aten ops fused into it
    sources: List[str] = field(default_factory=list)  # file:line function they come from


@dataclass
class Accounting:
    bytes: int = 0  # sum of every graph's GraphLowering.count_bytes()
    kernels: int = 0  # inductor's generated_kernel_count
    graphs: int = 0  # graphs compiled (forward and backward count one each)
    breakdown: List[Kernel] = field(default_factory=list)

    def by_kind(self) -> Dict[str, int]:
        out: Dict[str, int] = collections.Counter()
        for k in self.breakdown:
            out[k.kind] += k.bytes
        return dict(out)


def _dtype_name(dtype: torch.dtype) -> str:
    return {
        torch.bfloat16: "bf16", torch.float32: "f32", torch.float16: "f16",
        torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2", torch.int64: "i64",
        torch.int32: "i32", torch.bool: "bool",
    }.get(dtype, str(dtype).replace("torch.", ""))


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _source(stack_trace: Optional[str]) -> Optional[str]:
    """The innermost frame of a node's stack trace, as ``file:line function``."""
    frames = _FRAME.findall(stack_trace or "")
    if not frames:
        return None
    path, line, fn = frames[-1]
    parts = path.split(os.sep)
    short = os.sep.join(parts[-2:])
    return f"{short}:{line} {fn}"


def _buffers(graph, accesses: Dict[str, int]) -> List[Buffer]:
    out = []
    for name, nbytes in accesses.items():
        buf = graph.name_to_buffer.get(name) or graph.graph_inputs.get(name)
        shape, dtype = [], "?"
        if buf is not None:
            try:
                shape = [int(s) for s in buf.get_size()]
                dtype = _dtype_name(buf.get_dtype())
            except (TypeError, AttributeError, NotImplementedError):
                pass
        out.append(Buffer(name, shape, dtype, int(nbytes)))
    return out


def _kernel(graph, node) -> Kernel:
    from torch._inductor.scheduler import ExternKernelSchedulerNode

    origins = [o for sn in node.get_nodes() if sn.node is not None for o in sn.node.origins]
    ops = sorted({str(o.target).replace("aten.", "").replace("prims.", "").split(".")[0]
                  for o in origins if o.op == "call_function"})
    sources = sorted({s for s in (_source(o.meta.get("stack_trace")) for o in origins) if s})
    if isinstance(node, ExternKernelSchedulerNode):
        overload = getattr(node.node, "op_overload", None)
        op = str(overload) if overload is not None else (
            getattr(node.node, "python_kernel_name", None) or type(node.node).__name__)
        op = op.replace("aten.", "").replace("extern_kernels.", "")
        kind = "gemm" if {op.split(".")[0], op.rsplit(".", 1)[0]} & set(GEMMS) else "extern"
    else:
        kind = "kernel"
        op = "+".join(o for o in ops if o in ("amax", "max", "sum", "mean", "abs")) or "pointwise"
    return Kernel(
        graph="backward" if getattr(graph, "is_backward", False) else "forward",
        name=node.get_name(),
        kind=kind,
        op=op,
        bytes=int(node.get_read_write_buffers_sizes()),
        reads=_buffers(graph, node.get_read_write_buffer_accesses(
            include_reads=True, include_writes=False)),
        writes=_buffers(graph, node.get_read_write_buffer_accesses(
            include_reads=False, include_writes=True)),
        ops=ops,
        sources=sources,
    )


class _ShapeOnlyModule:
    """Stands in for a compiled graph's module without running anything: returns tensors of the
    shapes, strides and dtypes the graph's outputs have (uninitialized), and inputs the graph
    returns as they are. The accounting needs no values, and float8 gemms on a CPU run oneDNN's
    reference kernel (minutes per LLaMA-sized step)."""

    def __init__(self, gm: torch.fx.GraphModule, path: str):
        self.__file__ = path
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        (output,) = [n for n in gm.graph.nodes if n.op == "output"]
        self._index = {n: i for i, n in enumerate(placeholders)}
        self._outputs = list(output.args[0])

    def _make(self, node, args):
        if not isinstance(node, torch.fx.Node):
            return node  # None or a constant
        if node in self._index:
            return args[self._index[node]]
        val = node.meta["val"]
        if not isinstance(val, torch.Tensor):
            return val
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)

    def call(self, args):
        args = list(args)
        return [self._make(node, args) for node in self._outputs]


@contextlib.contextmanager
def inductor_accounting(*, run_compiled: bool = False):
    """Count bytes and kernels of every graph inductor compiles inside the block.

    Yields an :class:`Accounting` that fills up as graphs compile; see [Note: inductor
    accounting].

    Example::

        >>> with inductor_accounting() as acc:
        ...     torch.compile(model)(x).backward(grad)
        >>> acc.bytes, acc.kernels
    """
    import torch._inductor.config as inductor_config
    from torch._inductor import metrics
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.graph import GraphLowering
    from torch._inductor.scheduler import NopKernelSchedulerNode

    acc = Accounting()
    compile_to_module = GraphLowering.compile_to_module

    def counting_compile_to_module(graph):
        before = metrics.generated_kernel_count
        module = compile_to_module(graph)
        acc.kernels += metrics.generated_kernel_count - before
        acc.graphs += 1
        acc.bytes += graph.count_bytes()[0]
        acc.breakdown += [_kernel(graph, node) for node in graph.scheduler.nodes
                          if not isinstance(node, NopKernelSchedulerNode)]
        return module

    def shape_only_module(graph, wrapper_code):
        _, path = PyCodeCache.write(wrapper_code.value)
        return _ShapeOnlyModule(graph.module, path)

    patches = [mock.patch.object(GraphLowering, "compile_to_module", counting_compile_to_module)]
    if not run_compiled:
        patches.append(mock.patch.object(GraphLowering, "_compile_to_module_lines", shape_only_module))
    settings = {
        "force_disable_caches": True,
        "fx_graph_cache": False,
        "fx_graph_remote_cache": False,
        "autotune_local_cache": False,
        "autotune_remote_cache": False,
        "max_autotune": False,
        "max_autotune_gemm": False,
        "max_autotune_pointwise": False,
        "benchmark_fusion": False,
        "benchmark_kernel": False,
    }
    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(settings))
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
        for p in patches:
            stack.enter_context(p)
        yield acc


# -------------------------------------------------------------------------------------------
# blocks and candidates
# -------------------------------------------------------------------------------------------


class FFNHalf(nn.Module):
    """The FFN half of a LLaMA block, ``x + w2(silu(w1(norm(x))) * w3(norm(x)))``, on ``x`` of
    shape [tokens, dim]: the block of issue 15's table."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x, rope=None):
        return x + self.feed_forward(self.ffn_norm(x))


class AttentionHalf(nn.Module):
    """The attention half of a LLaMA block, ``x + wo(sdpa(rope(wq(norm(x))), rope(wk(..)),
    wv(..)))`` (causal, grouped-query), on ``x`` of shape [1, tokens, dim]."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)

    def forward(self, x, rope):
        return x + self.attention(self.attention_norm(x), rope)


class Linear(nn.Module):
    """One linear layer, dim -> ffn hidden, on ``x`` of shape [tokens, dim]."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.proj = nn.Linear(args.dim, args.ffn_hidden_dim, bias=False)

    def forward(self, x, rope=None):
        return self.proj(x)


def model_args(small: bool) -> ModelArgs:
    """LLaMA-like shapes small enough for a CPU: dim 1024, 8 heads of 128 with 2 kv heads
    (grouped-query attention), SwiGLU hidden 2816 (LLaMA's 8/3 * dim rounded up to 256)."""
    if small:
        return ModelArgs(dim=64, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=64)
    return ModelArgs(dim=1024, n_heads=8, n_kv_heads=2, multiple_of=256, max_seq_len=1024)


def build_block(block: str, args: ModelArgs) -> nn.Module:
    torch.manual_seed(0)
    if block == "ffn":
        return FFNHalf(args)
    if block == "attention":
        return AttentionHalf(args)
    if block == "layer":
        return TransformerBlock(0, args)
    if block == "linear":
        return Linear(args)
    raise ValueError(f"unknown block {block!r}; blocks: {BLOCKS}")


Convert = Callable[[nn.Module], nn.Module]


def candidates(recipes: Sequence[str], torchao: bool) -> List[Tuple[str, str, Optional[Convert]]]:
    """(implementation, recipe, convert) for bf16, every f8dist recipe, every torchao recipe."""
    out: List[Tuple[str, str, Optional[Convert]]] = [("bf16", "-", None)]
    for recipe in recipes:
        name, options = VARIANTS.get(recipe, (recipe, {}))
        config = Float8LinearConfig.from_recipe_name(name).replace(**options)
        out.append(("f8dist", recipe, lambda m, c=config: convert_to_float8_training(m, config=c)))
    ao_convert = torchao_converter() if torchao else None
    if ao_convert is not None:
        for recipe in recipes:
            if recipe in TORCHAO_RECIPES:
                out.append(("torchao", recipe, lambda m, r=recipe: ao_convert(m, r)))
    return out


def measure(module: nn.Module, inputs: Sequence[torch.Tensor], grad: torch.Tensor, *,
            delayed: bool, run_compiled: bool) -> Accounting:
    """Accounting of one compiled training step of ``module``; see [Note: inductor accounting]."""
    torch._dynamo.reset()
    compiled = torch.compile(module)

    def step():
        x = inputs[0].detach().requires_grad_()
        compiled(x, *inputs[1:]).backward(grad)
        if delayed:
            sync_float8_amax_and_scale_history(module)

    if delayed:
        step()  # the first step initializes the amax histories (its own graph)
    with inductor_accounting(run_compiled=run_compiled) as acc:
        step()
    with inductor_accounting(run_compiled=run_compiled) as again:
        step()
    if acc.graphs == 0 or again.graphs:
        raise RuntimeError(
            f"expected the counted step to compile and the next one to reuse its graphs; got "
            f"{acc.graphs} and {again.graphs} graphs compiled"
        )
    return acc


def run(blocks: Sequence[str], recipes: Sequence[str], *, small: bool, torchao: bool,
        device: str = "cpu", run_compiled: bool = False, tokens: Optional[int] = None,
        log: Callable[[str], None] = lambda s: None) -> Dict[Tuple[str, str, str], Accounting]:
    """Accounting of every (block, implementation, recipe)."""
    args = model_args(small)
    tokens = tokens or args.max_seq_len
    if tokens > args.max_seq_len:
        args = ModelArgs(**{**asdict(args), "max_seq_len": tokens})
    results = {}
    for block in blocks:
        with torch.device("cpu"):  # the same initial weights on every device
            base = build_block(block, args).to(device=device, dtype=torch.bfloat16)
            rope = precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta).to(device)
        gen = torch.Generator().manual_seed(1)  # CPU numbers, whatever the device
        shape = (tokens, args.dim) if block in ("ffn", "linear") else (1, tokens, args.dim)
        x = torch.randn(shape, generator=gen, device="cpu").to(device, torch.bfloat16)
        with torch.no_grad():
            out_shape = base(x, rope).shape
        grad = torch.randn(out_shape, generator=gen, device="cpu").to(device, torch.bfloat16)
        for impl, recipe, convert in candidates(recipes, torchao):
            module = copy.deepcopy(base)
            if convert is not None:
                module = convert(module)
            acc = measure(module, (x, rope), grad, delayed=recipe.startswith("delayed"),
                          run_compiled=run_compiled)
            results[(block, impl, recipe)] = acc
            log(f"# {block} {impl} {recipe}: {acc.bytes} bytes, {acc.kernels} kernels, "
                f"{acc.graphs} graphs")
    return results


# -------------------------------------------------------------------------------------------
# output
# -------------------------------------------------------------------------------------------


def rows(results: Dict[Tuple[str, str, str], Accounting], blocks, recipes) -> List[dict]:
    out = []
    for block in blocks:
        bf16 = results[(block, "bf16", "-")]
        for recipe in recipes:
            f8 = results[(block, "f8dist", recipe)]
            ao = results.get((block, "torchao", recipe))
            out.append({
                "block": block, "recipe": recipe,
                "bf16_bytes": bf16.bytes, "f8dist_bytes": f8.bytes,
                "f8dist_vs_bf16": round(f8.bytes / bf16.bytes, 3),
                "torchao_vs_bf16": round(ao.bytes / bf16.bytes, 3) if ao else None,
                "bf16_kernels": bf16.kernels, "f8dist_kernels": f8.kernels,
                "torchao_kernels": ao.kernels if ao else None,
            })
    return out


def print_breakdown(title: str, acc: Accounting, file=None) -> None:
    """One line per scheduler node (kernel or extern call), then what it reads and writes."""
    file = file or sys.stdout
    print(f"### {title}: {acc.bytes} bytes, {acc.kernels} generated kernels, "
          f"{acc.graphs} graphs; bytes by kind {acc.by_kind()}", file=file)
    for k in acc.breakdown:
        print(f"{k.graph[:3]} {k.name:22} {k.kind:6} {k.bytes:>10} {k.op}", file=file)
        print(f"      reads  {', '.join(map(str, k.reads))}", file=file)
        print(f"      writes {', '.join(map(str, k.writes))}", file=file)
        print(f"      ops    {' '.join(k.ops)}", file=file)
        if k.sources:
            print(f"      from   {'; '.join(k.sources)}", file=file)
    print(file=file)


def _selected(key: Tuple[str, str, str], patterns: Sequence[str]) -> bool:
    block, impl, recipe = key
    names = {f"{impl}:{recipe}", f"{block}:{impl}:{recipe}", impl, "all"}
    if impl == "bf16":
        names |= {"bf16", f"{block}:bf16"}
    return any(p in names for p in patterns)


def main(argv: Optional[Sequence[str]] = None) -> Dict[Tuple[str, str, str], Accounting]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", nargs="+", default=["ffn", "attention", "layer"],
                        choices=BLOCKS)
    parser.add_argument("--recipes", nargs="+", default=RECIPES + BLOCK_RECIPES,
                        choices=RECIPES + BLOCK_RECIPES + [v for v in VARIANTS if v not in RECIPES])
    parser.add_argument("--small", action="store_true",
                        help="dim 64, 4 heads, 64 tokens: checks the script in seconds")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per step (default: 1024, or 64 with --small)")
    parser.add_argument("--no-torchao", action="store_true", help="skip the torchao columns")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--run-compiled", action="store_true",
                        help="compile and run inductor's kernels (slow on CPU; same figures)")
    parser.add_argument("--breakdown", nargs="*", default=[],
                        help="print the per-kernel breakdown of these candidates, e.g. bf16 "
                             "f8dist:rowwise ffn:torchao:tensorwise all")
    parser.add_argument("--csv", default=None)
    parser.add_argument("--json", default=None, help="write every breakdown to this file")
    opts = parser.parse_args(argv)
    check_device(opts.device, parser.prog)

    results = run(opts.blocks, opts.recipes, small=opts.small, torchao=not opts.no_torchao,
                  device=opts.device, run_compiled=opts.run_compiled, tokens=opts.tokens,
                  log=lambda s: print(s, file=sys.stderr, flush=True))
    args = model_args(opts.small)
    tokens = opts.tokens or args.max_seq_len
    title = (f"bytes accessed by a compiled fwd+bwd (inductor), {tokens} tokens, dim {args.dim}, "
             f"ffn hidden {args.ffn_hidden_dim}, {args.n_heads} heads ({args.kv_heads} kv), bf16")
    report(rows(results, opts.blocks, opts.recipes), COLUMNS, title=title, device=opts.device,
           csv_path=opts.csv)
    for key, acc in results.items():
        if _selected(key, opts.breakdown):
            print_breakdown(" ".join(key), acc)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({" ".join(k): asdict(v) for k, v in results.items()}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
