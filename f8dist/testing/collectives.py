"""Count the collectives a region of code runs, and their bytes.

Example::

    >>> from f8dist.testing import count_collectives
    >>> with count_collectives() as counts:           # doctest: +SKIP
    ...     loss = model(x).sum()
    >>> counts["all_gather"].calls, counts["all_gather"].output_bytes   # doctest: +SKIP
    (2, 8192)
    >>> counts.expect("all_gather")   # raises if the region ran no all-gather   # doctest: +SKIP

[Note: what is counted]
A collective is counted once, on the rank that runs it, at the level of the dispatcher ops every
front end lowers to:

* ``torch.ops.c10d.*``: the ops behind ``torch.distributed.all_reduce``, ``all_gather_single`` /
  ``all_gather_into_tensor`` and ``reduce_scatter_single`` / ``reduce_scatter_tensor`` (what FSDP2
  calls), ``broadcast``, ``all_to_all_single``, the object collectives, ...;
* ``torch.ops._c10d_functional.*``: the functional collectives DTensor's redistribution issues
  (an amax's Partial(max) -> Replicate is one ``all_reduce``).

It is a ``TorchDispatchMode`` that lets tensor subclasses (DTensor, Float8Tensor) run first and
sees the collectives they lower to, so a DTensor op that redistributes is counted by what it
actually sends. A functional collective is counted when issued, not when waited on.

Bytes are per rank and per call, summed over calls:

* ``input_bytes``: size (``numel * element_size``) of the tensors the collective reads on this
  rank: the local shard of an all-gather, the full buffer of a reduce-scatter or all-reduce;
* ``output_bytes``: size of the tensors it writes on this rank: the gathered buffer of an
  all-gather (this rank's own chunk included), the shard of a reduce-scatter, the buffer of an
  all-reduce or broadcast.

So a float8 all-gather of a weight with ``n`` elements on ``w`` ranks has ``output_bytes == n`` (1
byte per element, uint8 on the wire) where a bf16 one has ``2 * n``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveStats", "CollectiveCounts", "count_collectives", "KINDS"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "gather",
         "scatter", "reduce")


@dataclass
class CollectiveStats:
    """Calls and bytes of one kind of collective on this rank (see [Note: what is counted])."""

    calls: int = 0
    input_bytes: int = 0
    output_bytes: int = 0


class CollectiveCounts:
    """Per-kind :class:`CollectiveStats` of a region; ``counts[kind]`` for one kind."""

    def __init__(self):
        self._stats: Dict[str, CollectiveStats] = {k: CollectiveStats() for k in KINDS}

    def __getitem__(self, kind: str) -> CollectiveStats:
        if kind not in self._stats:
            raise KeyError(f"unknown collective kind {kind!r}; kinds are {list(KINDS)}")
        return self._stats[kind]

    @property
    def total_calls(self) -> int:
        return sum(s.calls for s in self._stats.values())

    def expect(self, kind: str) -> CollectiveStats:
        """The stats of ``kind``; raises if the region ran none (a count of nothing is a bug in
        the measurement, not a result)."""
        stats = self[kind]
        if stats.calls == 0:
            raise AssertionError(
                f"no {kind} collective was counted in this region (counted: {self}); check that "
                "the region runs distributed code and that count_collectives() wraps it"
            )
        return stats

    def as_dict(self) -> Dict[str, Dict[str, int]]:
        return {k: vars(s).copy() for k, s in self._stats.items() if s.calls}

    def __repr__(self):
        return f"CollectiveCounts({self.as_dict()})"


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


# op name -> (kind, index of the input arg, index of the output arg; "ret" = the return value,
# "out" = the ``out=`` kwarg). In-place ops read and write the same argument.
_C10D = {
    "allreduce_": ("all_reduce", 0, 0),
    "allreduce_coalesced_": ("all_reduce", 0, 0),
    "_allgather_base_": ("all_gather", 1, 0),
    "allgather_": ("all_gather", 1, 0),
    "allgather_coalesced_": ("all_gather", 1, 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 1, 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1, 0),
    "reduce_scatter_": ("reduce_scatter", 1, 0),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 0),
    "alltoall_base_": ("all_to_all", 1, 0),
    "alltoall_": ("all_to_all", 1, 0),
    "broadcast_": ("broadcast", 0, 0),
    "gather_": ("gather", 1, 0),
    "scatter_": ("scatter", 1, 0),
    "reduce_": ("reduce", 0, 0),
}
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", 0, "ret"),
    "all_reduce_": ("all_reduce", 0, 0),
    "all_reduce_coalesced": ("all_reduce", 0, "ret"),
    "all_reduce_coalesced_": ("all_reduce", 0, 0),
    "all_gather_into_tensor": ("all_gather", 0, "ret"),
    "all_gather_into_tensor_out": ("all_gather", 0, "out"),
    "all_gather_into_tensor_coalesced": ("all_gather", 0, "ret"),
    "reduce_scatter_tensor": ("reduce_scatter", 0, "ret"),
    "reduce_scatter_tensor_out": ("reduce_scatter", 0, "out"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, "ret"),
    "all_to_all_single": ("all_to_all", 0, "ret"),
    "broadcast": ("broadcast", 0, "ret"),
    "broadcast_": ("broadcast", 0, 0),
}
_NAMESPACES = {"c10d": _C10D, "_c10d_functional": _FUNCTIONAL}


def _defers(t: type) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return t is not torch.Tensor and t is not torch.nn.Parameter and not issubclass(t, FakeTensor)


class _CountingMode(TorchDispatchMode):
    def __init__(self, counts: CollectiveCounts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        # Let tensor subclasses (DTensor, Float8Tensor) desugar first; the collectives they
        # issue come back through this mode on plain tensors. Fake tensors (DTensor's shape
        # propagation) run no collectives and must not be deferred to.
        if any(_defers(t) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        table = _NAMESPACES.get(func.namespace)
        entry = table.get(func._overloadpacket.__name__) if table is not None else None
        if entry is not None:
            kind, i_in, i_out = entry
            stats = self.counts[kind]
            stats.calls += 1
            stats.input_bytes += _nbytes(args[i_in])
            if i_out == "ret":
                stats.output_bytes += _nbytes(out)
            elif i_out == "out":
                stats.output_bytes += _nbytes(kwargs["out"])
            else:
                stats.output_bytes += _nbytes(args[i_out])
        return out


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounts]:
    """Count the collectives run inside the ``with`` block, per kind, on this rank.

    See [Note: what is counted] for what a call and a byte are. The counts are filled in as the
    block runs (read them after it exits). Nested blocks count independently.
    """
    counts = CollectiveCounts()
    with _CountingMode(counts):
        yield counts
