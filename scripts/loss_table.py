"""The loss of each parallel layout in bf16 and in float8, from one torchrun job: train.py's loop
(scripts/compare_loss.py's final loss) for every layout of ``--layouts``, once with
``--float8 none`` and once with the layout's float8 recipe and options, and one markdown row per
layout with the relative gap::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 scripts/loss_table.py \\
        --steps 40 --log-every 40

A layout runs on its own number of ranks (``RANKS``, else 2): without ``--layouts`` the job runs
those of its world size (``--nproc_per_node=4 ... --layouts hsdp`` for HSDP).

Flags this script does not know go to every run (``--steps``, ``--seed``, the model's size).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_loss import final_loss  # noqa: E402
from teardown import exit_cleanly  # noqa: E402
import train  # noqa: E402  (scripts/train.py)

# name: (the flags of both runs, the float8 run's own flags); the float8 run moves float8 on the
# layout's own collective (cp: K and V; pp: the stage boundary; ep: every all-to-all)
MOE = ["--moe-experts", "4", "--ep", "2"]
LAYOUTS: Dict[str, Tuple[List[str], List[str]]] = {
    "fsdp2": ([], ["--float8", "tensorwise"]),
    "cp2": (["--cp", "2"], ["--float8", "tensorwise"]),
    "pp2": (["--pp", "2"], ["--float8", "tensorwise"]),
    "ep2": (MOE, ["--float8", "rowwise"]),  # the dispatch alone in float8 (the default)
    "ep2_all": (MOE, ["--float8", "rowwise", "--float8-ep-combine", "--float8-ep-backward"]),
    # 2 replicas of 2 shards: weights gathered, gradients reduced over both axes in float8
    "hsdp": (["--dp-replicate", "2"],
             ["--float8", "tensorwise", "--float8-all-gather", "--float8-reduce-scatter"]),
}
RANKS = {"hsdp": 4}  # a layout's ranks, where not 2


def ranks_of(name: str) -> int:
    return RANKS.get(name, 2)


def layout_row(name: str, bf16: List[float], float8: List[float], float8_flags: List[str],
               tail: int) -> str:
    """``| layout | float8 flags | bf16 | float8 | gap |``, the losses the mean of the last
    ``tail`` steps (compare_loss's final loss), the gap relative to bf16's."""
    base, loss = final_loss(bf16, tail), final_loss(float8, tail)
    return (f"| {name} | `{' '.join(float8_flags)}` | {base:.4f} | {loss:.4f} | "
            f"{100 * (loss - base) / base:+.2f}% |")


def main(argv: Optional[Sequence[str]] = None) -> List[str]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default=None,
                   help=f"comma-separated, of {', '.join(LAYOUTS)} (default: those that run on "
                        "this job's ranks)")
    p.add_argument("--tail", type=int, default=10, help="final loss: the mean of the last N steps")
    args, train_argv = p.parse_known_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.layouts is None:
        args.layouts = ",".join(n for n in LAYOUTS if ranks_of(n) == world)
    names = [n for n in args.layouts.split(",") if n]
    unknown = sorted(set(names) - set(LAYOUTS))
    if unknown:
        p.error(f"--layouts {args.layouts}: unknown {unknown}; choose from {list(LAYOUTS)}")
    misfit = [f"{n} ({ranks_of(n)})" for n in names if ranks_of(n) != world]
    if misfit or not names:
        p.error(f"--layouts {args.layouts}: each layout runs on its own number of ranks, this "
                f"job has {world}: {', '.join(misfit) or 'none runs on it'}; run those with "
                "torchrun --nproc_per_node=N --layouts ...")
    rows = [f"| layout | float8 run | bf16: final loss (mean of last {args.tail} steps) | "
            "float8: final loss | gap |", "|---|---|---|---|---|"]
    for name in names:
        both, float8 = LAYOUTS[name]
        bf16 = train.train(train.parse_args([*train_argv, *both, "--float8", "none"]))["losses"]
        fp8 = train.train(train.parse_args([*train_argv, *both, *float8]))["losses"]
        rows.append(layout_row(name, bf16, fp8, float8, args.tail))
    if dist.get_rank() == 0:
        print("\n".join(rows), flush=True)
    return rows


if __name__ == "__main__":
    with exit_cleanly():  # [Note: gloo teardown] in scripts/teardown.py
        main()
