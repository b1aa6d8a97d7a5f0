"""One module's delayed-scaling state: its amax histories and scales (torchao's buffers), fresh or
restarted, and the records its casts make ([Note: delayed scaling] in f8dist/delayed/); what
``nn.Module``'s machinery does to them (``state_dict``, ``_apply``, the meta device) is hooks.py's.

[Note: no data]
A step may bring an operand no data: a sync before any forward, a layer that did not run in the
step (a skipped branch), a weight whose FSDP2 all-gather was skipped
(FSDP2 keeps the root's parameters unsharded after a forward without backward), an empty tensor
(an empty batch, a rank whose experts got no tokens, the empty shard of an unevenly sharded
weight). Its pending amax is then 0, which as a history entry would mean "the tensor was all
zeros" and, once it is the history's max, give the scale of amax 0 (2**126 with power-of-2
scales): every value saturates. So a cast of an empty tensor records nothing, each record marks
the step as recorded (``fp8_steps_{op}``, own or shared), the sync sends an unrecorded amax as -1
(a MAX all-reduce keeps any rank's data), and an operand no rank recorded keeps its history and
scale. An operand stays in its first step until a sync sees data for it: per operand, as an empty
batch brings none to the input and grad_output while the weight records. A compiled sync cannot
read on the host which operands saw data and ends every first step: an operand without data then
casts its next step with the initial scale 1.0 (out of range, [Note: out of range], unless its
amax is 16 to 896 in e4m3). A genuine all-zero tensor is data (amax 0).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from f8dist.config import Float8LinearConfig, Gemm, Operand, ScalingType
from f8dist.delayed.missing_sync import watch_for_missing_sync
from f8dist.delayed.scale import Records, cast_scale, in_range
from f8dist.placement import local_part

__all__ = ["DELAYED_BUFFER_PREFIXES", "DelayedScaling", "delayed_operands"]

DELAYED_BUFFER_PREFIXES = ("fp8_amax_history_", "fp8_amax_", "fp8_scale_")
_KINDS = ("amax", "amax_history", "scale", "steps")  # the buffers fp8_{kind}_{op}
_INITIAL = {"amax": 0.0, "amax_history": 0.0, "scale": 1.0, "steps": 0.0}  # their fresh values
_FLAG, _OWN, _SHARED_AMAX, _SHARED_FLAG, _COUNTERS = 0, 1, 2, 3, slice(4, 6)  # fp8_steps_{op}

Scales = Dict[Tuple[Gemm, Operand], torch.Tensor]
Shardings = Dict[Operand, tuple]  # (mesh, placements) of an operand's local shard


def delayed_operands(config: Float8LinearConfig) -> Dict[Operand, torch.dtype]:
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


class DelayedScaling:
    """The delayed-scaling state of one :class:`~f8dist.linear.Float8Linear` (or expert weight:
    f8dist/grouped.py): its buffers and their lifecycle, and the calls of what casts with it
    ([Note: delayed scaling]): the linear's forward and backward, the TP styles
    (:func:`~f8dist.delayed.scale.shared_scale`), the FSDP2 float8 all-gather
    (:meth:`all_gather_scale`). The scale of a cast is f8dist/delayed/scale.py's rule, the sync
    f8dist/delayed/sync.py's.

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
        # the sync's (f8dist/delayed/sync.py, missing_sync.py)
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
        """The state of ``module`` (a Float8Linear, or an expert weight's scaling: f8dist/grouped.py)
        with its buffers registered, or None when its config has no delayed cast. ``dtype``: the
        float8 dtype of every delayed cast, where the casts override the config's (e4m3 in
        grouped gemms, [Note: grouped casts] in f8dist/specs.py)."""
        operands = delayed_operands(module.config)
        if dtype is not None:
            operands = {op: dtype for op in operands}
        return cls(module, operands) if operands else None

    def reset(self) -> None:
        """Forget the history: until the next sync, casts are those of [Note: first step]."""
        # Python state that changes in the sync only, never in forward or backward (a compiled
        # checkpointed region must not change it). Per operand: a step may bring data to one
        # operand and not to another (an empty batch: [Note: no data])
        self.first_step = {op: True for op in self.operands}

    @property
    def synced(self) -> bool:
        """Whether every operand has left its first step ([Note: first step])."""
        return not any(self.first_step.values())

    @synced.setter
    def synced(self, value: bool) -> None:
        self.first_step = {op: not value for op in self.operands}

    def restart(self) -> None:
        """Put every buffer back to its initial value and :meth:`reset`: the next step is a first
        step ([Note: first step]); for a checkpoint that holds no delayed state (f8dist/checkpoint.py),
        ``reset_parameters`` and ``to_empty`` from the meta device (whose memory is garbage)."""
        for op in self.operands:
            for kind in _KINDS:
                self.buffer(kind, op).fill_(_INITIAL[kind])
        self.reset()

    def buffer(self, kind: str, op: Operand) -> torch.Tensor:
        """``fp8_{kind}_{op}`` as a plain tensor. ``parallelize_module`` makes buffers Replicate
        DTensors; their local tensor is the whole buffer, and writing it writes the DTensor."""
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
        """The scales of the forward's delayed casts of ``input`` and ``weight``, by (gemm,
        operand), their amaxes recorded if ``record`` (``training()`` at the forward); records
        that may wait until after the casts go to ``later`` ([Note: record after the cast]).
        ``sharding``: (mesh, placements) by operand, for operands that are local shards of a
        sharded tensor without being DTensors (an expert-parallel layer's weights and tokens:
        [Note: delayed experts] in f8dist/grouped.py)."""
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
        """The weight scale of the FSDP2 float8 all-gather, which casts this rank's ``shard`` of
        the weight sharded over ``mesh`` with ``placements`` before the forward (on the first step
        from the amax of all shards).

        FSDP2 all-gathers under ``no_grad``, so the amax is recorded in ``train()`` mode whatever
        the grad mode; in ``eval()`` mode it is recorded aside, for a training forward that
        computes with the weight this all-gather made ([Note: eval forwards under FSDP2])."""
        return cast_scale([self], Operand.WEIGHT, shard, True, communicated=True,
                      own=self.module.training, sharding=(mesh, placements))

    def _cells(self, op: Operand, scale: torch.Tensor) -> Scales:
        return {(g, op): scale for g in self.cells[op]}

    # -- records (scale.py's cast_scale makes them) ---------------------------------------------

    def record_amax(self, op: Operand, amax: torch.Tensor, out_of_range: Optional[torch.Tensor],
                    own: bool = True) -> None:
        """max(fp8_amax, ``amax``) and max(out-of-range flag, ``out_of_range``); NaN stays NaN
        (the sync keeps it out of the history). A record that is not ``own`` (a shared input that
        this linear may not consume: [Note: delayed casts in the float8 styles]) goes aside; the
        sync takes it only if the linear made no own record in the step."""
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
