"""Delayed scaling: each cast uses a scale computed from an amax history of earlier iterations.

[Note: delayed scaling]
A Float8Linear whose config has ``ScalingType.DELAYED`` casts owns a :class:`DelayedScaling`
(``linear.delayed``): the one place its delayed state lives and changes. Per delayed operand ``op``
in ("input", "weight", "grad_output") it keeps torchao's three persistent buffers on the linear
(so ``state_dict`` keys are torchao's) and one non-persistent counter buffer, all float32 whatever
the module is cast to::

    fp8_amax_{op}          []             max amax recorded since the last sync
    fp8_amax_history_{op}  [history_len]  amax of the latest steps, newest first
    fp8_scale_{op}         []             scale = amax_to_scale(max(history))
    fp8_steps_{op}         [6]            this step: out of range (0/1), recorded (0: not at all,
                                          0.5: by shared casts only, 1: by an own cast), amax and
                                          out of range of shared casts; steps out
                                          of range, steps with a non-finite amax (not in state_dict)

One optimizer step::

    forward(s), backward(s): each training cast records max(fp8_amax, amax of its tensor) and
               casts with fp8_scale ([Note: first step], [Note: out of range] for the exceptions)
    sync_float8_amax_and_scale_history(model):
               all-reduce(MAX) every fp8_amax of the model at once (one collective), roll each
               history, put the amax in front, fp8_scale = amax_to_scale(max(history)), fp8_amax = 0

Recording a max makes a step's amax the max over everything the step cast, whatever runs it:
gradient accumulation (the max over its micro-batches: the history of one step on the whole
batch), and activation checkpointing, whose recompute casts the same tensors with the same scale
and records the same amax again (a no-op). Only training casts record: a forward with gradients
disabled (``no_grad``, ``inference_mode``) or of a module in ``eval()`` casts with the history
scale and leaves every buffer as it was. Nothing in forward or backward changes Python state (a
compiled, checkpointed region must not), so any number of forwards may run between two syncs.

The amax recorded is ``tensor_amax`` of the *local* tensor (an empty one records nothing:
[Note: no data]): the record runs no collective. Under FSDP2 and TP (weight shards), SP (sequence
shards) and data parallelism (micro-batches) it is a partial amax; the sync's MAX all-reduce makes
it the amax of the logical tensor over the global batch, so after each sync every rank holds the
histories and scales of one device that ran the global batch ([Note: amax] in
f8dist/placement.py).

The package, one concept per module:

* ``state.py``: one module's delayed state (:class:`DelayedScaling`): its buffers, their lifecycle
  and the records its casts make ([Note: no data]);
* ``scale.py``: the scale of one delayed cast ([Note: first step], [Note: out of range], [Note:
  the price of re-scaling], [Note: eval forwards under FSDP2], [Note: record after the cast]);
* ``sync.py``: the model-wide sync, the group it runs over ([Note: the amax group]) and its
  counters; ``missing_sync.py``: the warning when it is never called ([Note: a forgotten sync]);
* ``hooks.py``: the buffers under ``nn.Module``'s machinery: ``state_dict`` loading and
  stripping, ``_apply``, DDP's broadcasts ([Note: delayed checkpoints]).
"""

from f8dist.delayed.hooks import (
    apply_to_delayed_module, delayed_buffers, ignore_in_ddp, load_delayed_state,
    strip_delayed_scaling_state,
)
from f8dist.delayed.missing_sync import MISSING_SYNC_STEPS
from f8dist.delayed.scale import KEPT_BINADES, SATURATION, Records, in_range, shared_scale
from f8dist.delayed.state import (
    DELAYED_BUFFER_PREFIXES, DelayedScaling, Scales, Shardings, delayed_operands,
)
from f8dist.delayed.sync import (
    delayed_scaling_counters, set_amax_group, sync_float8_amax_and_scale_history,
)

__all__ = [
    "DELAYED_BUFFER_PREFIXES", "in_range", "DelayedScaling", "delayed_operands",
    "shared_scale", "delayed_buffers", "ignore_in_ddp", "set_amax_group", "sync_float8_amax_and_scale_history",
    "delayed_scaling_counters", "strip_delayed_scaling_state", "apply_to_delayed_module",
]
