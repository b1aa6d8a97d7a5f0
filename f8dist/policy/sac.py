"""Per-op selective activation checkpointing (SAC) that is safe for float8.

[Note: what float8 SAC saves]
The policy keeps outputs that are expensive to recompute and small next to their inputs: matmuls
(``aten.mm`` of Float8Tensors, ``aten._scaled_mm`` once compiled, f8dist's CPU kernels) and
attention; large-reduction amaxes ([Note: which amaxes SAC saves]); reduce-scatters and EP's
all-to-alls, so the recompute communicates nothing. As in torchtitan, every
``recompute_every_nth_mm``-th matmul is recomputed (forward and recompute count separately).

[Note: SAC around a nested FSDP2 unit]
A nested FSDP2 unit's hooks open more profiler ranges in the recompute than in forward, and
torch's SAC rejects the extra ops; a range computes nothing, so f8dist's modes pass ``profiler``
ops through unlogged.

[Note: which amaxes SAC saves]
The recompute reads every tensor again to cast it, so a saved amax spares only the reduction,
and MXFP8's 1x32 block amaxes cost 1/32 of their tensor (docs/bench/history.md, Memory): an amax
is saved only when it reduces its tensor at least ``amax_min_reduction``-fold. Never a pointwise
op: the cast's ``abs(weight)`` is a high-precision copy of the weight (docs/bench/history.md,
Figures moved from f8dist's notes).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import f8dist.core.gemm  # noqa: F401  (defines torch.ops.f8dist.cpu_scaled_mm)

__all__ = ["Float8SACConfig", "float8_sac_context_fn", "float8_sac_policy"]

aten = torch.ops.aten

# f8dist/core/gemm.py: [Note: the CPU kernel], [Note: the block-scaled gemm]
MATMUL_OPS = (aten.mm.default, aten._scaled_mm.default, torch.ops.f8dist.cpu_scaled_mm.default,
              torch.ops.f8dist.cpu_block_scaled_mm.default)

ATTENTION_OPS = (
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
)

AMAX_OPS = (aten.amax.default, aten.max.default)

COLLECTIVE_OPS = (torch.ops._c10d_functional.reduce_scatter_tensor.default,
                  torch.ops._c10d_functional.all_to_all_single.default)


@dataclass(frozen=True, kw_only=True)
class Float8SACConfig:
    """What :func:`float8_sac_context_fn` saves; see ``[Note: what float8 SAC saves]``.

    ``recompute_every_nth_mm``: recompute every n-th matmul (None saves all of them).
    ``save_amax``: keep the amaxes that reduce their tensor at least ``amax_min_reduction``-fold
    ([Note: which amaxes SAC saves]). ``extra_ops_to_save``: more aten overloads (not pointwise).
    """

    recompute_every_nth_mm: Optional[int] = 2
    save_attention: bool = True
    save_amax: bool = True
    amax_min_reduction: int = 64
    save_reduce_scatter: bool = True
    extra_ops_to_save: Tuple[torch._ops.OpOverload, ...] = ()

    def __post_init__(self):
        n = self.recompute_every_nth_mm
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(
                f"Float8SACConfig.recompute_every_nth_mm must be a positive int (2 recomputes every "
                f"other matmul, 1 all of them) or None (save every matmul), got {n!r}"
            )
        r = self.amax_min_reduction
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise ValueError(
                f"Float8SACConfig.amax_min_reduction must be a positive int (64 saves amaxes of "
                f"rows of 64 or more elements, 1 every amax), got {r!r}"
            )
        if not isinstance(self.extra_ops_to_save, tuple):
            raise TypeError(
                "Float8SACConfig.extra_ops_to_save must be a tuple of aten op overloads, e.g. "
                f"(torch.ops.aten.bmm.default,), got {self.extra_ops_to_save!r}"
            )
        for op in self.extra_ops_to_save:
            if not isinstance(op, torch._ops.OpOverload):
                raise TypeError(
                    f"Float8SACConfig.extra_ops_to_save holds {op!r}; give op overloads such as "
                    "torch.ops.aten.bmm.default (with the overload name)"
                )
            if torch.Tag.pointwise in op.tags:
                raise ValueError(
                    f"Float8SACConfig.extra_ops_to_save: {op} is pointwise; saving a pointwise op "
                    "keeps a tensor as large as its input (abs(weight) in a float8 cast is a full "
                    "copy of the weight) for an op that is cheap to recompute. Leave it out."
                )

    def ops_to_save(self) -> frozenset:
        ops = set(MATMUL_OPS) | set(self.extra_ops_to_save)
        if self.save_attention:
            ops |= set(ATTENTION_OPS)
        if self.save_amax:
            ops |= set(AMAX_OPS)
        if self.save_reduce_scatter:
            ops |= set(COLLECTIVE_OPS)
        return frozenset(ops)


def float8_sac_policy(config: Optional[Float8SACConfig] = None):
    """A fresh policy function ``(ctx, op, *args, **kwargs) -> CheckpointPolicy`` for one
    checkpointed region (it counts matmuls, so make one per region and call)."""
    config = config if config is not None else Float8SACConfig()
    to_save = config.ops_to_save()
    every = config.recompute_every_nth_mm
    mm_count = defaultdict(int)

    def policy(ctx, op, *args, **kwargs):
        if op in MATMUL_OPS:
            mode = "recompute" if ctx.is_recompute else "forward"
            mm_count[mode] += 1
            if every is not None and mm_count[mode] % every == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        if op in AMAX_OPS and _reduction(op, *args) < config.amax_min_reduction:
            return CheckpointPolicy.PREFER_RECOMPUTE  # [Note: which amaxes SAC saves]
        if op in to_save:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _reduction(op, x: torch.Tensor, dim=(), *args) -> int:
    """How many elements of ``x`` an amax op reduces into each of its outputs."""
    dims = [dim] if isinstance(dim, int) else list(dim)
    if op is aten.max.default or not dims:
        return x.numel()
    out = 1
    for d in dims:
        out *= x.shape[d]
    return out


def float8_sac_context_fn(config: Optional[Float8SACConfig] = None):
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` for
    per-op selective checkpointing that is safe for float8, in eager and under torch.compile;
    bind a :class:`Float8SACConfig` with ``functools.partial``.

    Example::

        >>> from functools import partial
        >>> from torch.utils.checkpoint import checkpoint
        >>> out = checkpoint(block, x, use_reentrant=False, context_fn=float8_sac_context_fn)
        >>> save_all_mm = partial(float8_sac_context_fn, Float8SACConfig(recompute_every_nth_mm=None))
        >>> out = checkpoint(block, x, use_reentrant=False, context_fn=save_all_mm)
    """
    if config is not None and not isinstance(config, Float8SACConfig):
        raise TypeError(
            f"float8_sac_context_fn takes a Float8SACConfig, got {type(config).__name__}; bind one "
            "with functools.partial(float8_sac_context_fn, Float8SACConfig(...))"
        )
    forward, recompute = create_selective_checkpoint_contexts(float8_sac_policy(config))
    return _unlogged_profiler_ops(forward), _unlogged_profiler_ops(recompute)


_UNLOGGED: dict = {}  # torch's SAC mode class -> its subclass passing profiler ops through


def _unlogged_profiler_ops(mode):
    """``mode`` (one of torch's two SAC dispatch modes) passing ``profiler`` ops through unlogged
    ([Note: SAC around a nested FSDP2 unit])."""
    base = type(mode)
    if base not in _UNLOGGED:
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "profiler":
                return func(*args, **(kwargs or {}))
            return base.__torch_dispatch__(self, func, types, args, kwargs)

        _UNLOGGED[base] = type(base.__name__, (base,), {"__torch_dispatch__": __torch_dispatch__})
    mode.__class__ = _UNLOGGED[base]
    return mode
