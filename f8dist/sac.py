"""Per-op selective activation checkpointing (SAC) that is safe for float8.

[Note: what float8 SAC saves]
Under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False, context_fn=...)`` a policy
decides, op by op, which forward outputs are kept for backward; everything else is recomputed.
Worth keeping are outputs that are expensive to recompute and small compared with their inputs:

* matmul outputs: ``aten.mm`` (what a float8 gemm looks like from outside: ``mm`` of two
  Float8Tensors, see f8dist/tensor.py), ``aten._scaled_mm`` (what it becomes once
  ``torch.compile`` has flattened the subclass) and scaled-dot-product attention;
* the amax reductions behind float8 scales (``aten.amax``, ``aten.max``) that reduce their tensor
  at least ``amax_min_reduction``-fold (default 64): one number per tensor, per row of 64 or more
  elements, per 128-element or 128x128 block ([Note: which amaxes SAC saves]);
* ``reduce_scatter_tensor`` outputs (sequence/tensor parallel), as torchtitan does, and
  ``all_to_all_single`` outputs: expert parallelism's token dispatch and combine (and the token
  counts that plan them, f8dist/ep/dispatch.py), so that backward's recompute re-runs the routing
  and the experts locally from the received tokens and communicates no more than without
  checkpointing (one all-to-all per direction and layer in backward, none replayed).

[Note: SAC around a nested FSDP2 unit]
EP x FSDP2 (f8dist/models/moe_parallel.py) makes the experts an FSDP2 unit inside the
checkpointed block. Its hooks open profiler ranges (``profiler._record_function_enter_new``), as
dispatcher ops, and they open more of them in the recompute (which runs inside backward) than in
forward; torch's selective checkpointing logs every op of the region by invocation index and
rejects the recompute's extra ones. A profiler range computes nothing, so f8dist's SAC modes pass
``profiler`` ops through unlogged.

[Note: which amaxes SAC saves]
The recompute casts every tensor again, reading it whole, so a saved amax spares it only the
reduction (which a compiled graph fuses into the cast's pass) and costs its bytes until backward.
For a tensorwise or per-row amax that is a few bytes per token or output feature; MXFP8's
1x32 blocks keep one amax per 32 elements, 1/32 of their tensor's bytes, and for the weights in
proportion to the parameters, not the tokens: at a real width most of what mxfp8 kept beyond bf16
under SAC was the weights' block amaxes (scripts/memory_budget.py --dim 512; docs/bench/history.md,
Memory). So
an amax is saved only when it reduces its tensor at least ``amax_min_reduction``-fold: tensorwise,
per row of 64 or more elements, 128-element and 128x128 blocks are kept, 32-element blocks
recomputed. Either way the recompute's amax is the forward's, bit for bit (same tensor, same
reduction), and so are the gradients.

Never a pointwise op. The cast computes ``abs(x)`` before its amax; ``abs`` of a weight is as
large as the (unsharded) weight, so saving it kept a full high-precision copy of every weight alive
until backward: the seed-004 regression, where rowwise float8 + per-op SAC peaked far above bf16
(docs/bench/history.md, Figures moved from f8dist's notes). :class:`Float8SACConfig` rejects pointwise ops for that reason.

As in torchtitan, every ``recompute_every_nth_mm``-th matmul is recomputed rather than saved, to
trade compute for memory; forward and recompute count matmuls separately so they agree.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import f8dist.gemm  # noqa: F401  (defines torch.ops.f8dist.cpu_scaled_mm)

__all__ = ["Float8SACConfig", "float8_sac_context_fn", "float8_sac_policy"]

aten = torch.ops.aten

# a float8 gemm is aten.mm of Float8Tensors, aten._scaled_mm once flattened, or f8dist's CPU
# kernels (f8dist/gemm.py [Note: the CPU kernel], [Note: the block-scaled gemm])
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

    ``recompute_every_nth_mm``: recompute every n-th matmul instead of saving it (2 = torchtitan's
    "every other matmul"; None saves all of them). ``save_amax``: keep the amax reductions of the
    float8 casts that reduce their tensor at least ``amax_min_reduction``-fold ([Note: which
    amaxes SAC saves]; 1 saves them all). ``extra_ops_to_save``: more aten overloads to keep
    (never pointwise ones).
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
    """How many elements of ``x`` an amax op reduces into each of its outputs: all of them for
    ``aten.max`` and an ``aten.amax`` over no dims, else the product of the reduced dims' sizes."""
    dims = [dim] if isinstance(dim, int) else list(dim)
    if op is aten.max.default or not dims:
        return x.numel()
    out = 1
    for d in dims:
        out *= x.shape[d]
    return out


def float8_sac_context_fn(config: Optional[Float8SACConfig] = None):
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` for
    per-op selective checkpointing that is safe for float8, in eager and under torch.compile.

    Pass it as is for the defaults, or bind a :class:`Float8SACConfig` with ``functools.partial``.

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
