"""Context parallelism as a ``ParallelStyle``: the sequence sharded over the cp mesh, K and V
all-gathered in float8 before attention, their gradients reduce-scattered back.

[Note: float8 context parallelism]
``parallelize_module(sdpa, cp_mesh, Float8ContextParallel())`` hooks an attention module
``forward(q, k, v, *, attn_mask=None, is_causal=False)`` (``ScaledDotProductAttention`` of
f8dist/models/llama.py; torch's SDPA signature) whose inputs are each rank's contiguous shard of
the sequence along ``seq_dim`` (all shards of one length; the all-gather CP of torchtitan's
FlexAttention path, torch's ``_ContextParallel``). Its forward pre-hook

1. casts the rank's K and V shards to float8 with ``kv_spec`` (default e4m3, one fp32 scale per
   token and head: scaled over the head dim, never over the sequence, so a shard's cast is the
   whole sequence's, bit for bit, and needs no collective);
2. all-gathers their bytes and scales along ``seq_dim`` ([Note: the wire] in
   f8dist/core/tensor.py) and dequantizes them: attention runs in high precision on the
   gathered K and V, queries local;
3. turns ``is_causal=True`` into the shard's causal mask: query ``i`` of rank ``r`` sits at
   position ``r * S_local + i`` and sees keys ``j <= r * S_local + i`` (``causal_mask``).

Backward reduce-scatters dK and dV over the cp ranks, each rank keeping its shard's sum: in the
gradient's dtype, or with ``grad_spec`` cast first (a float8 wire of bytes and per-token scales
all-to-all, summed in fp32 by the shard's owner; ``scripts/cp_grad_sqnr.py`` measures the
choice, docs/design.md). The cast is a straight-through estimator, as every float8 cast of
f8dist: the gradient of the dequantized K is K's.

One device's numbers are those of ``quantize_kv`` (the same cast, dequantized) in front of the
same attention: outputs and dQ bit for bit (each query row's attention reads the same keys, in
the same order); dK and dV sum the queries' contributions per rank, then over ranks, so they
match at summation order only (tests/sim/parallel/cp/test_style.py).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.tensor import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from f8dist.config import E4M3, CastSpec, ScalingGranularity
from f8dist.core import agreement
from f8dist.core.cast import ToFloat8, cast_to_float8
from f8dist.core.tensor import Float8Tensor

__all__ = ["Float8ContextParallel", "KV_SPEC", "causal_mask", "gather_kv", "grad_to_wire",
           "quantize_kv", "sum_from_wire"]

# e4m3, one fp32 scale per token and head ([Note: float8 context parallelism])
KV_SPEC = CastSpec(dtype=E4M3, granularity=ScalingGranularity.AXISWISE, axis=-1,
                   fqn="context_parallel.kv")


def _check_spec(spec: CastSpec, what: str) -> None:
    if not (spec.axiswise and spec.axis == -1):
        raise ValueError(
            f"Float8ContextParallel.{what} must scale each token and head on its own "
            f"(ScalingGranularity.AXISWISE, axis=-1, the head dim), got {spec.granularity.value} "
            f"along axis {spec.axis}: a scale over the sequence would differ between a shard and "
            "the whole sequence; use f8dist.parallel.cp.KV_SPEC or dataclasses.replace it")


def quantize_kv(t: torch.Tensor, spec: CastSpec = KV_SPEC) -> torch.Tensor:
    """``t`` cast with ``spec`` and dequantized, gradient passed straight through: one device's
    numbers of the float8 all-gather ([Note: float8 context parallelism])."""
    return ToFloat8.apply(t, spec, None).to_original_precision()


def causal_mask(q_len: int, kv_len: int, offset: int, device=None) -> torch.Tensor:
    """[q_len, kv_len] bool, True where query ``i`` (at position ``offset + i``) sees key ``j``."""
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(offset)


def _all_gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """``t``'s shards gathered along ``dim``; a float8 one as its wire tensors ([Note: the
    wire])."""
    if isinstance(t, Float8Tensor):
        wire, meta = t.to_wire(dim)
        return Float8Tensor.from_wire(meta, [_all_gather(w, dim, group) for w in wire])
    return funcol.wait_tensor(funcol.all_gather_single(t.contiguous(), dim, group))


def grad_to_wire(grad: torch.Tensor, dim: int, world: int, spec: CastSpec):
    """(``grad`` cast with ``spec``, its bytes and scales cut into ``world`` chunks along ``dim``
    and stacked on a new dim 0, one per destination rank; the WireMeta): what a rank sends in a
    float8 reduce-scatter ([Note: float8 context parallelism])."""
    wire, meta = cast_to_float8(grad, spec).to_wire(dim)  # [B, H, S, D] bytes, [B, H, S, 4] scales
    return [torch.stack(w.chunk(world, dim)) for w in wire], meta  # [W, B, H, S / W, *] each


def sum_from_wire(got, meta, dtype: torch.dtype) -> torch.Tensor:
    """The sum in fp32 of the chunks received from every rank (``got``: bytes and scales, the
    sources on dim 0), in ``dtype``."""
    parts = Float8Tensor(got[0].view(meta.dtype), got[1].view(meta.scale_dtype), torch.float32,
                         block=(1, *meta.block))  # the sources stacked on a new dim 0
    return parts.to_original_precision().sum(0).to(dtype)  # [B, H, S / W, D]


def _reduce_scatter(grad: torch.Tensor, dim: int, group, spec: Optional[CastSpec]) -> torch.Tensor:
    """The sum over ``group`` of ``grad``'s ``dim`` chunk of this rank: reduce-scattered in its
    dtype, or (``spec``) cast, its chunks' bytes and scales exchanged and summed in fp32."""
    if spec is None:
        out = funcol.reduce_scatter_single(grad.contiguous(), "sum", dim, group)
        return funcol.wait_tensor(out)  # [B, H, S / W, D]
    sent, meta = grad_to_wire(grad, dim, torch.distributed.get_world_size(group), spec)
    got = [funcol.wait_tensor(funcol.all_to_all_single(w, None, None, group)) for w in sent]
    return sum_from_wire(got, meta, grad.dtype)


class _GatherKV(torch.autograd.Function):
    """Steps 1-2 of [Note: float8 context parallelism]; backward reduce-scatters dK and dV."""

    @staticmethod
    def forward(ctx, k, v, dim: int, group, spec: CastSpec, grad_spec: Optional[CastSpec]):
        ctx.dim, ctx.group, ctx.grad_spec = dim, group, grad_spec
        return tuple(_all_gather(cast_to_float8(t, spec), dim, group).to_original_precision()
                     for t in (k, v))  # [B, H, S, D] each

    @staticmethod
    def backward(ctx, dk, dv):
        dk, dv = (_reduce_scatter(g, ctx.dim, ctx.group, ctx.grad_spec) for g in (dk, dv))
        return dk, dv, None, None, None, None  # [B, H, S / W, D] each


def gather_kv(k: torch.Tensor, v: torch.Tensor, group, *, seq_dim: int = 2,
              spec: CastSpec = KV_SPEC, grad_spec: Optional[CastSpec] = None):
    """(K, V) of the whole sequence from each rank's shards along ``seq_dim``, all-gathered in
    float8 over ``group`` and dequantized; dK and dV reduce-scattered in backward ([Note: float8
    context parallelism]). For attention code of one's own; the style calls it."""
    _check_spec(spec, "kv_spec")
    if grad_spec is not None:
        _check_spec(grad_spec, "grad_spec")
    return _GatherKV.apply(k, v, seq_dim % k.dim(), group, spec, grad_spec)


class Float8ContextParallel(ParallelStyle):
    """All-gather context parallelism for an attention module ``forward(q, k, v, *,
    attn_mask=None, is_causal=False)`` over sequence-sharded inputs, K and V gathered in float8
    ([Note: float8 context parallelism]). The caller shards the sequence (equal shards, in
    order) and RoPE positions; the module's output is the rank's query shard.

    Keyword Args:
        seq_dim (int): the sequence dim of q, k and v. Default 2 ([B, H, S, D]).
        kv_spec (CastSpec): the cast of K and V, per token and head. Default ``KV_SPEC`` (e4m3).
        grad_spec (CastSpec, optional): the cast of dK and dV before their reduce-scatter; None
            (default) reduce-scatters them in their dtype. ``KV_SPEC`` (e4m3 per token and head)
            roughly halves the bytes of a bf16 one, at the SQNR docs/design.md gives.

    Example::

        >>> # xdoctest: +SKIP("needs a process group")
        >>> cp_mesh = init_device_mesh("cuda", (4,), mesh_dim_names=("cp",))
        >>> for block in model.layers.values():
        ...     parallelize_module(block.attention.sdpa, cp_mesh, Float8ContextParallel())
    """

    def __init__(self, *, seq_dim: int = 2, kv_spec: CastSpec = KV_SPEC,
                 grad_spec: Optional[CastSpec] = None):
        super().__init__()
        if not isinstance(seq_dim, int):
            raise TypeError(f"Float8ContextParallel.seq_dim must be an int, got {seq_dim!r}")
        _check_spec(kv_spec, "kv_spec")
        if grad_spec is not None:
            _check_spec(grad_spec, "grad_spec")
        self.seq_dim, self.kv_spec, self.grad_spec = seq_dim, kv_spec, grad_spec

    def __repr__(self) -> str:
        grad = None if self.grad_spec is None else self.grad_spec.dtype
        return (f"{type(self).__name__}(seq_dim={self.seq_dim}, kv_dtype={self.kv_spec.dtype}, "
                f"grad_dtype={grad})")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError(f"{type(self).__name__} takes a 1-D cp mesh, got "
                             f"{device_mesh.mesh_dim_names} of shape {tuple(device_mesh.shape)}")
        agreement.record_style(module, self)
        module.register_forward_pre_hook(
            functools.partial(self._gather, device_mesh), with_kwargs=True)
        return module

    def _gather_kv(self, k: torch.Tensor, v: torch.Tensor, mesh: DeviceMesh):
        """The whole sequence's K and V from the shards (step 2 of [Note: float8 context
        parallelism]); a baseline of another wire overrides it (scripts/step_table.py)."""
        return gather_kv(k, v, mesh.get_group(), seq_dim=self.seq_dim, spec=self.kv_spec,
                         grad_spec=self.grad_spec)

    def _gather(self, mesh: DeviceMesh, module: nn.Module, args, kwargs):
        q, k, v = args
        if kwargs.get("attn_mask") is not None:
            raise NotImplementedError(
                f"{type(self).__name__}: attn_mask is not sharded over the sequence; pass "
                "is_causal=True (the shard's causal mask is made here) or none")
        k, v = self._gather_kv(k, v, mesh)  # [B, Hkv, S, D] each
        if kwargs.get("is_causal"):
            q_len, kv_len = q.shape[self.seq_dim], k.shape[self.seq_dim]
            mask = causal_mask(q_len, kv_len, mesh.get_local_rank() * q_len, q.device)
            kwargs = {**kwargs, "is_causal": False, "attn_mask": mask}  # [S / W, S]
        return (q, k, v), kwargs
