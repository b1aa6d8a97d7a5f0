"""Measurement tools for checking float8 training: what crosses the wire and what stays in memory.

f8dist's own tests and benchmarks use them; nothing else in f8dist depends on them.
:func:`count_collectives`: [Note: what is counted]; :func:`measure_fwd_bwd` and the other byte
counters: [Note: counting bytes without an allocator].

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
