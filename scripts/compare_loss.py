"""Train the same model on the same data with bf16 and each float8 recipe; write a loss table
(markdown) and a loss-curve plot (PNG, needs matplotlib: ``pip install -e ".[plot]"``).

Every run goes through ``train.py``'s loop; flags this script does not know are passed on to it::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 scripts/compare_loss.py \\
        --out-dir /tmp/loss_fsdp --steps 100
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 scripts/compare_loss.py \\
        --out-dir /tmp/loss_tp --steps 100 --tp 2

The "final loss" is the mean of the last ``--tail`` steps (one step's loss is one small batch's).
``--optim-states fp32,8bit`` trains each recipe with each kind of AdamW state (a run is named
``recipe/states``, e.g. ``tensorwise/8bit``) and compares each with its recipe's fp32 states too.
``--versus mxfp8`` adds each run's gap to that recipe's run; ``--gap-at 100,200,400`` prints a
second table, each run's loss at those steps (the mean of the ``--tail`` steps up to each) and
its gaps, to show what a gap does as a run goes on (the learning rate decays to 10% at
``--steps``, so step 100 of a 400-step run is not a 100-step run's end)::

    OMP_NUM_THREADS=1 python scripts/compare_loss.py --out-dir /tmp/loss_long --steps 400 \
        --recipes none,mxfp8,nvfp4 --versus mxfp8 --gap-at 100,200,300,400
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Sequence

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from teardown import exit_cleanly  # noqa: E402
import train  # noqa: E402  (scripts/train.py)

DEFAULT_RECIPES = ("none", "tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed")


def final_loss(losses: List[float], tail: int) -> float:
    tail_losses = losses[-tail:]
    return sum(tail_losses) / len(tail_losses)


def _delta(loss: float, base: Optional[float]) -> str:
    return "" if base is None else f"{100 * (loss - base) / base:+.2f}%"


def _label(name: str) -> str:
    recipe, _, kind = name.partition("/")
    return ("bf16" if recipe == "none" else recipe) + (f", {kind} states" if kind else "")


def loss_table(curves: Dict[str, List[float]], tail: int, title: str,
               versus: Optional[str] = None) -> str:
    """Markdown table: each run's final loss and its difference from bf16's. Runs named
    ``recipe/states`` (``--optim-states``) also get their difference from ``recipe/fp32``;
    with ``versus`` (a run's name) every other run its difference from that run's too."""
    bf16 = next((name for name in ("none", "none/fp32") if name in curves), None)
    base = final_loss(curves[bf16], tail) if bf16 is not None else None
    other = final_loss(curves[versus], tail) if versus is not None else None
    states = any("/" in name for name in curves)
    head = f"| recipe | final loss (mean of last {tail} steps) | vs bf16 |"
    head += " vs fp32 states |" if states else ""
    head += f" vs {_label(versus)} |" if versus is not None else ""
    rows = [f"### {title}", "", head, "|---" * head.count(" |") + "|"]
    for name, losses in curves.items():
        loss = final_loss(losses, tail)
        recipe, _, kind = name.partition("/")
        row = f"| {_label(name)} | {loss:.4f} | {'' if name == bf16 else _delta(loss, base)} |"
        if states:
            fp32 = curves.get(f"{recipe}/fp32")
            versus_fp32 = "" if kind == "fp32" or fp32 is None else _delta(loss, final_loss(fp32, tail))
            row += f" {versus_fp32} |"
        if versus is not None:
            row += f" {'' if name == versus else _delta(loss, other)} |"
        rows.append(row)
    return "\n".join(rows) + "\n"


def gap_table(curves: Dict[str, List[float]], steps: List[int], points: List[int], tail: int,
              versus: Optional[str] = None) -> str:
    """Markdown table: a row per step of ``points``, each run's loss there (the mean of the
    ``tail`` steps up to it) and, but for bf16's (and ``versus``'s) own, its gap to bf16's
    (``/`` its gap to ``versus``'s)."""
    bf16 = next((name for name in ("none", "none/fp32") if name in curves), None)
    gaps = "vs bf16" + (f" / vs {_label(versus)}" if versus is not None else "")
    rows = [f"| step | {' | '.join(_label(name) for name in curves)} |",
            "|---" * (len(curves) + 1) + "|"]
    for point in points:
        upto = steps.index(point) + 1
        at = {name: final_loss(losses[:upto], tail) for name, losses in curves.items()}
        cells = []
        for name, loss in at.items():
            shown = [_delta(loss, at[ref]) for ref in (bf16, versus)
                     if ref is not None and ref != name]
            cells.append(f"{loss:.4f}" + (f" ({' / '.join(shown)})" if name != bf16 and shown
                                          else ""))
        rows.append(f"| {point} | {' | '.join(cells)} |")
    return (f"loss at each step (mean of the {tail} steps up to it; in brackets {gaps}):\n\n"
            + "\n".join(rows) + "\n")


def plot(curves: Dict[str, List[float]], steps: List[int], path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('matplotlib is not installed (pip install -e ".[plot]"): no plot written', flush=True)
        return False
    fig, (ax, diff) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True,
                                   gridspec_kw={"height_ratios": [2, 1]})
    bf16 = next((name for name in ("none", "none/fp32") if name in curves), None)
    for i, (name, losses) in enumerate(curves.items()):
        recipe, _, kind = name.partition("/")
        label = "bf16" if recipe == "none" else f"float8 {recipe}"
        label += f", {kind} states" if kind else ""
        color = f"C{i}"
        ax.plot(steps, losses, label=label, color=color, lw=1.2)
        if bf16 is not None and name != bf16:
            diff.plot(steps, [a - b for a, b in zip(losses, curves[bf16])], color=color, lw=1.0)
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    diff.axhline(0.0, color="black", lw=0.8)
    diff.set_xlabel("step")
    diff.set_ylabel("loss - bf16 loss")
    diff.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, List[float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default=",".join(DEFAULT_RECIPES),
                   help="comma-separated --float8 values; 'none' is the bf16 baseline")
    p.add_argument("--out-dir", default="loss_compare")
    p.add_argument("--tail", type=int, default=10)
    p.add_argument("--optim-states", default=None,
                   help="comma-separated train.py --optim-states values to cross with the recipes")
    p.add_argument("--versus", default=None,
                   help="one of --recipes: every other run's gap to it too (e.g. mxfp8)")
    p.add_argument("--gap-at", default=None,
                   help="comma-separated steps: a second table, each run's loss and gaps there")
    args, train_argv = p.parse_known_args(argv)
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = sorted(set(recipes) - set(train.RECIPES))
    if unknown:
        p.error(f"unknown recipes {unknown}; choose from {list(train.RECIPES)}")
    kinds = [k for k in (args.optim_states or "").split(",") if k]
    if sorted(set(kinds) - set(train.OPTIM_STATES)):
        p.error(f"--optim-states takes {list(train.OPTIM_STATES)}")
    if args.versus is not None and (args.versus not in recipes or kinds):
        p.error(f"--versus {args.versus}: one of --recipes {recipes}, without --optim-states")
    points = [int(x) for x in (args.gap_at or "").split(",") if x]
    last = train.parse_flags(train_argv)[1].steps if points else 0  # torch-free
    if any(not 1 <= x <= last for x in points):
        p.error(f"--gap-at {args.gap_at}: steps from 1 to --steps {last}")

    curves, steps = {}, []
    for recipe in recipes:
        for kind in kinds or [None]:
            flags = ["--float8", recipe] + (["--optim-states", kind] if kind else [])
            run_args = train.parse_args([*train_argv, *flags])
            result = train.train(run_args)
            curves[recipe if kind is None else f"{recipe}/{kind}"] = result["losses"]
            steps = result["steps"]
    if dist.get_rank() == 0:
        layout = f"dp={dist.get_world_size() // run_args.tp} tp={run_args.tp}"
        if run_args.moe_experts:  # scripts/train.py's MoE model
            layout += (f" ep={run_args.ep}, MoE {run_args.moe_experts} experts "
                       f"top-{run_args.moe_top_k}")
        title = f"{run_args.steps} steps, {layout}, seed {run_args.seed}"
        os.makedirs(args.out_dir, exist_ok=True)
        table = loss_table(curves, args.tail, title, args.versus)
        if points:
            table += "\n" + gap_table(curves, steps, points, args.tail, args.versus)
        with open(os.path.join(args.out_dir, "loss_table.md"), "w") as f:
            f.write(table)
        with open(os.path.join(args.out_dir, "losses.json"), "w") as f:
            json.dump({"steps": steps, "losses": curves, "train_argv": train_argv}, f)
        png = os.path.join(args.out_dir, "loss_curves.png")
        print(table, flush=True)
        if plot(curves, steps, png, f"bf16 vs float8: {title}"):
            print(f"plot: {png}", flush=True)
    return curves


if __name__ == "__main__":
    with exit_cleanly():  # [Note: gloo teardown] in scripts/teardown.py
        main()
