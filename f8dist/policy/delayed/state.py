"""One module's delayed-scaling state: its amax histories and scales (torchao's buffers) and the
records its casts make ([Note: delayed scaling] in f8dist/policy/delayed/).

[Note: no data]
A step may bring an operand no data (a layer that did not run, a skipped FSDP2 all-gather, an
empty batch or shard). A pending amax of 0 in the history would give the scale of amax 0 and
saturate every value. So an empty cast records nothing, each record marks the step as recorded
(``fp8_steps_{op}``), the sync sends an unrecorded amax as -1 (the MAX keeps any rank's data), and
an operand no rank recorded keeps its history and scale, and stays in its first step, per operand.
A compiled sync cannot read this on the host and ends every first step: an operand without data
then casts with scale 1.0. An all-zero tensor is data (amax 0).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from f8dist.config import Float8LinearConfig, Gemm, Operand, ScalingType
from f8dist.policy.delayed.missing_sync import watch_for_missing_sync
from f8dist.policy.delayed.scale import Records, cast_scale, in_range
from f8dist.core.placement import local_part

__all__ = ["DELAYED_BUFFER_PREFIXES", "DelayedScaling", "delayed_operands"]

DELAYED_BUFFER_PREFIXES = ("fp8_amax_history_", "fp8_amax_", "fp8_scale_")
_KINDS = ("amax", "amax_history", "scale", "steps")  # the buffers fp8_{kind}_{op}
_INITIAL = {"amax": 0.0, "amax_history": 0.0, "scale": 1.0, "steps": 0.0}  # their fresh values
_FLAG, _OWN, _SHARED_AMAX, _SHARED_FLAG, _COUNTERS = 0, 1, 2, 3, slice(4, 6)  # fp8_steps_{op}

Scales = Dict[Tuple[Gemm, Operand], torch.Tensor]
Shardings = Dict[Operand, tuple]  # (mesh, placements) of an operand's local shard


def delayed_operands(config: Float8LinearConfig) -> Dict[Operand, torch.dtype]:
    """Operands cast with delayed scaling in at least one gemm, and their (one) float8 dtype."""
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


class DelayedScaling:
    """The delayed-scaling state of one :class:`~f8dist.nn.linear.Float8Linear` (or expert weight):
    its buffers, their lifecycle and the entry points of the casts that use it ([Note: delayed
    scaling]).

    Example::

        >>> lin = Float8Linear.from_float(nn.Linear(32, 16), Float8LinearConfig.from_recipe_name("delayed"))
        >>> sorted(lin.delayed.operands)
        [<Operand.GRAD_OUTPUT: 'grad_output'>, <Operand.INPUT: 'input'>, <Operand.WEIGHT: 'weight'>]
    """

    def __init__(self, module: nn.Module, operands: Dict[Operand, torch.dtype]):
        config = module.config
        self.module = module
        self.operands = operands  # {operand: float8 dtype}
        self.cells = {  # the gemms in which each operand is cast with delayed scaling
            op: tuple(g for g in op.gemms if config.cast_config(g, op).scaling_type is ScalingType.DELAYED)
            for op in operands
        }
        self.bounds = {op: in_range(dtype) for op, dtype in operands.items()}  # [Note: out of range]
        self.round_pow2 = config.round_scales_to_power_of_2
        self.history_len = config.delayed_scaling_config.history_len
        self.rescale = config.delayed_scaling_config.rescale_out_of_range
        self.enable_amax_init = config.enable_amax_init
        # the sync's (f8dist/policy/delayed/sync.py, missing_sync.py)
        self.group = None  # [Note: the amax group]; None: all ranks
        self.verified = None  # (group, fingerprint) the sync last checked
        self.sync_called = False  # [Note: a forgotten sync]
        self.unsynced_steps = 0
        watch_for_missing_sync(self)
        self.reset()
        device = module.weight.device
        for op in operands:
            module.register_buffer(f"fp8_amax_{op}", torch.zeros((), device=device))
            module.register_buffer(f"fp8_amax_history_{op}", torch.zeros(self.history_len, device=device))
            module.register_buffer(f"fp8_scale_{op}", torch.ones((), device=device))
            module.register_buffer(f"fp8_steps_{op}", torch.zeros(6, device=device), persistent=False)
        self.buffer_names = tuple(f"fp8_{kind}_{op}" for op in operands for kind in _KINDS)

    @classmethod
    def attach(cls, module: nn.Module, dtype: Optional[torch.dtype] = None
               ) -> Optional["DelayedScaling"]:
        """The state of ``module`` with its buffers registered, or None without a delayed cast.
        ``dtype`` overrides the config's dtype ([Note: grouped casts] in f8dist/config/specs.py)."""
        operands = delayed_operands(module.config)
        if dtype is not None:
            operands = {op: dtype for op in operands}
        return cls(module, operands) if operands else None

    def reset(self) -> None:
        """Forget the history: until the next sync, casts are those of [Note: first step]."""
        # changed by the sync only, never in forward or backward; per operand ([Note: no data])
        self.first_step = {op: True for op in self.operands}

    @property
    def synced(self) -> bool:
        """Whether every operand has left its first step ([Note: first step])."""
        return not any(self.first_step.values())

    @synced.setter
    def synced(self, value: bool) -> None:
        self.first_step = {op: not value for op in self.operands}

    def restart(self) -> None:
        """Put every buffer back to its initial value and :meth:`reset` ([Note: first step])."""
        for op in self.operands:
            for kind in _KINDS:
                self.buffer(kind, op).fill_(_INITIAL[kind])
        self.reset()

    def buffer(self, kind: str, op: Operand) -> torch.Tensor:
        """``fp8_{kind}_{op}`` as a plain tensor (a Replicate DTensor's local part is all of it)."""
        return local_part(getattr(self.module, f"fp8_{kind}_{op}"))

    def keeps(self, op: Operand) -> bool:
        """Whether ``op`` has an amax history here."""
        return op in self.operands

    def fqn(self) -> str:
        return getattr(self.module, "fqn", "") or "<root>"

    # -- the casts ----------------------------------------------------------------------------

    def training(self) -> bool:
        """Whether a forward now records ([Note: delayed scaling]): grad enabled, module in train()."""
        return self.module.training and torch.is_grad_enabled()

    def forward_scales(self, input: torch.Tensor, weight: torch.Tensor, record: bool,
                       later: Records, sharding: Optional[Shardings] = None) -> Scales:
        """The scales of the forward's delayed casts by (gemm, operand), recorded if ``record``
        (deferred to ``later``: [Note: record after the cast]). ``sharding``: (mesh, placements)
        of non-DTensor shards ([Note: delayed experts] in f8dist/nn/grouped.py)."""
        scales: Scales = {}
        for op, t in ((Operand.INPUT, input), (Operand.WEIGHT, weight)):
            if op in self.operands:
                scale = cast_scale([self], op, t, record, later=later,
                               sharding=(sharding or {}).get(op))
                scales.update(self._cells(op, scale))
        return scales

    def grad_output_scales(self, grad: torch.Tensor, record: bool, later: Records,
                           sharding: Optional[Shardings] = None) -> Scales:
        """The scales of backward's delayed grad_output casts; ``record``: that of the forward;
        ``later``, ``sharding``: as in :meth:`forward_scales`."""
        if Operand.GRAD_OUTPUT not in self.operands:
            return {}
        scale = cast_scale([self], Operand.GRAD_OUTPUT, grad, record, later=later,
                       sharding=(sharding or {}).get(Operand.GRAD_OUTPUT))
        return self._cells(Operand.GRAD_OUTPUT, scale)

    def all_gather_scale(self, shard: torch.Tensor, mesh, placements) -> torch.Tensor:
        """The weight scale of the FSDP2 float8 all-gather of this rank's ``shard``. FSDP2
        all-gathers under ``no_grad``, so it records in ``train()`` whatever the grad mode, and
        aside in ``eval()`` ([Note: eval forwards under FSDP2])."""
        return cast_scale([self], Operand.WEIGHT, shard, True, communicated=True,
                      own=self.module.training, sharding=(mesh, placements))

    def _cells(self, op: Operand, scale: torch.Tensor) -> Scales:
        return {(g, op): scale for g in self.cells[op]}

    # -- records (scale.py's cast_scale makes them) ---------------------------------------------

    def record_amax(self, op: Operand, amax: torch.Tensor, out_of_range: Optional[torch.Tensor],
                    own: bool = True) -> None:
        """max(fp8_amax, ``amax``) and max(out-of-range flag, ``out_of_range``); NaN stays NaN. A
        record not ``own`` goes aside, taken only if the step has no own record ([Note: delayed
        casts in the float8 styles])."""
        steps = self.buffer("steps", op)  # [6]
        pending = self.buffer("amax", op) if own else steps[_SHARED_AMAX]
        pending.copy_(torch.maximum(pending, amax))
        if out_of_range is not None:
            flag = steps[_FLAG if own else _SHARED_FLAG]
            flag.copy_(torch.maximum(flag, out_of_range))
        recorded = steps[_OWN]  # [Note: no data]
        recorded.copy_(torch.clamp(recorded, min=1.0 if own else 0.5))


def find_owners(model: nn.Module) -> List[DelayedScaling]:
    """The delayed states of ``model``'s modules, in module order."""
    owners = [getattr(m, "delayed", None) for m in model.modules()]
    return [o for o in owners if isinstance(o, DelayedScaling)]
