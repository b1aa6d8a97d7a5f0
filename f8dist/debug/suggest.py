"""Suggest which linears to keep in high precision, from recorded cast statistics.

[Note: SQNR hides outliers]
The SQNR of a tensorwise cast is dominated by its largest values: one large outlier gets a scale
that flushes many small elements to zero while its energy keeps the SQNR high
(tests/debug/test_report.py). So a layer is judged by its worst cast's SQNR, saturated fraction
and underflow fraction.
"""

from __future__ import annotations

from typing import List, Mapping, Optional

import torch.nn as nn

from f8dist.core.cast import CastSite
from f8dist.debug.stats import CastStats, worst_per_layer

__all__ = ["rank_layers", "suggest_module_filter"]


def rank_layers(stats: Mapping[CastSite, CastStats]) -> List[tuple]:
    """``(fqn, worst SQNR dB, worst saturated fraction, worst underflow fraction)`` per module,
    worst SQNR first (ties: more saturation, then more underflow first)."""
    rows = [(fqn, *figures) for fqn, figures in worst_per_layer(stats).items()]
    return sorted(rows, key=lambda r: (r[1], -r[2], -r[3]))


def suggest_module_filter(
    stats: Mapping[CastSite, CastStats],
    *,
    min_sqnr_db: Optional[float] = 20.0,
    max_saturated_frac: Optional[float] = 1e-3,
    max_underflow_frac: Optional[float] = 1e-2,
    max_layers: Optional[int] = None,
):
    """A ``module_filter_fn(mod, fqn)`` for ``convert_to_float8_training`` that keeps in high
    precision the layers whose worst cast has an SQNR below ``min_sqnr_db``, or saturates more
    than ``max_saturated_frac`` of its elements, or flushes more than ``max_underflow_frac`` of its
    nonzero elements to zero (at most ``max_layers`` of them, in :func:`rank_layers` order).
    ``None`` disables a criterion. The chosen FQNs are in ``fn.high_precision_fqns``.

    Pass the filter to the same (unconverted) model root the FQNs come from. e5m2 casts
    (gradients) have one mantissa bit less than e4m3 ones. See [Note: SQNR hides outliers].

    Example::

        >>> with f8dist.debug.record(model) as rec:
        ...     train_step(model)
        >>> to_float8 = suggest_module_filter(rec.stats(), min_sqnr_db=25)  # True: convert
        >>> convert_to_float8_training(fresh_model, module_filter_fn=to_float8)
    """
    if not stats:
        raise ValueError("no cast statistics to suggest from: record a few training steps first")

    def flagged(sqnr: float, sat: float, underflow: float) -> bool:
        return (
            (min_sqnr_db is not None and sqnr < min_sqnr_db)
            or (max_saturated_frac is not None and sat > max_saturated_frac)
            or (max_underflow_frac is not None and underflow > max_underflow_frac)
        )

    chosen = [fqn for fqn, *figures in rank_layers(stats) if flagged(*figures)]
    if max_layers is not None:
        chosen = chosen[:max_layers]
    keep_hp = frozenset(chosen)

    def module_filter_fn(mod: nn.Module, fqn: str) -> bool:
        return fqn not in keep_hp

    module_filter_fn.high_precision_fqns = chosen
    return module_filter_fn
