"""The delayed buffers under ``nn.Module``'s machinery: ``state_dict`` loading and stripping,
``_apply`` (dtype, device, the meta device) and DDP's broadcasts.

[Note: delayed checkpoints]
The persistent buffers are in ``state_dict``, so a resumed step is bit-identical. A plain
``nn.Linear`` checkpoint (no ``fp8_*`` keys) loads with ``strict=True`` and restarts the buffers
(DCP: ``Float8LoadPlanner``, [Note: loading across recipes] in f8dist/policy/checkpoint.py); a float8
checkpoint loads into the plain model after ``strip_delayed_scaling_state(sd)``. On a model built
on meta, ``to_empty`` plus an init restarts the buffers, and ``load_state_dict(sd, assign=True)``
makes those ``sd`` lacks fresh (:func:`materialize`); the sync refuses buffers left on meta.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn as nn

from f8dist.policy.delayed.state import _INITIAL, _KINDS, DELAYED_BUFFER_PREFIXES, DelayedScaling

__all__ = ["delayed_buffers", "ignore_in_ddp", "apply_to_delayed_module", "load_delayed_state",
           "strip_delayed_scaling_state", "check_materialized"]


def delayed_buffers(model: nn.Module) -> List[str]:
    """The fully qualified names of every delayed-scaling buffer of ``model``."""
    return [f"{fqn}.{b}" if fqn else b for fqn, m in model.named_modules()
            if isinstance(getattr(m, "delayed", None), DelayedScaling) for b in m.delayed.buffer_names]


def ignore_in_ddp(model: nn.Module) -> None:
    """Keep the delayed buffers of ``model`` out of DDP's broadcasts: the sync all-reduces them,
    and a rank that differs must reach the agreement check ([Note: ranks that disagree] in
    f8dist/core/agreement.py)."""
    names = delayed_buffers(model)
    if names:
        known = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
        model._ddp_params_and_buffers_to_ignore = known + [n for n in names if n not in known]


def apply_to_delayed_module(delayed: Optional[DelayedScaling], fn, apply):
    """``apply(fn)`` (the module's ``super()._apply``) with the delayed buffers kept float32 and
    restarted when they leave the meta device."""
    if delayed is None:
        return apply(fn)
    from_meta = on_meta(delayed)
    out = apply(float32_apply(delayed, fn))
    if from_meta and not on_meta(delayed):
        delayed.restart()
    return out


def load_delayed_state(owner: DelayedScaling, state_dict: dict, prefix: str, missing_keys: list) -> None:
    """Float8Linear._load_from_state_dict's delayed part ([Note: delayed checkpoints]): without
    any delayed key the buffers restart; with only some, the rest stay in ``missing_keys``.
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
    """A copy of ``state_dict`` without the delayed-scaling buffers, for ``load_state_dict`` of
    the plain model with ``strict=True``.

    Example::

        >>> plain.load_state_dict(strip_delayed_scaling_state(float8_model.state_dict()))
    """
    return {
        k: v
        for k, v in state_dict.items()
        if not k.rsplit(".", 1)[-1].startswith(DELAYED_BUFFER_PREFIXES)
    }


def materialize(owner: DelayedScaling) -> None:
    """Fresh buffers in place of those still on meta once the weight has values ([Note: delayed
    checkpoints])."""
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
    """Raise if the buffers are on meta while the weight has values (no step would record)."""
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
    """``fn`` that moves the delayed buffers but keeps them float32 (a half scale overflows)."""
    ids = {id(b) for name, b in owner.module._buffers.items() if name.startswith("fp8_")}

    def apply(t):
        out = fn(t)
        return t.to(device=out.device) if id(t) in ids and out.dtype != t.dtype else out

    return apply
