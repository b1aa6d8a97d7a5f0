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

Backward runs the same all-to-alls the other way (in high precision unless [Note: float8
combine and backward]).

[Note: float8 dispatch]
When the experts cast their tokens per token, or in blocks along a token's row (``token_spec``
of :class:`~f8dist.nn.grouped.Float8GroupedExperts`), the tokens are cast on the source rank and
the all-to-all carries the float8 bytes and scales as uint8 (gloo has no float8). Such a scale
depends on the token alone, so this equals casting after the dispatch, bit for bit, and the
grouped gemm takes the bytes as they are. NVFP4 tokens ("nvfp4": 1x16 e4m3 block scales, a
token's own) also carry a tensor scale, the amax of all the tokens of the layer: each source
rank casts with its amax all-reduced over the EP group (one scalar, [Note: NVFP4 experts] in
f8dist/nn/grouped.py), so every rank's tokens share one device's tensor scale, which stays home
([Note: two-level scales] in f8dist/core/tensor.py), and the packed e2m1 bytes and block scales
cross: ``dim / 2 + dim / 16`` bytes a token.

[Note: float8 combine and backward]
Opt-in (``float8_combine``, ``float8_backward`` of
:class:`~f8dist.parallel.ep.Float8ExpertParallel`): the other all-to-alls carry float8 too. The
combine casts the experts' outputs per token, e4m3 (``COMBINE_SPEC``); backward casts both
gradients it sends (the combine's output gradient to the experts' ranks, the dispatch's token
gradient back to the tokens' ranks) per token, e4m3 too (``GRAD_SPEC``): with a scale per token
e5m2's range buys nothing and its lost mantissa bit costs the gradients precision (measured in
docs/moe.md). Each crosses as bytes and a float32 scale per token and is dequantized on arrival,
to the dtype it was. A per-token cast depends on its token alone, so an EP run equals, bit for
bit, one device casting and dequantizing the same rows at the same points (the experts' outputs;
the gradients of their outputs and inputs). Off by default: they change the numbers (docs/moe.md
measures by how much), where float8 dispatch does not.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from f8dist.core.cast import cast_to_float8
from f8dist.config import E4M3, CastSpec, ScalingGranularity
from f8dist.config.cells import E2M1
from f8dist.core.placement import all_reduce, local_part
from f8dist.core.scaling import tensor_amax
from f8dist.core.tensor import Float8Tensor, as_wire

__all__ = ["expert_parallel", "all_to_all", "dispatch", "exchange", "combine", "take_rows", "Plan",
           "COMBINE_SPEC", "GRAD_SPEC"]

# [Note: float8 combine and backward]: a scale per token (row), over its features
COMBINE_SPEC = CastSpec(dtype=E4M3, granularity=ScalingGranularity.AXISWISE, axis=-1)
GRAD_SPEC = CastSpec(dtype=E4M3, granularity=ScalingGranularity.AXISWISE, axis=-1)


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


def _send_rows(x: torch.Tensor, send, recv, group, spec: Optional[CastSpec]) -> torch.Tensor:
    """:func:`all_to_all` of high-precision rows, cast with ``spec`` before and dequantized on
    arrival where ``spec`` is given ([Note: float8 combine and backward])."""
    if spec is None:
        return all_to_all(x, send, recv, group)
    return _all_to_all_tokens(cast_to_float8(x, spec), send, recv, group).to_original_precision()


def take_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]``, also for per-token float8 rows (their wire tensors' rows)."""
    if isinstance(x, Float8Tensor):
        wire, meta = x.to_wire(0)
        return Float8Tensor.from_wire(meta, [w[index] for w in wire])
    return x[index]


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


class _Dispatch(torch.autograd.Function):
    """Step 2 of [Note: expert parallelism], cast first with ``spec`` ([Note: float8 dispatch]);
    backward sends the gradient cast with ``grad_spec`` ([Note: float8 combine and backward]).
    The cast is inside so no float8 tensor needing a gradient crosses the graph break."""

    @staticmethod
    def forward(ctx, x, perm, send, recv, group, spec: Optional[CastSpec],
                grad_spec: Optional[CastSpec]):
        ctx.perm, ctx.send, ctx.recv, ctx.group, ctx.grad_spec = perm, send, recv, group, grad_spec
        if spec is not None:  # NVFP4: the tokens' amax over the group ([Note: float8 dispatch])
            amax = all_reduce(tensor_amax(x), "max", group) if spec.dtype == E2M1 else None
            x = cast_to_float8(x, spec, amax=amax)  # [M, dim] per-token float8
        return take_rows(_all_to_all_tokens(x, send, recv, group), perm)  # [M_recv, dim]

    @staticmethod
    def backward(ctx, grad):
        grad = take_rows(grad.contiguous(), _inverse(ctx.perm))  # source-rank order
        grad = _send_rows(grad, ctx.recv, ctx.send, ctx.group, ctx.grad_spec)  # [M, dim]
        return grad, None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    """Step 4 of [Note: expert parallelism]: outputs back to their assignments' ranks, cast with
    ``spec`` and the gradient with ``grad_spec`` where given ([Note: float8 combine and
    backward])."""

    @staticmethod
    def forward(ctx, out, perm, send, recv, group, spec: Optional[CastSpec],
                grad_spec: Optional[CastSpec]):
        ctx.perm, ctx.send, ctx.recv, ctx.group, ctx.grad_spec = perm, send, recv, group, grad_spec
        out = take_rows(out, _inverse(perm))  # source-rank order
        return _send_rows(out, recv, send, group, spec)  # [M, dim]

    @staticmethod
    def backward(ctx, grad):
        grad = _send_rows(grad.contiguous(), ctx.send, ctx.recv, ctx.group, ctx.grad_spec)
        return take_rows(grad, ctx.perm), None, None, None, None, None, None


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


def exchange(tokens: torch.Tensor, order: torch.Tensor, send, recv, group,
             spec: Optional[CastSpec] = None, grad_spec: Optional[CastSpec] = None) -> torch.Tensor:
    """Step 2 alone, for a caller with its own plan (torchtitan's dispatcher): ``tokens`` [M, dim]
    cast with ``spec`` and sent ``send[r]`` rows to rank r, ``recv[r]`` received from it, the
    received rows taken in ``order``; backward as :func:`dispatch`'s."""
    return _Dispatch.apply(tokens, order, send, recv, group, spec, grad_spec)


def dispatch(tokens: torch.Tensor, counts: torch.Tensor, group, spec: Optional[CastSpec] = None,
             grad_spec: Optional[CastSpec] = None) -> Tuple[torch.Tensor, Plan]:
    """Steps 1 and 2: ``tokens`` [M, dim] sorted by expert, ``counts`` [E] per expert ->
    (this rank's experts' tokens [M_recv, dim], expert-major; the plan :func:`combine` takes).
    ``spec``: the cast made before the dispatch ([Note: float8 dispatch]), or None;
    ``grad_spec``: that of the tokens' gradient in backward ([Note: float8 combine and
    backward]), or None."""
    plan = _plan(counts, group)
    return _Dispatch.apply(tokens, plan.perm, plan.send, plan.recv, group, spec, grad_spec), plan


def combine(out: torch.Tensor, plan: Plan, group, spec: Optional[CastSpec] = None,
            grad_spec: Optional[CastSpec] = None) -> torch.Tensor:
    """Step 4: the local experts' outputs [M_recv, dim] back to the rank and position of their
    assignments: [M, dim]. ``spec``, ``grad_spec``: the casts of the outputs and of their
    gradient ([Note: float8 combine and backward]), or None."""
    return _Combine.apply(local_part(out), plan.perm, plan.send, plan.recv, group, spec,
                          grad_spec)


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
