"""Measurement tools for checking float8 training: what crosses the wire and what stays in memory.

They are what f8dist's own tests and benchmarks use, public for users who want to check the same
figures in their programs. Nothing in the rest of f8dist depends on them.

* :func:`count_collectives` (``collectives.py``): calls and bytes of every collective a region
  runs, per kind, on this rank ([Note: what is counted]).
* :func:`measure_fwd_bwd`, :func:`saved_tensor_bytes`, :func:`graph_saved_tensors`,
  :func:`compiled_saved_bytes` (``memory.py``): bytes a forward keeps for backward and the peak of a forward + backward, on the
  CPU too ([Note: counting bytes without an allocator]).

Example::

    >>> from f8dist.testing import count_collectives, measure_fwd_bwd
    >>> with count_collectives() as counts:             # doctest: +SKIP
    ...     model(x).sum().backward()
    >>> counts["all_gather"].output_bytes               # doctest: +SKIP
    >>> measure_fwd_bwd(block, x).kept_bytes            # doctest: +SKIP
"""

from f8dist.testing.collectives import CollectiveCounts, CollectiveStats, count_collectives
from f8dist.testing.memory import (
    LiveBytes,
    MemoryStats,
    compiled_saved_bytes,
    graph_saved_tensors,
    measure_fwd_bwd,
    saved_tensor_bytes,
)

__all__ = [
    "CollectiveCounts",
    "CollectiveStats",
    "LiveBytes",
    "MemoryStats",
    "compiled_saved_bytes",
    "count_collectives",
    "graph_saved_tensors",
    "measure_fwd_bwd",
    "saved_tensor_bytes",
]
