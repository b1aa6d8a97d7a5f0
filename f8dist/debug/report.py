"""Readable reports of recorded cast statistics: a text table and a PNG plot over steps."""

from __future__ import annotations

import math
from typing import Dict, Mapping

from f8dist.cast import CastSite
from f8dist.debug.stats import CastStats

__all__ = ["format_table", "plot_history"]

_COLUMNS = ("module", "gemm", "operand", "dtype", "amax", "scale", "sat %", "uflow %", "SQNR dB")


def _num(x: float) -> str:
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return f"{x:.3g}" if x != 0 else "0"


def _row(site: CastSite, s: CastStats):
    scale = _num(s.scale_min) if s.scale_min == s.scale_max else (
        f"{_num(s.scale_min)}..{_num(s.scale_max)}"
    )
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
    saturated % (of all elements), underflow % (of the nonzero ones) and SQNR of the cast.

    Example::

        float8 casts, step 3
        module  gemm         operand      dtype  amax  scale  sat %  uflow %  SQNR dB
        0       output       input        e4m3fn 3.1   145    0.000  0.000    30.9
    """
    rows = [_COLUMNS] + [_row(site, s) for site, s in stats.items()]
    if len(rows) == 1:
        return f"{title}: no casts recorded"
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = [title]
    for i, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot_history(history: Dict[int, Mapping[CastSite, CastStats]], path: str) -> str:
    """Plot SQNR and saturation of every cast site over steps into a PNG at ``path``.

    Needs matplotlib (``pip install f8dist[plot]``); returns ``path``.
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
    sites = []
    for step in steps:
        sites += [s for s in history[step] if s not in sites]
    fig, (ax_sqnr, ax_sat) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for site in sites:
        xs = [step for step in steps if site in history[step]]
        stats = [history[step][site] for step in xs]
        label = str(site)
        ax_sqnr.plot(xs, [s.sqnr_db for s in stats], marker=".", label=label)
        ax_sat.plot(xs, [100 * s.saturated_frac for s in stats], marker=".", label=label)
    ax_sqnr.set_ylabel("SQNR of the cast (dB)")
    ax_sat.set_ylabel("saturated (% of elements)")
    ax_sat.set_xlabel("step")
    ax_sqnr.set_title("float8 casts by module:gemm:operand")
    ax_sqnr.grid(alpha=0.3)
    ax_sat.grid(alpha=0.3)
    ax_sqnr.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0), ncol=1 + len(sites) // 24)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
