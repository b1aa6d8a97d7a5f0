"""Expert parallelism's collectives: token dispatch to the experts' ranks and combine back,
all-to-all (run around an experts module by :class:`~f8dist.parallel.ep.Float8ExpertParallel`).

[Note: expert parallelism]
With ``E`` experts over ``W`` ranks, rank ``r`` holds experts ``[r * E / W, (r + 1) * E / W)``
(weights sharded on dim 0). Each rank sorts its assignments by expert ([Note: routing] in
f8dist/models/moe.py), so each rank's tokens are one contiguous chunk:

1. the per-expert token counts are exchanged (all-to-all) and read on the host (one sync per
   layer, as in every EP implementation);
2. dispatch: an all-to-all sends each chunk to its rank, and the arrivals are permuted to
   expert-major order (within an expert, by source rank: one device's order);
3. the local experts run their grouped gemms;
4. combine: the inverse permutation and the reverse all-to-all.

Backward runs the same all-to-alls the other way, in high precision.

[Note: float8 dispatch]
When the experts cast their tokens per token, or in blocks along a token's row (``token_spec``
of :class:`~f8dist.nn.grouped.Float8GroupedExperts`), the tokens are cast on the source rank and
the all-to-all carries the float8 bytes and scales as uint8 (gloo has no float8). Such a scale
depends on the token alone, so this equals casting after the dispatch, bit for bit, and the
grouped gemm takes the bytes as they are. The combine (summed with router weights) and backward
run in high precision.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from f8dist.core.cast import cast_to_float8
from f8dist.config import CastSpec
from f8dist.core.placement import local_part
from f8dist.core.tensor import Float8Tensor, as_wire

__all__ = ["expert_parallel", "all_to_all", "dispatch", "combine", "Plan"]


def all_to_all(x: torch.Tensor, send: List[int], recv: List[int], group) -> torch.Tensor:
    """Rows ``x [sum(send), C]`` to the ranks of ``group`` (``send[r]`` rows to rank ``r``) ->
    ``[sum(recv), C]``; functional, so per-op SAC can save it (f8dist/policy/sac.py)."""
    out = funcol.all_to_all_single(as_wire(x).contiguous(), recv, send, group)  # [sum(recv), C]
    return funcol.wait_tensor(out).view(x.dtype)


def _all_to_all_tokens(x: torch.Tensor, send, recv, group) -> torch.Tensor:
    """:func:`all_to_all` for high-precision rows or per-token float8 ones (bytes and scales)."""
    if isinstance(x, Float8Tensor):  # bytes, then scales ([Note: the wire] in f8dist/core/tensor.py)
        wire, meta = x.to_wire(0)
        return Float8Tensor.from_wire(meta, [all_to_all(w, send, recv, group) for w in wire])
    return all_to_all(x, send, recv, group)


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]``, also for per-token float8 rows (their wire tensors' rows)."""
    if isinstance(x, Float8Tensor):
        wire, meta = x.to_wire(0)
        return Float8Tensor.from_wire(meta, [w[index] for w in wire])
    return x[index]


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


class _Dispatch(torch.autograd.Function):
    """Step 2 of [Note: expert parallelism], cast first with ``spec`` ([Note: float8 dispatch]).
    The cast is inside so no float8 tensor needing a gradient crosses the graph break."""

    @staticmethod
    def forward(ctx, x, perm, send, recv, group, spec: Optional[CastSpec]):
        ctx.perm, ctx.send, ctx.recv, ctx.group = perm, send, recv, group
        if spec is not None:
            x = cast_to_float8(x, spec)  # [M, dim] per-token float8
        return _rows(_all_to_all_tokens(x, send, recv, group), perm)  # [M_recv, dim]

    @staticmethod
    def backward(ctx, grad):
        grad = _rows(grad.contiguous(), _inverse(ctx.perm))  # source-rank order
        return all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None, None, None


class _Combine(torch.autograd.Function):
    """Step 4 of [Note: expert parallelism]: outputs back to their assignments' ranks."""

    @staticmethod
    def forward(ctx, out, perm, send, recv, group):
        ctx.perm, ctx.send, ctx.recv, ctx.group = perm, send, recv, group
        out = _rows(out, _inverse(perm))  # source-rank order
        return all_to_all(out, recv, send, group)  # [M, dim]

    @staticmethod
    def backward(ctx, grad):
        grad = all_to_all(grad.contiguous(), ctx.send, ctx.recv, ctx.group)
        return _rows(grad, ctx.perm), None, None, None, None


class Plan(NamedTuple):
    """Step 1's result: rows to send to each rank, rows from each rank, the expert-major
    permutation of the received rows, the local experts' token counts [E_local] (int64)."""

    send: List[int]
    recv: List[int]
    perm: torch.Tensor
    local_counts: torch.Tensor

    @property
    def local_offsets(self) -> torch.Tensor:
        """The local experts' offsets [E_local] (int32), what f8dist's grouped gemms take."""
        return torch.cumsum(self.local_counts, 0).to(torch.int32)


def _plan(counts: torch.Tensor, group) -> Plan:
    """Step 1 of [Note: expert parallelism], from this rank's token ``counts`` [E] per expert."""
    w = dist.get_world_size(group)
    e = counts.shape[0]
    if e % w:
        raise ValueError(f"expert parallelism over {w} ranks needs num_experts ({e}) to be a "
                         f"multiple of it")
    received = funcol.all_to_all_single(counts.contiguous(), None, None, group)  # [W * E_local]
    # [W, E_local]: rows from rank r for local expert j
    received = funcol.wait_tensor(received).view(w, e // w)
    send = counts.view(w, e // w).sum(dim=1).tolist()
    recv = received.sum(dim=1).tolist()
    # the local expert of each received row, in arrival order (source rank, then expert)
    experts = torch.arange(e // w, device=counts.device).repeat(w)  # [W * E_local]
    local = torch.repeat_interleave(experts, received.reshape(-1))  # [M_recv]
    perm = torch.argsort(local, stable=True)  # expert-major, source rank within
    return Plan(send, recv, perm, received.sum(dim=0))


def dispatch(tokens: torch.Tensor, counts: torch.Tensor, group,
             spec: Optional[CastSpec] = None) -> Tuple[torch.Tensor, Plan]:
    """Steps 1 and 2: ``tokens`` [M, dim] sorted by expert, ``counts`` [E] per expert ->
    (this rank's experts' tokens [M_recv, dim], expert-major; the plan :func:`combine` takes).
    ``spec``: the cast made before the dispatch ([Note: float8 dispatch]), or None."""
    plan = _plan(counts, group)
    return _Dispatch.apply(tokens, plan.perm, plan.send, plan.recv, group, spec), plan


def combine(out: torch.Tensor, plan: Plan, group) -> torch.Tensor:
    """Step 4: the local experts' outputs [M_recv, dim] back to the rank and position of their
    assignments: [M, dim]."""
    return _Combine.apply(local_part(out), plan.perm, plan.send, plan.recv, group)


def expert_parallel(experts: torch.nn.Module, tokens: torch.Tensor, counts: torch.Tensor,
                    group, spec: Optional[CastSpec] = None) -> torch.Tensor:
    """The outputs of ``experts`` (sharded on dim 0 over ``group``) for ``tokens`` [M, dim]
    sorted by expert, ``counts`` [E] per expert ([Note: expert parallelism]), as a function.

    Example::

        >>> # xdoctest: +SKIP("needs a process group")
        >>> out = expert_parallel(moe.experts, tokens, counts, ep_mesh.get_group())
    """
    local, plan = dispatch(tokens, counts, group, spec)  # [M_recv, dim]
    return combine(experts(local, plan.local_offsets), plan, group)  # [M, dim]
