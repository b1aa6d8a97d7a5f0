"""The delayed buffers under ``nn.Module``'s machinery: ``state_dict`` loading and stripping,
``_apply`` (dtype, device, the meta device) and DDP's broadcasts.

[Note: delayed checkpoints]
The persistent buffers are in ``state_dict``: a checkpoint resumes with the same histories and
scales, so the next step is bit-identical. The two other directions a torchao user expects also
work:

* a plain ``nn.Linear`` checkpoint (no ``fp8_*`` keys) loads into a float8 model with
  ``strict=True``; the delayed buffers are reset and the next step is a first step. A DCP
  checkpoint does so with ``f8dist.checkpoint.Float8LoadPlanner`` ([Note: loading across
  recipes] in f8dist/checkpoint.py);
* a float8 checkpoint loads into the plain model after ``strip_delayed_scaling_state(sd)``, or with
  ``load_state_dict(sd, strict=False)`` (the ``fp8_*`` keys then come back as unexpected keys).

A model built on the meta device (torchtitan's build) gets its values from ``to_empty`` and an
init (``reset_parameters``, ``init_weights``), which restart the delayed buffers, or from
``load_state_dict(sd, assign=True)``, which takes ``sd``'s tensors: the delayed buffers ``sd``
lacks (all of a plain checkpoint's, the non-persistent ``fp8_steps_*`` of any) come fresh on the
weight's device (:func:`materialize`). The sync refuses buffers still on meta next
to a weight with values, which would record nothing.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn as nn

from f8dist.delayed.state import _INITIAL, _KINDS, DELAYED_BUFFER_PREFIXES, DelayedScaling

__all__ = ["delayed_buffers", "ignore_in_ddp", "apply_to_delayed_module", "load_delayed_state",
           "strip_delayed_scaling_state", "check_materialized"]


def delayed_buffers(model: nn.Module) -> List[str]:
    """The fully qualified names of every delayed-scaling buffer of ``model``: state that the sync
    keeps equal across ranks, so DDP need not broadcast it ([Note: ranks that disagree] in
    f8dist/agreement.py)."""
    return [f"{fqn}.{b}" if fqn else b for fqn, m in model.named_modules()
            if isinstance(getattr(m, "delayed", None), DelayedScaling) for b in m.delayed.buffer_names]


def ignore_in_ddp(model: nn.Module) -> None:
    """Keep the delayed buffers of ``model`` out of DDP's broadcasts (at construction and each
    forward): the sync all-reduces them, and a rank whose buffers differ must reach the agreement
    check instead of a mismatched broadcast. DDP reads the list from the module it wraps."""
    names = delayed_buffers(model)
    if names:
        known = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
        model._ddp_params_and_buffers_to_ignore = known + [n for n in names if n not in known]


def apply_to_delayed_module(delayed: Optional[DelayedScaling], fn, apply):
    """``nn.Module._apply`` of a module that owns ``delayed`` (None: none): ``apply(fn)`` (the
    module's super()._apply with ``recurse`` bound), the delayed buffers kept float32, restarted
    when they leave the meta device (``to_empty``: garbage memory otherwise)."""
    if delayed is None:
        return apply(fn)
    from_meta = on_meta(delayed)
    out = apply(float32_apply(delayed, fn))
    if from_meta and not on_meta(delayed):
        delayed.restart()
    return out


def load_delayed_state(owner: DelayedScaling, state_dict: dict, prefix: str, missing_keys: list) -> None:
    """Float8Linear._load_from_state_dict's delayed part ([Note: delayed checkpoints]).

    A checkpoint without any delayed buffer (a plain nn.Linear one) is not an error: the buffers
    are reset to fresh, and the next step is a first step ([Note: first step]). A
    checkpoint with them resumes their history. One with only some of them keeps those in
    ``missing_keys`` (an error under ``strict=True``).
    """
    names = [f"fp8_{kind}_{op}" for op in owner.operands for kind in ("amax", "amax_history", "scale")]
    keys = [prefix + n for n in names]
    materialize(owner)  # assign=True into a model built on meta
    owner.reset()
    if any(k in state_dict for k in keys):
        # a history that saw data is resumed as is; an all-zero one still needs the first-step init
        histories = {op: owner.buffer("amax_history", op) for op in owner.operands}
        owner.first_step = {op: h.is_meta or not bool(h.any()) for op, h in histories.items()}
        return
    absent = set(keys)
    missing_keys[:] = [k for k in missing_keys if k not in absent]
    owner.restart()


def strip_delayed_scaling_state(state_dict: dict) -> dict:
    """A copy of ``state_dict`` without the delayed-scaling buffers (``fp8_amax_*``,
    ``fp8_amax_history_*``, ``fp8_scale_*``), ready for ``load_state_dict`` of the plain
    (non-float8) model with ``strict=True``.

    Example::

        >>> plain.load_state_dict(strip_delayed_scaling_state(float8_model.state_dict()))
    """
    return {
        k: v
        for k, v in state_dict.items()
        if not k.rsplit(".", 1)[-1].startswith(DELAYED_BUFFER_PREFIXES)
    }


def materialize(owner: DelayedScaling) -> None:
    """Fresh buffers on the weight's device in place of those still on the meta device once
    the weight has values: ``load_state_dict(sd, assign=True)`` into a model built on meta
    assigns only the tensors that ``sd`` holds ([Note: delayed checkpoints])."""
    device = owner.module.weight.device
    if device.type == "meta":
        return
    for op in owner.operands:
        for kind in _KINDS:
            name = f"fp8_{kind}_{op}"
            if getattr(owner.module, name).is_meta:
                fresh = torch.empty_like(getattr(owner.module, name), device=device)
                setattr(owner.module, name, fresh)
                owner.buffer(kind, op).fill_(_INITIAL[kind])


def check_materialized(owner: DelayedScaling) -> None:
    """Raise if the buffers are on the meta device while the weight has values: then no step
    records (a weight set by hand on a model built on meta)."""
    if on_meta(owner) and not owner.module.weight.is_meta:
        raise RuntimeError(
            f"{owner.fqn()}: its delayed-scaling buffers (fp8_amax_*, fp8_amax_history_*, "
            f"fp8_scale_*) are on the meta device while its weight is on "
            f"{owner.module.weight.device}: delayed scaling would record nothing. Materialize a "
            "model built on meta with model.to_empty(device=...) and then its init "
            "(reset_parameters, init_weights), or with load_state_dict(sd, assign=True), "
            "rather than setting its weights alone"
        )


def on_meta(owner: DelayedScaling) -> bool:
    """Whether the buffers are on the meta device (no values)."""
    return any(owner.buffer("scale", op).is_meta for op in owner.operands)


def float32_apply(owner: DelayedScaling, fn):
    """``fn`` for ``nn.Module._apply`` that moves the delayed buffers with the module but keeps
    them float32 (``model.half()`` would overflow a scale to inf)."""
    ids = {id(b) for name, b in owner.module._buffers.items() if name.startswith("fp8_")}

    def apply(t):
        out = fn(t)
        return t.to(device=out.device) if id(t) in ids and out.dtype != t.dtype else out

    return apply
