"""Context parallelism's dK / dV reduce-scatter: bytes on the wire vs gradient SQNR, per format
(f8dist/parallel/cp/style.py, [Note: float8 context parallelism]).

One process plays ``--world`` cp ranks: each rank's partial dK and dV are those of its query
shard (causal attention over the whole sequence's K and V, quantized as the style does), and
they are reduced three ways:

* ``fp64``: the exact sum, the reference;
* ``bf16``: what a bf16 reduce-scatter of bf16 gradients does (each partial rounded to bf16, summed
  hop by hop in a ring with a bf16 rounding after each add);
* float8, one fp32 scale per token and head: ``grad_to_wire`` -> (the all-to-all) ->
  ``sum_from_wire``, the functions the style runs around its collective, summed in fp32 and
  returned in bf16.

``bytes/elem`` is what one rank sends per gradient element, ``vs_bf16`` its ratio to bf16's.
q, k, v and the output gradient are gaussian (seed 0); the SQNR is the lowest over dK and dV.

    PYTHONPATH=$PWD python scripts/cp_grad_sqnr.py
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from f8dist.config import E4M3, E5M2
from f8dist.core.numerics import sqnr
from f8dist.models.llama import ScaledDotProductAttention
from f8dist.parallel.cp import KV_SPEC, causal_mask, grad_to_wire, quantize_kv, sum_from_wire


def partial_grads(world: int, batch: int, heads: int, seq: int, head_dim: int):
    """[W, B, H, S, D] partial dK and dV of each rank's query shard, fp32."""
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(batch, heads, seq, head_dim, generator=g) for _ in range(4))
    k, v = quantize_kv(k), quantize_kv(v)
    dks, dvs = [], []
    for rank, (qs, gs) in enumerate(zip(q.chunk(world, 2), grad.chunk(world, 2))):
        kr, vr = k.clone().requires_grad_(), v.clone().requires_grad_()
        mask = causal_mask(qs.shape[2], seq, rank * qs.shape[2])
        ScaledDotProductAttention()(qs, kr, vr, attn_mask=mask).backward(gs)
        dks.append(kr.grad)
        dvs.append(vr.grad)
    return torch.stack(dks), torch.stack(dvs)


def bf16_ring_sum(parts: torch.Tensor) -> torch.Tensor:
    acc = parts[0].to(torch.bfloat16)
    for p in parts[1:]:
        acc = (acc.float() + p.to(torch.bfloat16).float()).to(torch.bfloat16)
    return acc


def float8_sum(parts: torch.Tensor, spec) -> torch.Tensor:
    """What every destination rank gets from the style's float8 reduce-scatter, put together."""
    world = parts.shape[0]
    sent = [grad_to_wire(p, 2, world, spec) for p in parts]  # per source: [W, ...] wire, meta
    out = [sum_from_wire([torch.stack([s[0][i][d] for s in sent]) for i in range(2)],
                         sent[0][1], torch.bfloat16) for d in range(world)]
    return torch.cat(out, 2)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args()
    d = args.head_dim
    print(f"dK, dV [{args.batch}, {args.heads}, {args.seq}, {d}], causal, gaussian, seed 0, "
          f"{torch.__version__}, cpu\n")
    print("| cp | format | SQNR vs fp64 (dB) | bytes/elem | vs_bf16 |")
    print("|---|---|---|---|---|")
    for world in (2, 4, 8):
        dk, dv = partial_grads(world, args.batch, args.heads, args.seq, d)
        exact = [t.double().sum(0) for t in (dk, dv)]
        rows = {"bf16": (lambda t: bf16_ring_sum(t), 2.0)}
        for dtype in (E5M2, E4M3):
            spec = dataclasses.replace(KV_SPEC, dtype=dtype)
            rows[f"{str(dtype)[6:]} per token"] = (lambda t, s=spec: float8_sum(t, s), (d + 4) / d)
        for name, (reduce, nbytes) in rows.items():
            db = min(sqnr(e, reduce(t).double()) for e, t in zip(exact, (dk, dv)))
            print(f"| {world} | {name} | {db:.1f} | {nbytes:.4g} | {nbytes / 2:.4g} |")


if __name__ == "__main__":
    main()
