"""What each float8 wire path costs in memory and compute: one training step of its layout on
simulated ranks (scripts/step_table.py's steps, tests/sim/threads.py), the high-precision wire
against the float8 wire with the same recipe for the linears, counted on rank 0.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python scripts/path_costs.py --smoke

Paths (step_table's variants; ``hp-wire``: the recipe's linears, the layout's bf16 wire):
  cp    Float8ContextParallel: K/V cast per token and head before the all-gather; ``grad_spec``:
        dK/dV cast before their reduce-scatter
  pp    the float8 stage boundary (1F1B, 2 micro-batches): e4m3 activations, e5m2 gradients
  ep    Float8ExpertParallel: the dispatch; ``combine+bwd``: the combine and both backward
        all-to-alls too
  tp    TP+SP with sp_grad_weight "forward_gather" (the default) against "derive"
  hsdp  the float8 reduce-scatter (``fp8-rs``), which also reduces over dp_replicate in float8
        ([Note: float8 HSDP])

Columns, over rank 0's second step (forward, backward, optimizer step), by :class:`StepCosts`:
``casts``: ops that make a float8 tensor from a high-precision one (every quantization, whatever
calls it), ``cast_elems`` their elements, ``dequants`` ops that make a high-precision tensor from
a float8 one; ``kept``: bytes the step allocated that are alive when its first backward op runs
(what the forward keeps for backward: the same count as ``f8dist.testing.measure_fwd_bwd``'s,
here over a whole step; PP: at the stage's first backward, after its warm-up forwards);
``scales``: the part of ``kept`` that is scales of ``cast_to_float8``'s outputs; ``peak``: most
bytes alive at once over the step. The ``d_`` columns: the row less its path's first row.
"""

from __future__ import annotations

import argparse
import os
import sys
import weakref

import torch
from torch.utils._pytree import tree_leaves

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), ROOT]

import step_table  # noqa: E402
from bench_common import report  # noqa: E402
from f8dist.core import cast as _cast  # noqa: E402
from f8dist.testing import LiveBytes  # noqa: E402
from f8dist.testing.memory import storages  # noqa: E402
from step_table import Variant  # noqa: E402
from tests.sim.threads import run_threads  # noqa: E402

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)  # e8m0 is a scale dtype, not a cast's bytes
# path -> (layout, variants: the first is the baseline the d_ columns subtract)
PATHS = {
    "cp": ("cp", [Variant("tensorwise", ("hp-wire",)), Variant("tensorwise"),
                  Variant("tensorwise", ("grad_spec",))]),
    "pp": ("pp", [Variant("tensorwise", ("hp-wire",)), Variant("tensorwise")]),
    "ep": ("ep", [Variant("rowwise", ("hp-wire",)), Variant("rowwise"),
                  Variant("rowwise", ("combine+bwd",))]),
    "tp": ("tp", [Variant("mxfp8"), Variant("mxfp8", ("derive",))]),
    "hsdp": ("hsdp", [Variant("tensorwise", ("fp8-ag", "precompute")),
                      Variant("tensorwise", ("fp8-ag", "precompute", "fp8-rs"))]),
}
COUNTS = ["casts", "cast_elems", "dequants", "kept", "scales", "peak"]
DELTAS = ["casts", "dequants", "kept", "scales", "peak"]
COLUMNS = ["path", "variant", *COUNTS, *(f"d_{c}" for c in DELTAS)]


class StepCosts(LiveBytes):
    """:class:`LiveBytes` that also counts casts to and from float8 and, at the first op run in
    backward, the bytes alive then (``kept``) and the part of them that is cast scales."""

    def __init__(self):
        super().__init__()
        self.casts = self.cast_elems = self.dequants = 0
        self.kept = self.scales = None
        self._scales = weakref.WeakKeyDictionary()  # scale storages of cast_to_float8's outputs

    def _observe(self, site, hp, out) -> None:
        for st in storages(out)[1:]:  # [data, scale, ...]: [Note: counting bytes without...]
            self._scales[st] = st.nbytes()

    def __enter__(self):
        _cast.cast_observers.append(self._observe)
        return super().__enter__()

    def __exit__(self, *exc):
        _cast.cast_observers.remove(self._observe)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.kept is None and torch._C._current_graph_task_id() != -1:  # backward began
            self.kept = self.current
            self.scales = sum(n for st, n in self._scales.items() if st in self._seen)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is NotImplemented or func._schema.is_mutable or func.is_view:
            return out
        dtypes = {a.dtype for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            if t.dtype in FLOAT8 and not dtypes & set(FLOAT8):
                self.casts, self.cast_elems = self.casts + 1, self.cast_elems + t.numel()
            elif t.dtype.is_floating_point and t.dtype not in FLOAT8 and dtypes & set(FLOAT8):
                self.dequants += 1
        return out

    def as_row(self) -> dict:
        return {"casts": self.casts, "cast_elems": self.cast_elems, "dequants": self.dequants,
                "kept": self.kept, "scales": self.scales, "peak": self.peak}


def measure(layout: str, variant: Variant, args) -> dict:
    """Rank 0's :class:`StepCosts` row of one training step (after an uncounted warm-up step)."""
    margs = step_table.model_args(args)
    world = len(torch.empty(step_table.MESHES[layout][0]).flatten())

    def rank_main(rank: int):
        step = step_table._rank_step(layout, variant, args, margs)
        step()  # lazy inits (FSDP2, the pipeline's buffers) and the first precompute
        costs = StepCosts()
        with costs:
            step()
        return costs.as_row() if rank == 0 else None

    return run_threads(world, rank_main)[0]


def path_rows(path: str, args) -> list:
    layout, variants = PATHS[path]
    rows = []
    for variant in variants:
        row = {"path": path, "variant": variant.name, **measure(layout, variant, args)}
        base = rows[0] if rows else row
        rows.append({**row, **{f"d_{c}": row[c] - base[c] for c in DELTAS}})
    return rows


def main(argv=None) -> list:
    parser = step_table.add_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.set_defaults(layouts=None)
    parser.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    args = parser.parse_args(argv)
    rows = [r for path in args.paths for r in path_rows(path, args)]
    margs = step_table.model_args(args)
    shape = (f"dim {margs.dim}, {margs.n_layers} layers, batch {args.batch} x seq "
             f"{margs.max_seq_len} per data-parallel rank")
    report(rows, COLUMNS, title=f"What each wire path costs, rank 0, one step ({shape})",
           device="cpu", csv_path=args.csv)
    return rows


if __name__ == "__main__":
    main()
