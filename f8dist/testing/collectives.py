"""Count the collectives a region of code runs, and their bytes.

Example::

    >>> from f8dist.testing import count_collectives
    >>> with count_collectives() as counts:           # doctest: +SKIP
    ...     loss = model(x).sum()
    >>> counts["all_gather"].calls, counts["all_gather"].output_bytes   # doctest: +SKIP
    (2, 8192)
    >>> counts.expect("all_gather")   # raises if the region ran no all-gather   # doctest: +SKIP

[Note: what is counted]
A collective is counted once, when issued, on the rank that runs it, at the c10d dispatcher ops,
after tensor subclasses have run (so by what it actually sends). Bytes are per rank, summed:
``input_bytes`` read, ``output_bytes`` written (an all-gather's whole buffer). ``groups`` counts
calls by process group and reduce op (``calls_over(mesh["tp"], "max")``), ``wires`` calls, input
and output bytes by process group and the dtype written (what a float8 wire carries: uint8 bytes
and scales, against a high-precision one's bfloat16 or float32). Under
``LocalTensorMode`` ([Note: simulating ranks in one process] in tests/sim/__init__.py) a
collective is counted once, with one rank's bytes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, Iterator, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveStats", "CollectiveCounts", "count_collectives", "record_collective", "KINDS"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "gather",
         "scatter", "reduce", "send", "recv")


@dataclass
class CollectiveStats:
    """Calls and bytes of one kind of collective on this rank (see [Note: what is counted])."""

    calls: int = 0
    input_bytes: int = 0
    output_bytes: int = 0
    # calls per (global ranks of the group, reduce op or None)
    groups: Dict[Tuple[Tuple[int, ...], Optional[str]], int] = field(default_factory=dict)
    # [calls, input bytes, output bytes] per (global ranks of the group, dtype written, e.g.
    # "bfloat16")
    wires: Dict[Tuple[Tuple[int, ...], str], list] = field(default_factory=dict)

    def calls_over(self, group, op: Optional[str] = None) -> int:
        """Calls over exactly ``group``'s ranks (a 1-D device mesh, a process group or the ranks
        themselves), with reduce op ``op`` if given."""
        ranks = _ranks_of(group)
        return sum(n for (r, o), n in self.groups.items() if r == ranks and op in (None, o))


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
        """Calls and bytes per kind that ran (JSON-ready: ``groups`` left out)."""
        return {k: {"calls": s.calls, "input_bytes": s.input_bytes, "output_bytes": s.output_bytes}
                for k, s in self._stats.items() if s.calls}

    def __repr__(self):
        return f"CollectiveCounts({self.as_dict()})"


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


# op name -> (kind, input arg index, output arg index or "ret" / "out" (the out= kwarg))
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
    "send": ("send", 0, 0),  # point to point (pipeline stages): counted by the rank that calls it
    "recv_": ("recv", 0, 0),
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

    return (t is not torch.Tensor and t is not torch.nn.Parameter and not issubclass(t, FakeTensor)
            and t.__name__ != "LocalTensor")  # every simulated rank's plain tensor at once


def _dtype_of(x) -> str:
    """The dtype name of a tensor, or of a list's first tensor (\"-\" for none)."""
    if isinstance(x, (list, tuple)):
        return _dtype_of(x[0]) if x else "-"
    return str(x.dtype).removeprefix("torch.") if isinstance(x, torch.Tensor) else "-"


def _ranks_of(group) -> Tuple[int, ...]:
    """The sorted global ranks of a 1-D device mesh, a process group (or its name) or a list."""
    import torch.distributed as dist

    if isinstance(group, (list, tuple, range)):
        return tuple(sorted(group))
    if hasattr(group, "get_group"):  # a DeviceMesh
        group = group.get_group()
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group)
    return tuple(sorted(dist.get_process_group_ranks(group)))


def _where(func, args, kwargs) -> Tuple[Optional[Tuple[int, ...]], Optional[str]]:
    """(group ranks, reduce op) of a collective call; None for what cannot be resolved."""
    ranks = op = None
    for i, a in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(a.name)
        if a.name in ("group_name", "process_group") and value is not None:
            try:
                ranks = _ranks_of(value)
            except Exception:  # noqa: BLE001 (a group this rank cannot resolve: counted, unnamed)
                ranks = None
        elif a.name == "reduce_op" and value is not None:
            op = value if isinstance(value, str) else _op_name(value)
    return ranks, op


def _op_name(reduce_op) -> str:
    """"max", "sum", ... of a c10d ``ReduceOp``."""
    return str(getattr(reduce_op, "op", reduce_op)).rsplit(".", 1)[-1].lower()


class _CountingMode(TorchDispatchMode):
    def __init__(self, counts: CollectiveCounts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        # tensor subclasses desugar first; fake tensors run no collectives: not deferred to
        if any(_defers(t) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        table = _NAMESPACES.get(func.namespace)
        entry = table.get(func._overloadpacket.__name__) if table is not None else None
        if entry is not None:
            kind, i_in, i_out = entry
            written = out if i_out == "ret" else kwargs["out"] if i_out == "out" else args[i_out]
            self.add(kind, args[i_in], written, *_where(func, args, kwargs))
        return out

    def add(self, kind, read, written, ranks, op) -> None:
        stats = self.counts[kind]
        stats.calls += 1
        stats.input_bytes += _nbytes(read)
        stats.output_bytes += _nbytes(written)
        stats.groups[(ranks, op)] = stats.groups.get((ranks, op), 0) + 1
        wire = stats.wires.setdefault((ranks, _dtype_of(written)), [0, 0, 0])
        wire[0] += 1
        wire[1] += _nbytes(read)
        wire[2] += _nbytes(written)


def record_collective(kind: str, read, written, group, op: Optional[str] = None) -> None:
    """Count one collective in every :func:`count_collectives` region active on this thread.

    For process groups whose collectives do not reach the dispatcher (torch's threaded test
    group: tests/sim/threads.py reports them here). A functional collective reaching such a group
    from inside the dispatcher is not counted twice: the counting modes are then off the stack."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    modes = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, _CountingMode)]
    if modes:
        where = (_ranks_of(group), None if op is None else _op_name(op))
        for mode in modes:
            mode.add(kind, read, written, *where)


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounts]:
    """Count the collectives run inside the ``with`` block, per kind, on this rank.

    See [Note: what is counted]. Nested blocks count independently.
    """
    counts = CollectiveCounts()
    with _CountingMode(counts):
        yield counts
