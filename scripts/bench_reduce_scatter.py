"""Float8 gradient reduce-scatter: bytes on the wire vs gradient SQNR, per float8 format and scale
block size, on real gradients of the LLaMA-style model (f8dist/parallel/fsdp/reduce_scatter.py).

One process plays ``--world`` data-parallel ranks: the model trains ``--warm-steps`` steps on the
global batch, then each measured step computes every rank's gradients on its slice of the batch,
lays them out as FSDP2 does (one flat buffer per FSDP unit: each block, and the root's embedding,
norm and output; every parameter padded on dim 0 and split into ``world`` destination chunks) and
reduces them three ways:

* ``fp32``: the exact reduction (float64 sum, / world), the reference;
* ``bf16``: what a bf16 reduce-scatter does (each rank's chunk rounded to bf16, summed hop by hop
  in a ring with a bf16 rounding after each add, then averaged in bf16);
* float8: ``quantize_chunks`` -> (the all-to-all) -> ``dequantize_and_sum``, the functions
  ``Float8ReduceScatter`` runs around its collective, so the figures are those of the real comm.

``sqnr_*`` columns compare the averaged gradients, whole model (all parameters at once) and worst
single parameter, over every measured step (the minimum); ``flushed_to_0_%`` is the share of
nonzero gradient elements sent that the cast turned into 0 (the most of any measured step). ``bytes/elem`` is what one rank puts
into the collective per gradient element (float8 bytes plus float32 scales, with FSDP2's padding);
``vs_bf16`` / ``vs_fp32`` divide it by the bf16 / fp32 reduce-scatter's.

    PYTHONPATH=$PWD python scripts/bench_reduce_scatter.py --csv /tmp/reduce_scatter_cpu.csv
    # the recorded run: docs/bench/reduce_scatter_cpu.csv
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import report  # noqa: E402
from f8dist.config import E4M3, E5M2  # noqa: E402
from f8dist.parallel.fsdp.reduce_scatter import (  # noqa: E402
    Float8ReduceScatterConfig,
    dequantize_and_sum,
    payload_numel,
    quantize_chunks,
)
from f8dist.models import ModelArgs, Transformer  # noqa: E402
from f8dist.models.data import ByteBatches  # noqa: E402
from f8dist.core.numerics import sqnr_from_energies  # noqa: E402

COLUMNS = [
    "reduce", "format", "block", "bytes/elem", "vs_bf16", "vs_fp32",
    "sqnr_vs_fp32_db", "worst_param_vs_fp32_db", "sqnr_vs_bf16_db", "flushed_to_0_%",
    "note",
]
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}
DEFAULT = Float8ReduceScatterConfig()


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--world", type=int, default=8, help="data-parallel ranks simulated")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--warm-steps", type=int, default=30, help="training steps before measuring")
    parser.add_argument("--measure-steps", type=int, default=3, help="steps measured (min taken)")
    parser.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS))
    parser.add_argument("--blocks", nargs="+", default=["chunk", "1024", "256", "128", "32"],
                        help="elements per scale; 'chunk': one scale per destination chunk")
    parser.add_argument("--csv", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny model, 1 warm-up, 1 step")
    return parser


def fsdp_units(model: Transformer) -> List[List[torch.nn.Parameter]]:
    """The parameters of each FSDP2 unit as scripts/train.py shards them: every block, then the
    root (what no block holds)."""
    units = [list(block.parameters()) for block in model.layers.values()]
    in_blocks = {id(p) for unit in units for p in unit}
    return units + [[p for p in model.parameters() if id(p) not in in_blocks]]


def chunk_layout(grads: List[torch.Tensor], world: int) -> torch.Tensor:
    """FSDP2's reduce-scatter input as [world, n]: row d holds every gradient's (dim-0 padded)
    shard d, gradient after gradient."""
    rows = []
    for g in grads:
        padded = -(-g.shape[0] // world) * world
        g = F.pad(g.reshape(g.shape[0], -1), (0, 0, 0, padded - g.shape[0]))  # [padded, rest]
        rows.append(g.reshape(world, -1))  # [W, padded * rest / W]
    return torch.cat(rows, dim=1)  # [W, n]


def param_spans(params: List[torch.Tensor], world: int) -> List[tuple]:
    """(offset, numel) of each parameter's padded shard within a row of :func:`chunk_layout`."""
    out, offset = [], 0
    for p in params:
        numel = -(-p.shape[0] // world) * p[0].numel()
        out.append((offset, numel))
        offset += numel
    return out


def bf16_ring_mean(flats: torch.Tensor) -> torch.Tensor:
    """[W, W, n] (rank, destination, n) -> [W, n]: a bf16 ring reduce-scatter with AVG."""
    acc = flats[0].to(torch.bfloat16)
    for r in range(1, flats.shape[0]):
        acc = (acc.float() + flats[r].to(torch.bfloat16).float()).to(torch.bfloat16)
    return (acc / flats.shape[0]).float()


def float8_mean(flats: torch.Tensor, config: Float8ReduceScatterConfig, flushed: List[int]):
    """[W, W, n] -> [W, n]: what Float8ReduceScatter gives every destination rank, AVG. Adds to
    ``flushed`` [nonzero elements sent, of which cast to 0]."""
    world, n = flats.shape[0], flats.shape[2]
    out = []
    for d in range(world):
        payload = quantize_chunks(flats[:, d], config)  # [W, m]: row r is what rank r sends d
        sent = flats[:, d] != 0  # [W, n]
        sent[d] = False  # its own chunk stays on rank d
        zero = (payload[:, :n] & 0x7F) == 0  # [W, n]: +0 or -0 in either float8 format
        flushed[0] += int(sent.sum())
        flushed[1] += int((sent & zero).sum())
        out.append(dequantize_and_sum(payload, flats[d, d], d, config) / world)  # [n]
    return torch.stack(out)  # [W, n]


class Energies:
    """Summed squares of reference and error of one step, whole model and per parameter."""

    def __init__(self):
        self.signal = self.error = 0.0
        self.per_param: List[tuple] = []

    def add(self, ref: torch.Tensor, actual: torch.Tensor) -> None:
        s = ref.double().square().sum().item()
        e = (ref.double() - actual.double()).square().sum().item()
        self.signal += s
        self.error += e
        self.per_param.append((s, e))

    def whole_db(self) -> float:
        return sqnr_from_energies(self.signal, self.error)

    def worst_param_db(self) -> float:
        return min(sqnr_from_energies(s, e) for s, e in self.per_param if s > 0)


def measure(units, rank_grads, model, variants, world) -> Dict[str, tuple]:
    """Per variant: SQNR energies (vs fp32, vs bf16) of its reduction of one step's per-rank
    gradients, and [nonzero elements sent, of which flushed to 0 by the cast]."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    out = {name: (Energies(), Energies(), [0, 0]) for name, _ in variants}
    for unit in units:
        flats = torch.stack([
            chunk_layout([grads[index[id(p)]] for p in unit], world) for grads in rank_grads
        ])  # [W ranks, W destinations, n]
        ref = flats.double().sum(0) / world  # [W, n]
        bf16 = bf16_ring_mean(flats)  # [W, n]
        for name, config in variants:
            actual = bf16 if config is None else float8_mean(flats, config, out[name][2])
            for off, numel in param_spans(unit, world):
                out[name][0].add(ref[:, off:off + numel], actual[:, off:off + numel])
                out[name][1].add(bf16[:, off:off + numel], actual[:, off:off + numel])
    return out


def run(args) -> List[dict]:
    if args.smoke:
        args.dim, args.layers, args.seq, args.warm_steps, args.measure_steps = 64, 1, 32, 1, 1
        args.world = min(args.world, 3)
    torch.manual_seed(0)
    margs = ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=4, max_seq_len=args.seq)
    model = Transformer(margs)
    model.init_weights(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    world, global_batch = args.world, args.batch * args.world
    loaders = [ByteBatches(seq_len=args.seq, batch_size=global_batch, seed=0, dp_rank=r,
                           dp_size=world) for r in range(world)]
    units = fsdp_units(model)

    def loss_of(inputs, targets):
        logits = model(inputs)  # [b, S, V]
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    variants = [("bf16", None)]
    for fmt in args.formats:
        for block in args.blocks:
            size = None if block == "chunk" else int(block)
            variants.append((f"{fmt}/{block}", Float8ReduceScatterConfig(
                float8_dtype=FORMATS[fmt], block_size=size)))
    per_step = []  # per measured step: {variant: (Energies vs fp32, Energies vs bf16)}
    for step in range(args.warm_steps + args.measure_steps):
        rank_grads = []  # per rank: its gradients (of its own mean loss)
        for loader in loaders:
            inputs, targets = next(loader)  # [b, S]
            model.zero_grad(set_to_none=True)
            loss_of(inputs, targets).backward()
            rank_grads.append([p.grad for p in model.parameters()])
        for i, p in enumerate(model.parameters()):  # the data-parallel mean
            p.grad = torch.stack([g[i] for g in rank_grads]).mean(0)
        if step >= args.warm_steps:
            per_step.append(measure(units, rank_grads, model, variants, world))
        opt.step()

    # bytes: every unit's flat buffer, padded as FSDP2 pads it
    ns = [chunk_layout([p.detach() for p in u], world).shape[1] for u in units]
    elems = world * sum(ns)
    rows = []
    for name, config in variants:
        if config is None:
            nbytes, fmt, block = 2 * elems, "bf16", "-"
        else:
            nbytes = world * sum(payload_numel(n, config) for n in ns)
            fmt, block = name.split("/")
        row = {
            "reduce": "float8" if config is not None else "bf16",
            "format": fmt, "block": block,
            "bytes/elem": nbytes / elems, "vs_bf16": nbytes / (2 * elems),
            "vs_fp32": nbytes / (4 * elems),
            "sqnr_vs_fp32_db": min(m[name][0].whole_db() for m in per_step),
            "worst_param_vs_fp32_db": min(m[name][0].worst_param_db() for m in per_step),
            "sqnr_vs_bf16_db": None if config is None else min(
                m[name][1].whole_db() for m in per_step),
            "flushed_to_0_%": None if config is None else 100 * max(
                m[name][2][1] / m[name][2][0] for m in per_step),
            "note": "default" if config == DEFAULT else "",
        }
        rows.append(row)
    for row in rows:
        for key in ("sqnr_vs_fp32_db", "worst_param_vs_fp32_db", "sqnr_vs_bf16_db"):
            if row[key] is not None and math.isinf(row[key]):
                row[key] = None
    title = (f"Gradient reduce-scatter on {world} simulated ranks: LLaMA dim {args.dim}, "
             f"{args.layers} layers, seq {args.seq}, batch {args.batch}/rank, steps "
             f"{args.warm_steps + 1}-{args.warm_steps + args.measure_steps} (min SQNR over steps)")
    report(rows, COLUMNS, title=title, device="cpu", csv_path=args.csv)
    return rows


def main(argv: Optional[List[str]] = None) -> List[dict]:
    args = add_args(argparse.ArgumentParser(description=__doc__.split("\n")[0])).parse_args(argv)
    with torch.device("cpu"):  # a CPU benchmark (gloo), whatever the default device
        return run(args)


if __name__ == "__main__":
    main()
