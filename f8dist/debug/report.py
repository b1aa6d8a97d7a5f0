"""Readable reports of recorded cast statistics: a text table and a PNG plot over steps."""

from __future__ import annotations

import math
from typing import Dict, List, Mapping

from f8dist.core.cast import CastSite
from f8dist.debug.stats import CastStats, worst_per_layer

__all__ = ["format_table", "plot_history"]

_COLUMNS = ("module", "gemm", "operand", "dtype", "amax", "scale", "sat %", "uflow %", "SQNR dB")
# with block-scaled casts: the share of blocks with a saturated / underflowed element, and the
# 1st..99th percentile of the block amaxes (powers of 2)
_BLOCK_COLUMNS = ("blk sat %", "blk uflow %", "blk amax p1..p99")


def _num(x: float) -> str:
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return f"{x:.3g}" if x != 0 else "0"


def _block_cells(s: CastStats):
    if not s.blocks:
        return ("-", "-", "-")
    return (f"{100 * s.blocks_saturated_frac:.2f}", f"{100 * s.blocks_underflow_frac:.2f}",
            f"{_num(s.block_amax_quantile(0.01))}..{_num(s.block_amax_quantile(0.99))}")


def _row(site: CastSite, s: CastStats):
    scale = _num(s.scale_min) if s.scale_min == s.scale_max else (
        f"{_num(s.scale_min)}..{_num(s.scale_max)}"
    ) if s.scale_min <= s.scale_max else "-"  # only empty casts: no scale

    return (
        site.fqn or "<root>",
        site.gemm,
        site.operand,
        str(s.float8_dtype).replace("torch.float8_", ""),
        _num(s.amax),
        scale,
        f"{100 * s.saturated_frac:.3f}",
        f"{100 * s.underflow_frac:.3f}",
        f"{s.sqnr_db:.1f}",
    )


def format_table(stats: Mapping[CastSite, CastStats], *, title: str = "float8 casts") -> str:
    """One row per module / gemm / operand: amax, scale (``min..max`` for axiswise scales),
    saturated % (of all elements), underflow % (of nonzero ones), SQNR, and block columns.

    Example::

        float8 casts, step 3
        module  gemm         operand      dtype  amax  scale  sat %  uflow %  SQNR dB
        0       output       input        e4m3fn 3.1   145    0.000  0.000    30.9
    """
    rows = [_COLUMNS] + [_row(site, s) for site, s in stats.items()]
    if len(rows) == 1:
        return f"{title}: no casts recorded"
    if any(s.blocks for s in stats.values()):
        rows = [rows[0] + _BLOCK_COLUMNS] + [
            r + _block_cells(s) for r, s in zip(rows[1:], stats.values())]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [title]
    for i, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    keys = {(site.fqn, site.gemm, site.operand) for site in stats}
    sources = {"input": "output", "grad_output": "grad_input"}  # where a reused cast was recorded
    if any((f, "grad_weight", o) not in keys for f, g, o in keys if sources.get(o) == g):
        lines.append("(a missing grad_weight row: that gemm reuses the float8 bytes of the "
                     "output/input or grad_input/grad_output cast, or runs in high precision)")
    return "\n".join(lines)


def plot_history(history: Dict[int, Mapping[CastSite, CastStats]], path: str) -> str:
    """Plot, per layer and over steps, the worst SQNR, saturated % and underflow % of its casts
    into a PNG at ``path`` (needs matplotlib: ``pip install f8dist[plot]``); returns ``path``.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "f8dist.debug plots need matplotlib: `pip install matplotlib` (or f8dist[plot]); the "
            "text table (format_table) works without it"
        ) from e
    if not history:
        raise ValueError("no recorded steps to plot")

    steps = sorted(history)
    per_step = {step: worst_per_layer(history[step]) for step in steps}
    layers: List[str] = []
    for step in steps:
        layers += [fqn for fqn in per_step[step] if fqn not in layers]
    panels = (("worst SQNR of its casts (dB)", 0, 1.0), ("saturated (% of elements)", 1, 100.0),
              ("underflow (% of nonzeros)", 2, 100.0))
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 9), sharex=True)
    for ax, (ylabel, i, factor) in zip(axes, panels):
        for fqn in layers:
            xs = [step for step in steps if fqn in per_step[step]]
            ax.plot(xs, [factor * per_step[step][fqn][i] for step in xs], marker=".",
                    label=fqn or "<root>")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].set_title("float8 casts per layer (worst of its gemms and operands)")
    axes[-1].set_xlabel("step")
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                   ncol=1 + len(layers) // 30)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
