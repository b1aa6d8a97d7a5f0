"""The float8 grouped gemms, rows of the one gemm table in :mod:`f8dist.gemm` ([Note: one gemm
entry] there), re-exported for the callers of this module's names."""

from f8dist.gemm import (
    block_scaled_grouped_mm, cpu_block_scaled_grouped_mm, cpu_scaled_grouped_mm, grouped_scales,
    pad_groups, scaled_grouped_mm, scatter_rows,
)

__all__ = ["scaled_grouped_mm", "block_scaled_grouped_mm", "pad_groups", "scatter_rows",
           "grouped_scales", "cpu_scaled_grouped_mm", "cpu_block_scaled_grouped_mm"]
