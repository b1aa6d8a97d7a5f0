"""Delayed scaling: each cast uses a scale computed from an amax history of earlier iterations.

[Note: delayed scaling]
A Float8Linear with ``ScalingType.DELAYED`` casts owns a :class:`DelayedScaling`
(``linear.delayed``), the one place its delayed state lives and changes. Per delayed operand ``op``
it keeps torchao's three persistent buffers (so ``state_dict`` keys are torchao's) and one
non-persistent counter buffer, all float32::

    fp8_amax_{op}          []             max amax recorded since the last sync
    fp8_amax_history_{op}  [history_len]  amax of the latest steps, newest first
    fp8_scale_{op}         []             scale = amax_to_scale(max(history))
    fp8_steps_{op}         [6]            this step: out of range, recorded (0 / 0.5: shared casts
                                          only / 1), amax and out of range of shared casts; steps
                                          out of range, steps with a non-finite amax

One optimizer step: each training cast records max(fp8_amax, amax of its tensor) and casts with
fp8_scale (exceptions: [Note: first step], [Note: out of range]); then
``sync_float8_amax_and_scale_history(model)`` all-reduces (MAX) every fp8_amax at once, rolls each
history, puts the amax in front and recomputes fp8_scale.

Recording a max makes gradient accumulation and activation-checkpoint recompute record the
step's max. Only training casts record (not ``no_grad``, ``inference_mode`` or ``eval()``).
Forward and backward change no Python state (compiled, checkpointed regions must not), so any
number of forwards may run between two syncs. The record is the *local* tensor's amax, with no
collective; the sync's MAX all-reduce makes it the logical tensor's over the global batch ([Note:
amax] in f8dist/core/placement.py).

Modules: ``state.py`` (:class:`DelayedScaling`, [Note: no data]), ``scale.py`` (one cast's
scale), ``sync.py`` ([Note: the amax group]), ``missing_sync.py`` ([Note: a forgotten sync]),
``hooks.py`` (``state_dict``, ``_apply``, DDP: [Note: delayed checkpoints]).
"""

from f8dist.policy.delayed.hooks import (
    apply_to_delayed_module, delayed_buffers, ignore_in_ddp, load_delayed_state,
    strip_delayed_scaling_state,
)
from f8dist.policy.delayed.missing_sync import MISSING_SYNC_STEPS
from f8dist.policy.delayed.scale import KEPT_BINADES, SATURATION, Records, in_range, shared_scale
from f8dist.policy.delayed.state import (
    DELAYED_BUFFER_PREFIXES, DelayedScaling, Scales, Shardings, delayed_operands,
)
from f8dist.policy.delayed.sync import (
    delayed_scaling_counters, set_amax_group, sync_float8_amax_and_scale_history,
)

__all__ = [
    "DELAYED_BUFFER_PREFIXES", "in_range", "DelayedScaling", "delayed_operands",
    "shared_scale", "delayed_buffers", "ignore_in_ddp", "set_amax_group", "sync_float8_amax_and_scale_history",
    "delayed_scaling_counters", "strip_delayed_scaling_state", "apply_to_delayed_module",
]
