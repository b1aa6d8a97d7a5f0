"""The warning when delayed scaling is never synced.

[Note: a forgotten sync]
Without sync_float8_amax_and_scale_history a delayed layer stays in its first step (dynamic
scaling, an all-reduce per cast). Forward may not count steps (compiled regions), so an optimizer
step post-hook counts them per delayed weight and warns once per process, naming the fix.
"""

from __future__ import annotations

import warnings
import weakref

from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["MISSING_SYNC_STEPS", "watch_for_missing_sync"]

MISSING_SYNC_STEPS = 2
_pending: "weakref.WeakSet[DelayedScaling]" = weakref.WeakSet()
_hook = None


def watch_for_missing_sync(owner: DelayedScaling) -> None:
    global _hook
    _pending.add(owner)
    if _hook is None:
        _hook = register_optimizer_step_post_hook(_count_unsynced_step)


def _count_unsynced_step(optimizer, args, kwargs) -> None:
    if not _pending:
        return
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for o in list(_pending):
        if o.sync_called:
            _pending.discard(o)
        elif id(o.module.weight) in params:
            o.unsynced_steps += 1
            if o.unsynced_steps >= MISSING_SYNC_STEPS:
                _pending.clear()  # once per process
                warnings.warn(
                    f"f8dist: {o.unsynced_steps} optimizer steps over delayed-scaling layers (e.g. "
                    f"{o.fqn()}) without sync_float8_amax_and_scale_history: their casts follow "
                    "each tensor's own amax (dynamic scaling, an all-reduce per cast). Call "
                    "f8dist.sync_float8_amax_and_scale_history(model) once per optimizer step, "
                    "before optimizer.step(), or use a dynamic recipe.",
                    UserWarning, stacklevel=2,
                )
                return
