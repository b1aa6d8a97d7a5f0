"""Numerics telemetry for float8 training: statistics of every cast, by module, gemm and operand.

Example::

    >>> with f8dist.debug.record(model) as rec:
    ...     model(x).sum().backward()
    >>> rec.print_table()                      # amax, scale, saturated %, underflow %, SQNR
    >>> keep = f8dist.debug.suggest_module_filter(rec.stats(), min_sqnr_db=25)
    >>> convert_to_float8_training(fresh_model, module_filter_fn=keep)

Off (and free: no op added) unless a recorder is entered; eager mode only. See
``f8dist/debug/recorder.py`` for the distributed rule.
"""

from f8dist.debug.logger import Float8StatsLogger
from f8dist.debug.recorder import StatsRecorder, record
from f8dist.debug.report import format_table, plot_history
from f8dist.debug.stats import CastStats, cast_stats_tensors
from f8dist.debug.suggest import rank_layers, suggest_module_filter

__all__ = [
    "CastStats",
    "Float8StatsLogger",
    "StatsRecorder",
    "cast_stats_tensors",
    "format_table",
    "plot_history",
    "rank_layers",
    "record",
    "suggest_module_filter",
]
