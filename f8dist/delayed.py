"""Delayed scaling: each cast uses a scale computed from an amax history of earlier iterations.

[Note: delayed scaling]
A Float8Linear whose config has ``ScalingType.DELAYED`` casts keeps, per delayed operand
``op`` in ("input", "weight", "grad_output"), three persistent buffers (torchao's names)::

    fp8_amax_{op}          []             amax recorded by the latest forward / backward
    fp8_amax_history_{op}  [history_len]  amax of the latest iterations, newest first
    fp8_scale_{op}         []             the scale every delayed cast of ``op`` uses

One iteration::

    forward:   cast input and weight with fp8_scale_*; record their amax in fp8_amax_*
    backward:  cast grad_output with fp8_scale_grad_output; record its amax
    sync_float8_amax_and_scale_history(model):
               all-reduce(MAX) every fp8_amax_* of the model at once (one collective), roll each
               history, put the amax in front, fp8_scale_* = amax_to_scale(max(history))

The amax recorded in forward and backward is ``tensor_amax`` of the *local* tensor (0 for an
empty shard): no collective runs in forward or backward. Under FSDP2 and TP (weight shards) and
SP (sequence shards) it is a partial amax; the sync's MAX all-reduce makes it the amax of the
logical tensor, and under data parallelism that of the global batch. So after each sync every rank
holds the histories and scales of one device that ran the global batch ([Note: amax] in
f8dist/placement.py).

[Note: first step]
Before the first sync the buffers hold no history (scale 1.0). With ``enable_amax_init`` (the
default) the first forward (and its backward) cast like a dynamic cast: the amax of the tensor
(of the logical tensor for a DTensor) fills the history and gives the scale. Under data
parallelism that amax is the rank's own micro-batch, so the first sync refills the whole history
with the synced amax instead of rolling it in, and ranks agree again. Under TP/SP the tensors
are sharded, not split by data, so the logical amax is one device's: the float8 parallel styles
init their casts from it too (one scalar all-reduce per cast, first step only; [Note: delayed
casts in the float8 styles] in f8dist/tp/style.py).

Under FSDP2 float8 all-gather the weight is cast before the forward, in ``fsdp_pre_all_gather``,
which on the first step initializes the weight history from the amax of the WHOLE weight (one
all-reduce over the shards); the forward then sees a float8 weight.

``enable_amax_init=False`` casts the first step with scale 1.0: unsafe for small tensors (at scale
1.0 e5m2 flushes gradients below 2**-16 to zero; docs/numerics.md). Keep it for autocast + compile
+ FSDP, where module-level Python state must not change.

``enable_pre_and_post_forward`` (default on) makes a training forward (grad enabled) raise if the
previous one was not followed by a sync, so scales never silently go stale; turn it off where
module-level Python state must not change between steps.

[Note: delayed checkpoints]
The buffers are in ``state_dict``: a checkpoint resumes with the same histories and scales, so the
next step is bit-identical. The two other directions a torchao user expects also work:

* a plain ``nn.Linear`` checkpoint (no ``fp8_*`` keys) loads into a float8 model with
  ``strict=True``; the missing delayed buffers keep their fresh values (and the first forward
  initializes them as on step one);
* a float8 checkpoint loads into the plain model after ``strip_delayed_scaling_state(sd)``, or with
  ``load_state_dict(sd, strict=False)`` (the ``fp8_*`` keys then come back as unexpected keys).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from f8dist.cast import logical_amax
from f8dist.config import Float8LinearConfig, Operand, ScalingType
from f8dist.placement import all_reduce, local_part
from f8dist.scaling import amax_to_scale, tensor_amax
from f8dist.tensor import Float8Tensor

__all__ = [
    "DELAYED_BUFFER_PREFIXES", "delayed_operands", "register_delayed_buffers", "delayed_scales",
    "record_amax", "record_and_scale", "init_history", "delayed_pre_forward",
    "delayed_post_forward", "sync_float8_amax_and_scale_history", "strip_delayed_scaling_state",
]

DELAYED_BUFFER_PREFIXES = ("fp8_amax_history_", "fp8_amax_", "fp8_scale_")


def _names(op: str) -> Tuple[str, str, str]:
    return f"fp8_amax_{op}", f"fp8_amax_history_{op}", f"fp8_scale_{op}"


def delayed_operands(config: Float8LinearConfig) -> Dict[str, torch.dtype]:
    """Operands cast with delayed scaling in at least one gemm, and their float8 dtype.

    One history and one scale serve every delayed cast of an operand, so its delayed casts must
    share a dtype.
    """
    out: Dict[Operand, torch.dtype] = {}
    for op in Operand:
        cells = [g for g in op.gemms if config.cast_config(g, op).scaling_type is ScalingType.DELAYED]
        dtypes = {config.resolved_dtype(g, op) for g in cells}
        if len(dtypes) > 1:
            raise ValueError(
                f"{op} is cast with delayed scaling to {sorted(map(str, dtypes))} in gemms "
                f"{[g.value for g in cells]}; one amax history gives one scale, so give these delayed casts the same "
                "target_dtype (or make one of them dynamic)"
            )
        if dtypes:
            out[op] = dtypes.pop()
    return out


def register_delayed_buffers(module: nn.Module) -> None:
    """Give a Float8Linear the buffers and flags of [Note: delayed scaling] (no-op without
    delayed casts)."""
    config: Float8LinearConfig = module.config
    ops = delayed_operands(config)
    module._delayed_operands = ops
    if not ops:
        return
    device = module.weight.device
    hist_len = config.delayed_scaling_config.history_len
    for op in ops:
        amax, history, scale = _names(op)
        module.register_buffer(amax, torch.zeros((), device=device))
        module.register_buffer(history, torch.zeros(hist_len, device=device))
        module.register_buffer(scale, torch.ones((), device=device))
    module.is_amax_initialized = not config.enable_amax_init
    module.amax_and_scale_synced = True  # fresh buffers: nothing to sync yet
    # history filled from a first-step (possibly rank-local) amax; the next sync refills it
    module._amax_history_from_init = False


def delayed_scales(module: nn.Module) -> Optional[dict]:
    """{(gemm, operand): scale buffer} of every delayed cast of ``module``."""
    config = module.config
    scales = {}
    for op in module._delayed_operands:
        for g in op.gemms:
            if config.cast_config(g, op).scaling_type is ScalingType.DELAYED:
                scales[(g, op)] = _buffer(module, f"fp8_scale_{op}")
    return scales or None


def _buffer(module: nn.Module, name: str) -> torch.Tensor:
    """A delayed buffer as a plain tensor. ``parallelize_module`` turns buffers into Replicate
    DTensors; their local tensor is the whole buffer, and writing it writes the DTensor."""
    return local_part(getattr(module, name))


def record_amax(module: nn.Module, operand: str, hp: torch.Tensor) -> None:
    """Write the amax of the rank's part of ``hp`` into ``module.fp8_amax_{operand}``.

    For callers that cast a delayed operand outside the linear's forward (FSDP2 float8
    all-gather, float8 parallel styles). A tensor that already is float8 was recorded where it was
    cast and is skipped.
    """
    local = local_part(hp)
    if isinstance(local, Float8Tensor):
        return
    _buffer(module, f"fp8_amax_{operand}").copy_(tensor_amax(local.detach()))


def _init_from(module: nn.Module, operand: str, hp: torch.Tensor) -> None:
    """[Note: first step]: history and scale from the amax of the logical tensor."""
    if isinstance(local_part(hp), Float8Tensor):
        return
    init_history(module, operand, local_part(logical_amax(hp.detach())))  # [], Replicate for a DTensor


def init_history(module: nn.Module, operand: str, amax: torch.Tensor) -> None:
    """Fill ``operand``'s history with ``amax`` (of the logical tensor) and set its scale
    ([Note: first step]). For callers that cast before the forward (FSDP2 float8 all-gather)."""
    _, history, scale = _names(operand)
    _buffer(module, history).fill_(amax)
    _buffer(module, scale).copy_(_scale_from(module, operand, amax))


def record_and_scale(
    modules: List[nn.Module], operand: str, hp: torch.Tensor, init: Optional[bool] = None
) -> torch.Tensor:
    """The scale of a delayed cast of ``operand`` made outside the linears' forward, by the float8
    parallel styles before they communicate ([Note: delayed casts in the float8 styles] in
    f8dist/tp/style.py).

    ``hp``'s local amax (the rank's shard; the sync's MAX makes it global) is recorded into every
    module of ``modules``. On the first step ([Note: first step]; ``init`` says whether it is, or
    None: each module's own ``not is_amax_initialized``) a module's history and scale are first
    filled from the amax of the logical tensor (for a sharded DTensor, one all-reduce, on that
    step only). Returns the scale buffer of ``modules[0]``, the one the cast uses.
    """
    starting = [m for m in modules if (not m.is_amax_initialized if init is None else init)]
    if starting:
        amax = local_part(logical_amax(hp.detach()))  # [], the logical tensor's
        for m in starting:
            init_history(m, operand, amax)
    local = tensor_amax(local_part(hp).detach())  # [], this rank's shard
    for m in modules:
        _buffer(m, f"fp8_amax_{operand}").copy_(local)
    return _buffer(modules[0], f"fp8_scale_{operand}")


def _scale_from(module: nn.Module, operand: str, amax: torch.Tensor) -> torch.Tensor:
    return amax_to_scale(
        amax,
        module._delayed_operands[operand],
        round_to_power_of_2=module.config.round_scales_to_power_of_2,
    )


def delayed_pre_forward(module: nn.Module, input: torch.Tensor) -> None:
    """Check the sync happened, initialize on the first step, record the input and weight amax."""
    config = module.config
    if (
        config.enable_pre_and_post_forward
        and module.is_amax_initialized
        and not module.amax_and_scale_synced
        and torch.is_grad_enabled()
    ):
        raise RuntimeError(
            f"Float8Linear {module.fqn or '<root>'}: its delayed scales were not synced since the "
            "last forward; call f8dist.sync_float8_amax_and_scale_history(model) once per "
            "iteration, after backward and before the next forward"
        )
    operands = {"input": input, "weight": module.weight}
    if not module.is_amax_initialized:
        for op, t in operands.items():
            if op in module._delayed_operands:
                _init_from(module, op, t)
    for op, t in operands.items():
        if op in module._delayed_operands:
            record_amax(module, op, t)


def delayed_post_forward(module: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """Hook grad_output's amax recording (and first-step init) onto ``out``; update flags."""
    init = not module.is_amax_initialized
    if "grad_output" in module._delayed_operands and out.requires_grad:
        out = _RecordGradOutputAmax.apply(out, module, init)
    if init:
        module.is_amax_initialized = True
        module._amax_history_from_init = True
    # read by a float8 parallel style that casts grad_output outside the linear (its backward
    # must know whether this forward was the first step)
    module._delayed_init_forward = init
    if module.config.enable_pre_and_post_forward:
        module.amax_and_scale_synced = False
    return out


class _RecordGradOutputAmax(torch.autograd.Function):
    """Identity in forward; in backward records grad_output's amax (and on the first step
    initializes its history and scale) before the matmul's backward casts it."""

    @staticmethod
    def forward(ctx, out, module, init: bool):
        ctx.module, ctx.init = module, init
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        if ctx.init:
            _init_from(ctx.module, "grad_output", grad)
        record_amax(ctx.module, "grad_output", grad)
        return grad, None, None


def _delayed_layers(model: nn.Module) -> List[nn.Module]:
    return [m for m in model.modules() if getattr(m, "_delayed_operands", None)]


@torch.no_grad()
def sync_float8_amax_and_scale_history(model: nn.Module) -> None:
    """Roll every delayed amax history of ``model`` and recompute its scales.

    Call once per iteration, after backward and before the next forward (e.g. just before
    ``optimizer.step()``). With torch.distributed initialized, the amaxes of the whole model go
    through ONE all-reduce (MAX) over all ranks, so every rank ends with the histories and scales
    of one device that saw the global batch and the logical (unsharded) tensors. Can be wrapped
    in ``torch.compile``. See [Note: delayed scaling].

    Example::

        >>> config = Float8LinearConfig.from_recipe_name("delayed")
        >>> model = convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)), config=config)
        >>> model(torch.randn(16, 32)).sum().backward()
        >>> sync_float8_amax_and_scale_history(model)
    """
    layers = _delayed_layers(model)
    if not layers:
        return
    entries = [(m, op) for m in layers for op in m._delayed_operands]
    amaxes = torch.stack([_buffer(m, f"fp8_amax_{op}") for m, op in entries])  # [E]
    amaxes = all_reduce(amaxes, "max")  # [E], over all ranks: the model's one collective

    # histories of one length and scales of one dtype are updated as one stacked tensor each
    groups: Dict[tuple, List[int]] = {}
    for i, (m, op) in enumerate(entries):
        key = (
            m.config.delayed_scaling_config.history_len,
            m._delayed_operands[op],
            m.config.round_scales_to_power_of_2,
        )
        groups.setdefault(key, []).append(i)
    for (_, dtype, round_pow2), idx in groups.items():
        histories = torch.stack([_buffer(entries[i][0], _names(entries[i][1])[1]) for i in idx])
        amax = amaxes[idx]  # [G]
        rolled = torch.roll(histories, 1, dims=1)  # [G, L]
        rolled[:, 0] = amax
        from_init = torch.tensor(
            [entries[i][0]._amax_history_from_init for i in idx], device=amax.device
        )  # [G]
        new_hist = torch.where(from_init[:, None], amax[:, None].expand_as(rolled), rolled)
        scales = amax_to_scale(new_hist.amax(dim=1), dtype, round_to_power_of_2=round_pow2)  # [G]
        for j, i in enumerate(idx):
            m, op = entries[i]
            amax_name, history_name, scale_name = _names(op)
            _buffer(m, amax_name).copy_(amax[j])
            _buffer(m, history_name).copy_(new_hist[j])
            _buffer(m, scale_name).copy_(scales[j])
    for m in layers:
        m.amax_and_scale_synced = True
        m._amax_history_from_init = False


def load_delayed_state(module: nn.Module, state_dict: dict, prefix: str, missing_keys: list) -> None:
    """Float8Linear._load_from_state_dict's delayed part ([Note: delayed checkpoints]).

    A checkpoint without any delayed buffer (a plain nn.Linear one) is not an error: the buffers
    are reset to fresh, so the first forward initializes them from the loaded weights. A
    checkpoint with them resumes their history. One with only some of them keeps those in
    ``missing_keys`` (an error under ``strict=True``).
    """
    keys = [prefix + n for op in module._delayed_operands for n in _names(op)]
    if any(k in state_dict for k in keys):
        # a history that saw data is resumed as is; an all-zero one still needs the first-step init
        seen = any(_buffer(module, _names(op)[1]).any() for op in module._delayed_operands)
        module.is_amax_initialized = bool(seen) or not module.config.enable_amax_init
    else:
        absent = set(keys)
        missing_keys[:] = [k for k in missing_keys if k not in absent]
        for op in module._delayed_operands:
            amax, history, scale = _names(op)
            _buffer(module, amax).zero_()
            _buffer(module, history).zero_()
            _buffer(module, scale).fill_(1.0)
        module.is_amax_initialized = not module.config.enable_amax_init
    module.amax_and_scale_synced = True
    module._amax_history_from_init = False


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
