"""Every collective of one training step, per layout and recipe, float8 against bf16, on simulated
ranks in one process (tests/sim/threads.py: torch's threaded process group, send and recv
included): no torchrun.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python scripts/step_table.py --csv /tmp/step_table.csv

Layouts (the LLaMA model of f8dist/models/llama.py; ``ep``: its MoE variant):
  fsdp  FSDP2 over 2 ranks                 hsdp  FSDP2 over dp_replicate 2 x dp_shard 2
  tp    TP+SP over 2 (parallelize_llama)   cp    context parallel over 2, FSDP2 over cp
  pp    2 stages, 1F1B, 2 micro-batches    ep    dp_shard 2 x ep 2 (fully_shard_moe)
  3d    dp_replicate 2 x dp_shard 2 x tp 2 (HSDP x TP+SP)
Variants: ``bf16`` (no float8 anywhere: high-precision CP gather, PP boundary and EP all-to-alls)
and each recipe, with the layout's float8 wire on: TP's float8 styles, ``Float8ContextParallel``,
the PP float8 boundary, ``Float8ExpertParallel``. Options: ``fp8-ag`` (FSDP2 float8 all-gather),
``precompute`` (``precompute_float8_dynamic_scale_for_fsdp`` after the optimizer step),
``fp8-rs`` (``enable_float8_reduce_scatter``), ``hp-wire`` (the recipe's linears, the layout's
high-precision CP gather, PP boundary and EP all-to-alls: scripts/path_costs.py's baseline), ``recast`` and ``derive`` (``sp_grad_weight``; the
default is "forward_gather"), ``grad_spec`` (``Float8ContextParallel(grad_spec=KV_SPEC)``), ``combine+bwd``
(``Float8ExpertParallel(float8_combine=True, float8_backward=True)``). FSDP2 all-gathers bf16
weights (``MixedPrecisionPolicy(param_dtype=bfloat16)``) and reduces fp32 gradients.

Counted by ``f8dist.testing.count_collectives`` on rank 0 over the second step (forward,
backward, SGD step, precompute), per kind: calls, buffer bytes ([Note: buffer bytes]) and
``wires``: those bytes per mesh dim and dtype written (uint8: float8 bytes and e8m0 scales; the
PP boundary packs its float8 bytes and scales into the activation's dtype). Deterministic: the same
bytes on any machine (EP's all-to-alls follow the routing, which float8 numerics may change).
A second table (item 4 of issue 36) sets the float8 operands that TP+SP all-gathers against the
bf16 bytes of the same tensors.

[Note: buffer bytes]
A row's bytes are each collective's whole buffer: an all-gather's output, a reduce-scatter's or
all-to-all's input (before it is split), an all-reduce's tensor, a send's or receive's message.
Each rank moves (W - 1) / W of it over a group of W ranks (twice that for an all-reduce), so a
float8 reduce-scatter's all-to-all compares with the reduce-scatter it replaces byte for byte.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NamedTuple, Tuple

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), ROOT]

from bench_common import report  # noqa: E402
from f8dist import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from f8dist.models import ModelArgs, Transformer  # noqa: E402
from f8dist.parallel.cp import KV_SPEC, Float8ContextParallel  # noqa: E402
from f8dist.testing import count_collectives  # noqa: E402
from tests.sim.threads import run_threads  # noqa: E402  (simulated ranks: the tests' harness)

COLUMNS = ["layout", "variant", "kind", "calls", "bytes", "bytes_vs_bf16", "wires", "note"]
SP_COLUMNS = ["variant", "float8_bytes", "bf16_bytes", "float8_vs_bf16", "high_precision_bytes"]
RECIPES = ("tensorwise", "rowwise", "mxfp8", "blockwise")
BLOCK_RECIPES = ("mxfp8", "blockwise", "mxfp8_square_weights")
# layout -> (mesh shape, mesh dim names)
MESHES = {
    "fsdp": ((2,), ("dp_shard",)),
    "hsdp": ((2, 2), ("dp_replicate", "dp_shard")),
    "tp": ((2,), ("tp",)),
    "cp": ((2,), ("cp",)),
    "pp": ((2,), ("pp",)),
    "ep": ((2, 2), ("dp_shard", "ep")),
    "3d": ((2, 2, 2), ("dp_replicate", "dp_shard", "tp")),
}
LAYOUTS = tuple(MESHES)
SP_GRAD_WEIGHT = ("recast", "derive")  # the options that set sp_grad_weight


class Variant(NamedTuple):
    """A row group: ``recipe`` None is bf16; ``options`` from the module docstring."""

    recipe: str | None = None
    options: Tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return "+".join((self.recipe or "bf16",) + self.options)


def variants(layout: str) -> list:
    out = [Variant()] + [Variant(r) for r in RECIPES]
    extra = {
        "fsdp": [("tensorwise", ("fp8-ag",)), ("tensorwise", ("fp8-ag", "precompute")),
                 ("tensorwise", ("fp8-ag", "precompute", "fp8-rs")),
                 ("mxfp8_square_weights", ("fp8-ag",)), ("blockwise", ("fp8-ag",))],
        "hsdp": [("tensorwise", ("fp8-ag", "precompute")),
                 ("tensorwise", ("fp8-ag", "precompute", "fp8-rs"))],
        "tp": [("mxfp8", ("recast",)), ("blockwise", ("recast",)), ("mxfp8", ("derive",)),
               ("blockwise", ("derive",))],
        "cp": [("tensorwise", ("grad_spec",)), ("rowwise", ("grad_spec",))],
        "ep": [("rowwise", ("combine+bwd",))],
        "3d": [("tensorwise", ("fp8-ag", "precompute")),
               ("tensorwise", ("fp8-ag", "precompute", "fp8-rs"))],
    }
    return out + [Variant(r, o) for r, o in extra.get(layout, [])]


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--dim", type=int, default=256,
                        help="model width (TP shards of 128x128 blocks need 256)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2, help="sequences per data-parallel rank")
    parser.add_argument("--seq", type=int, default=256,
                        help="sequence length (TP and CP shards of 128-token blocks need 256)")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--csv", default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model (dim 64, 1 layer, seq 16): the test's config")
    return parser


def smoke_args(argv=()) -> argparse.Namespace:
    return add_args(argparse.ArgumentParser()).parse_args(["--smoke", *argv])


def model_args(args) -> ModelArgs:
    if args.smoke:
        return ModelArgs(dim=64, n_layers=2, n_heads=4, max_seq_len=16)
    return ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64, multiple_of=256,
                     max_seq_len=args.seq)


class HighPrecisionContextParallel(Float8ContextParallel):
    """The bf16 baseline of ``Float8ContextParallel``: K and V all-gathered in their dtype, dK and
    dV reduce-scattered (torch's all-gather context parallelism)."""

    def _gather_kv(self, k, v, mesh):
        return tuple(funcol.wait_tensor(funcol.all_gather_single_autograd(
            t.contiguous(), self.seq_dim, mesh.get_group())) for t in (k, v))  # [B, Hkv, S, D]


def _model(layout: str, variant: Variant, margs: ModelArgs):
    if layout == "ep":
        from f8dist.models.moe import MoEArgs, MoETransformer

        model = MoETransformer(margs, MoEArgs(num_experts=4, top_k=2, aux_loss_coef=0.0))
    else:
        model = Transformer(margs)
    model.init_weights(seed=0)
    if variant.recipe is not None:
        config = Float8LinearConfig.from_recipe_name(variant.recipe).replace(
            enable_fsdp_float8_all_gather="fp8-ag" in variant.options,
            sp_grad_weight=next((o for o in variant.options if o in SP_GRAD_WEIGHT),
                                "forward_gather"))
        convert_to_float8_training(model, config=config,
                                   module_filter_fn=lambda mod, fqn: fqn != "output",
                                   skip_incompatible=variant.recipe not in BLOCK_RECIPES)
    return model


def _mp():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _fully_shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=_mp())
    fully_shard(model, mesh=mesh, mp_policy=_mp())


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())  # [B * S, vocab]


def _rank_step(layout: str, variant: Variant, args, margs: ModelArgs):
    """This rank's model laid out for ``layout``, and a function running one training step."""
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = MESHES[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    float8 = variant.recipe is not None
    wire = float8 and "hp-wire" not in variant.options  # the layout's float8 wire
    model = _model(layout, variant, margs)
    seq = margs.max_seq_len
    # the same sequences on every rank; EP's ranks route batches of their own
    g = torch.Generator().manual_seed(torch.distributed.get_rank() if layout == "ep" else 0)
    tokens = torch.randint(0, margs.vocab_size, (args.batch, seq + 1), generator=g)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    if layout == "pp":
        from torch.distributed.pipelining import Schedule1F1B

        from f8dist.models.llama_pp import pipeline_stage, split_llama

        rank = mesh["pp"].get_local_rank()
        stage = split_llama(model, rank, 2, float8=wire).to(torch.bfloat16)
        micro = (args.batch // 2, seq)
        pipe = Schedule1F1B(pipeline_stage(stage, rank, 2, micro, mesh["pp"].get_group(),
                                           torch.bfloat16), 2, loss_fn=_loss)
        opt = torch.optim.SGD(stage.parameters(), lr=1e-3)

        def step():
            opt.zero_grad()
            pipe.step(inputs) if rank == 0 else pipe.step(target=targets)
            opt.step()
        return step

    if layout in ("tp", "3d"):
        from f8dist.models import parallelize_llama

        parallelize_llama(model, mesh["tp"], float8=float8)
    if layout == "cp":
        from f8dist.models import parallelize_llama_cp

        cp = mesh["cp"]
        style = (HighPrecisionContextParallel() if not wire else Float8ContextParallel(
            grad_spec=KV_SPEC if "grad_spec" in variant.options else None))
        parallelize_llama_cp(model, cp, style)
        shard = slice(cp.get_local_rank() * seq // 2, (cp.get_local_rank() + 1) * seq // 2)
        inputs, targets = inputs[:, shard], targets[:, shard]
    if layout == "ep":
        from f8dist.models.moe_parallel import fully_shard_moe, parallelize_moe

        parallelize_moe(model, mesh["ep"], float8_dispatch=wire,
                        float8_combine="combine+bwd" in variant.options,
                        float8_backward="combine+bwd" in variant.options)
        fully_shard_moe(model, mesh, mp_policy=_mp())
    elif layout == "tp":
        model = model.to(torch.bfloat16)
    else:
        dp = {"fsdp": ("dp_shard",), "cp": ("cp",)}.get(layout, ("dp_replicate", "dp_shard"))
        _fully_shard(model, mesh[dp])
    if "fp8-rs" in variant.options:
        from f8dist.parallel.fsdp import enable_float8_reduce_scatter

        enable_float8_reduce_scatter(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad()
        logits = model(inputs)
        loss = _loss(logits, targets)
        if layout == "ep":
            loss = loss + model.aux_loss()
        loss.backward()
        opt.step()
        if "precompute" in variant.options:
            from f8dist.parallel.fsdp import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)
    return step


def _dim_names(layout: str) -> dict:
    """Sorted global ranks of rank 0's group over each set of mesh dims -> "a x b"."""
    import itertools

    shape, names = MESHES[layout]
    ranks = torch.arange(len(torch.empty(shape).flatten())).reshape(shape)
    out = {}
    for n in range(len(names), 0, -1):
        for dims in itertools.combinations(range(len(names)), n):
            index = tuple(slice(None) if d in dims else 0 for d in range(len(names)))
            out[tuple(sorted(ranks[index].flatten().tolist()))] = "x".join(names[d] for d in dims)
    return out


def buffer_bytes(kind: str, wire) -> int:
    """The collective's whole buffer ([Note: buffer bytes]) of ``wire`` = [calls, input bytes,
    output bytes]."""
    return wire[2] if kind == "all_gather" else wire[1]


def measure(layout: str, variant: Variant, args) -> dict:
    """Rank 0's counts of one training step (after an uncounted warm-up step): kind -> (calls,
    buffer bytes, {(mesh dims, dtype): buffer bytes})."""
    margs = model_args(args)
    world = len(torch.empty(MESHES[layout][0]).flatten())

    def rank_main(rank: int):
        step = _rank_step(layout, variant, args, margs)
        step()  # lazy inits (FSDP2, the pipeline's buffers) and the first precompute
        with count_collectives() as counts:
            step()
        return counts

    counts = run_threads(world, rank_main)[0]
    names = _dim_names(layout)
    out = {}
    for kind, s in counts.as_dict().items():
        wires = {(names.get(r, str(r)), dtype): buffer_bytes(kind, w)
                 for (r, dtype), w in counts[kind].wires.items()}
        out[kind] = (s["calls"], sum(wires.values()), wires)
    return out


def _wires(wires: dict) -> str:
    return "; ".join(f"{dims} {dtype} {b}" for (dims, dtype), b in sorted(wires.items()))


def rows_of(layout: str, variant: Variant, counts: dict, baseline: dict) -> list:
    """Table rows of one measured variant: a row per kind and a ``total`` row."""
    rows = []
    for kind, (calls, nbytes, wires) in sorted(counts.items()):
        base = baseline.get(kind, (0, 0))[1]
        rows.append({"layout": layout, "variant": variant.name, "kind": kind, "calls": calls,
                     "bytes": nbytes, "bytes_vs_bf16": nbytes / base if base else None,
                     "wires": _wires(wires)})
    total, base = (sum(c[1] for c in d.values()) for d in (counts, baseline))
    rows.append({"layout": layout, "variant": variant.name, "kind": "total",
                 "calls": sum(c[0] for c in counts.values()), "bytes": total,
                 "bytes_vs_bf16": total / base if base else None})
    return rows


def sp_rows(tp: dict) -> list:
    """TP+SP's all-gathers of float8 operands: each float8 variant's uint8 bytes over tp against
    bf16's bytes of the same tensors (bf16's all-gathers less those the variant keeps in bf16).
    ``tp``: variant name -> counts of the tp layout."""
    def gathered(counts, dtype):
        return counts.get("all_gather", (0, 0, {}))[2].get(("tp", dtype), 0)

    bf16 = gathered(tp["bf16"], "bfloat16")
    rows = []
    for name, counts in tp.items():
        fp8, high = gathered(counts, "uint8"), gathered(counts, "bfloat16")
        if name != "bf16" and fp8:
            rows.append({"variant": name, "float8_bytes": fp8, "bf16_bytes": bf16 - high,
                         "float8_vs_bf16": fp8 / (bf16 - high), "high_precision_bytes": high})
    return rows


def run(args) -> list:
    rows, tp = [], {}
    for layout in args.layouts:
        baseline = {}
        for variant in variants(layout):
            try:
                counts = measure(layout, variant, args)
            except (ValueError, NotImplementedError) as e:  # a layout the recipe lacks
                if variant.recipe is None:
                    raise
                note = str(e).splitlines()[0]
                rows.append({"layout": layout, "variant": variant.name,
                             "note": "not run: " + (note[:90] + "..." if len(note) > 90 else note)})
                continue
            if variant.recipe is None:
                baseline = counts
            if layout == "tp":
                tp[variant.name] = counts
            rows += rows_of(layout, variant, counts, baseline)
    margs = model_args(args)
    shape = (f"dim {margs.dim}, {margs.n_layers} layers, batch {args.batch} x seq "
             f"{margs.max_seq_len} per data-parallel rank")
    report(rows, COLUMNS, title=f"Collectives of one training step on rank 0 ({shape})",
           device="cpu", csv_path=args.csv)
    if tp:
        report(sp_rows(tp), SP_COLUMNS, title=f"TP+SP all-gathers of float8 operands ({shape})",
               device="cpu", csv_path=None)
    return rows


def main(argv=None) -> list:
    args = add_args(argparse.ArgumentParser(description=__doc__.split("\n")[0])).parse_args(argv)
    return run(args)


if __name__ == "__main__":
    main()
