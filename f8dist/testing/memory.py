"""How many bytes a forward keeps alive for its backward, and the peak of a forward + backward.

[Note: counting bytes without an allocator]
The CPU has no allocator statistics, so :class:`LiveBytes` (a ``TorchDispatchMode``) registers
each new storage an aten op makes and a ``weakref.finalize`` subtracts it when it dies.
:func:`measure_fwd_bwd`'s ``kept_bytes`` are the forward's allocations alive at its end, output
excluded (the input is cloned inside the forward, so it counts exactly when backward keeps it);
``scale_bytes`` the part made by amax reductions; ``peak_bytes`` the most alive at once.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = [
    "LiveBytes", "MemoryStats", "compiled_saved_bytes", "graph_saved_tensors", "measure_fwd_bwd",
    "saved_tensor_bytes", "storages",
]

aten = torch.ops.aten
_AMAX_OPS = (aten.amax.default, aten.max.default)


def storages(t: torch.Tensor) -> List[torch.UntypedStorage]:
    """The storages holding ``t``'s bytes (the inner tensors' for a wrapper subclass such as
    Float8Tensor)."""
    if is_traceable_wrapper_subclass(t):  # (a DTensor may name a non-tensor too: skipped)
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, name) for name in names)
        return [s for x in inner if isinstance(x, torch.Tensor) for s in storages(x)]
    if t.device.type == "meta" or t.is_sparse:
        return []
    return [t.untyped_storage()]


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages that aten ops create while it is active, as long as they
    live; see ``[Note: counting bytes without an allocator]``."""

    def __init__(self):
        super().__init__()
        self._live: Dict[int, tuple] = {}  # key -> (nbytes, op name)
        self._seen = weakref.WeakKeyDictionary()  # storage -> key
        self._next = 0
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(is_traceable_wrapper_subclass(a) for a in tree_leaves((args, kwargs))):
            return NotImplemented  # let the subclass run; its inner ops come back here
        inputs = {
            st.data_ptr() for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)
            for st in storages(a)
        }
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for st in storages(t):
                    if st.data_ptr() not in inputs:  # a view or in-place op allocates nothing
                        self._track(st, func)
        return out

    def _track(self, st: torch.UntypedStorage, func) -> None:
        if st in self._seen or st.nbytes() == 0:
            return
        key, self._next = self._next, self._next + 1
        self._seen[st] = key
        self._live[key] = (st.nbytes(), str(func))
        self.current += st.nbytes()
        self.peak = max(self.peak, self.current)
        weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        nbytes, _ = self._live.pop(key)
        self.current -= nbytes

    def live_by_op(self, exclude: Iterable[torch.UntypedStorage] = ()) -> Dict[str, int]:
        """Live bytes by the op that allocated them, leaving out the storages in ``exclude``."""
        skip = {self._seen[st] for st in exclude if st in self._seen}
        by_op: Dict[str, int] = defaultdict(int)
        for key, (nbytes, op) in self._live.items():
            if key not in skip:
                by_op[op] += nbytes
        return dict(by_op)


@dataclass(frozen=True)
class MemoryStats:
    """Bytes of one forward + backward; see :func:`measure_fwd_bwd`."""

    kept_bytes: int
    scale_bytes: int
    peak_bytes: int
    kept_by_op: Dict[str, int] = field(default_factory=dict, compare=False)
    cuda_peak_bytes: Optional[int] = None

    @property
    def activation_bytes(self) -> int:
        """Kept bytes other than float8 scales (amax reductions)."""
        return self.kept_bytes - self.scale_bytes


def measure_fwd_bwd(
    module: nn.Module,
    x: torch.Tensor,
    *args,
    context_fn: Optional[Callable] = None,
) -> MemoryStats:
    """Run ``module(x, *args)`` (under ``checkpoint(..., use_reentrant=False, context_fn=context_fn)``
    when ``context_fn`` is given) and its backward, and count bytes; see the module docstring."""
    from torch.utils.checkpoint import checkpoint

    for p in module.parameters():
        p.grad = None
    x = x.detach().requires_grad_(True)
    cuda = x.is_cuda
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda_base = torch.cuda.memory_allocated()

    def forward(inp):
        if context_fn is None:
            return module(inp, *args)
        return checkpoint(module, inp, *args, use_reentrant=False, context_fn=context_fn)

    tracker = LiveBytes()
    with tracker:
        out = forward(x.clone())  # the clone stands for the previous layer's output
        kept_by_op = tracker.live_by_op(exclude=storages(out))
        grad = torch.ones_like(out)
        out.backward(grad)
        del out, grad
    if cuda:
        torch.cuda.synchronize()
    scale_ops = {str(op) for op in _AMAX_OPS}
    return MemoryStats(
        kept_bytes=sum(kept_by_op.values()),
        scale_bytes=sum(b for op, b in kept_by_op.items() if op in scale_ops),
        peak_bytes=tracker.peak,
        kept_by_op=kept_by_op,
        cuda_peak_bytes=torch.cuda.max_memory_allocated() - cuda_base if cuda else None,
    )


def saved_tensor_bytes(module: nn.Module, x: torch.Tensor, *args) -> int:
    """Bytes of the tensors autograd saves in ``module(x.clone(), *args)``, deduplicated by
    storage, parameters and buffers excluded. Read from the graph, not with saved-tensor hooks,
    which turn off the casts sibling linears share ([Note: one cast per input] in
    f8dist/core/cast.py)."""
    state = [*module.parameters(), *module.buffers(), *(a for a in args if isinstance(a, torch.Tensor))]
    params = {st.data_ptr() for p in state for st in storages(p)}
    x = x.detach().requires_grad_(True)
    out = module(x.clone(), *args)
    seen, nbytes = set(), 0
    for t in graph_saved_tensors(out.grad_fn):
        for st in storages(t):
            if st.data_ptr() not in params and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                nbytes += st.nbytes()
    del out
    return nbytes


def graph_saved_tensors(root) -> List[torch.Tensor]:
    """The tensors saved by the autograd nodes reachable from ``root``: a custom Function's
    ``saved_tensors``, a built-in node's ``_saved_*`` attributes."""
    found, todo, visited = [], [root], set()
    while todo:
        node = todo.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        todo.extend(nxt for nxt, _ in node.next_functions)
        names = ["saved_tensors"] if hasattr(node, "saved_tensors") else [
            n for n in dir(node) if n.startswith("_saved_")]
        for name in names:
            value = getattr(node, name)
            found.extend(v for v in (value if isinstance(value, (tuple, list)) else (value,))
                         if isinstance(v, torch.Tensor))
    return found


def compiled_saved_bytes(
    module: nn.Module, x: torch.Tensor, *args, context_fn: Optional[Callable] = None
) -> int:
    """Bytes that ``torch.compile`` saves for backward in ``module(x.clone(), *args)`` (under
    ``checkpoint(..., context_fn=context_fn)`` when given), forward inputs excluded.

    Compiled kernels allocate outside the dispatcher, so this reads what AOTAutograd's
    partitioner keeps (``aot_eager``: the same partition, no code generation; dynamo's caches are
    reset first). A saved view counts as the tensor it views ([Note: saved views]).
    """
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.utils.checkpoint import checkpoint

    saved, forward_graphs = [], []

    def fw_compiler(gm, example_inputs):
        forward_graphs.append(gm.graph)
        return make_boxed_func(gm)

    def bw_compiler(gm, example_inputs):
        names = {n.name for n in gm.graph.nodes if n.op == "placeholder"
                 and not n.name.startswith(("tangents", "primals"))}
        saved.append(_saved_storage_bytes(forward_graphs[-1], names))
        return make_boxed_func(gm)

    backend = aot_autograd(
        fw_compiler=fw_compiler, bw_compiler=bw_compiler,
        partition_fn=min_cut_rematerialization_partition,
    )

    def forward(inp):
        inp = inp.clone()  # stands for the previous layer's output
        if context_fn is None:
            return module(inp, *args)
        return checkpoint(module, inp, *args, use_reentrant=False, context_fn=context_fn)

    torch._dynamo.reset()  # a fresh compile per measurement (no recompile limit, no stale graph)
    compiled = torch.compile(forward, backend=backend, fullgraph=True)
    out = compiled(x.detach().requires_grad_(True))
    out.backward(torch.ones_like(out))
    if len(saved) != 1:
        raise RuntimeError(f"expected one compiled backward graph, got {len(saved)}")
    return saved[0]


# [Note: saved views]
# The partitioner saves tensors by graph node, and a view is a node of its own (attention's output
# and its reshaped view; rope's ``select``s of the frequency table), holding no bytes of its own.
# Each saved node is followed through view ops to the node that allocated it, each allocation
# counted once, and forward inputs not at all.


def _saved_storage_bytes(graph, names) -> int:
    """Bytes of the allocations behind the forward ``graph``'s nodes named ``names`` (the saved
    tensors), each once, forward inputs excluded ([Note: saved views])."""
    nodes = {n.name: n for n in graph.nodes}
    bases = {}
    for name in names:
        node = nodes[name]
        while (isinstance(node.target, torch._ops.OpOverload) and node.target.is_view
               and isinstance(node.args[0], torch.fx.Node)):
            node = node.args[0]
        val = node.meta.get("val")
        if node.op != "placeholder" and isinstance(val, torch.Tensor):
            bases[node.name] = val.numel() * val.element_size()
    return sum(bases.values())

