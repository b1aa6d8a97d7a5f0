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

[Note: the amax group]
The sync's all-reduce runs over the ranks that hold the same layers: all ranks by default; under
pipeline parallelism each stage's data (and tensor) parallel group, given with
:func:`set_amax_group` before the first step. The first sync checks that the ranks of the group
hold the same delayed layers (a fixed-size all-reduce of the number of delayed operands and a
fingerprint of their names, once per set of layers and group), and a mismatch raises an error
naming the fix instead of hanging or mixing layers.

[Note: first step]
Before the first sync there is no history. Until then, the casts of a training step (and casts
whose bytes are communicated) follow the amax of the *logical* tensor: their local amax reduced
over the mesh axes that shard it (a DTensor's placements; the FSDP2 all-gather's weight shard), one
scalar all-reduce per sharded cast, as the dynamic recipes' casts do. A plain tensor is whole on
its rank: a data-parallel micro-batch is its own tensor, so under DDP or FSDP2 step 0 casts as one
device running each rank's micro-batches in turn (gradient accumulation) would, and the first
sync's MAX all-reduce then gives every rank the histories of the global batch. No reduction spans
ranks that need not run the same casts: a rank may run more micro-batches than another
(``no_sync``), or a layer the others skip, exactly where the dynamic recipes allow it. With
``enable_amax_init`` (the default) the scale comes from that amax and the first sync fills the
whole history with the step's amax; with ``enable_amax_init=False`` the scale is 1.0, as in
torchao, unless that amax is out of range for it ([Note: out of range]), and the first sync rolls
the history as any other. An evaluation forward before the first sync casts from the amax of its
own tensor.

[Note: out of range]
A history predicts the amax of the next step. A delayed cast whose current amax, times the
history's scale, lands outside :func:`in_range` proves the prediction wrong:

* above ``2 * fp8_max``: everything in the top half of the tensor's range would saturate;
* below ``2**10`` times the format's smallest normal (e4m3: 16, e5m2: 2**-4): the top ten binades
  of the tensor, values down to a thousandth of its max, would no longer all be normal float8
  numbers, and the small ones flush to zero. Heavy-tailed tensors keep most of their elements that
  far below their max.

The sync counts such a step (``delayed_scaling_counters``, printed by the float8 stats logger)
and restarts the history from its amax, so the next step is in range again. By default the cast
itself keeps the history's scale (it saturates or flushes that step, as torchao's and Transformer
Engine's delayed scaling do); with ``DelayedScalingConfig(rescale_out_of_range=True)`` it is
re-scaled from its current amax for that step, like a dynamic cast ([Note: the price of
re-scaling] says why that is not the default). An all-zero tensor is never out of
range (it casts to exact zeros at any scale). A non-finite amax makes the cast use it too: its
scale turns 0 or NaN and the output non-finite, as in high precision ([Note: non-finite values] in
f8dist/scaling.py); the sync keeps that amax out of the history and counts the step. The rule is
tensor ops (``torch.where``), so compiled graphs keep it. docs/numerics.md gives the figures
(``scripts/delayed_cases.py``).

[Note: the price of re-scaling]
A cast that may re-scale depends on the amax of its own tensor, so it reads the tensor twice: once
for the amax, once for the cast, and a producer (SwiGLU, a norm) cannot fuse the cast into its own
kernel: it writes the high-precision tensor for the cast to read back. A cast with the history's
scale needs no amax before it; its amax is recorded in the same pass ([Note: record after the
cast]). No graph expresses "a second pass only when out of range" without a host sync per cast
(``torch.cond`` decides on the host, and its operands and outputs are materialized). So the choice
is every step's bytes against one step's precision after a range jump, and it was measured
(docs/numerics.md, [Re-scaling or not]):

* every step: in a compiled LLaMA block re-scaling moves as many bytes as tensorwise, and
  without it delayed moves the fewest of all recipes (``scripts/bench_bytes.py``, rows
  ``delayed_rescaled`` and ``delayed``; docs/performance.md, Bytes a compiled step moves):
  re-scaling takes away what delayed scaling is for;
* a range jump (``scripts/delayed_cases.py``): a drop of 2**-8 costs nothing either way; a rise of
  4x or a drop of 2**-20 makes the step of the jump saturate or flush without
  re-scaling, and each layer that the jump reaches only through a flushed layer loses one more
  step; after that the restarted history gives the clean figures again.

Range jumps are rare (a loss spike, a bad batch; an optimizer step moves no weight out of range)
and counted, every step is every step: ``rescale_out_of_range=False`` is the default, the casts
of the FSDP2 float8 all-gather never re-scale anyway, and a non-finite value turns the output
non-finite in both modes (a delayed cast maps it to NaN in the same pass, [Note: non-finite
values] in f8dist/scaling.py). Set ``rescale_out_of_range=True`` where one step's precision after
a jump matters more than the bytes.

The decision is per rank, on the tensor the rank casts. Bytes that are then communicated must
share one scale on every rank: the TP styles' casts before an all-gather decide on the logical
amax of their sharded tensor (one scalar all-reduce per cast, the one collective delayed scaling
adds in forward and backward after the first step); the FSDP2 float8 all-gather of a weight keeps
the history's scale (deciding would cost an all-reduce per weight, and an optimizer step does not
move a weight's amax out of range of the previous step's) and an out-of-range step there is only
counted.

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

[Note: eval forwards under FSDP2]
An evaluation forward (``eval()`` or no grad) casts with the history's scales and records
nothing, so it never moves training state; with one exception, the FSDP2 float8 all-gather of a
weight. FSDP2 skips the all-gather of parameters that are still unsharded: the root's after any
forward without a backward (``reshard_after_forward`` applies to the other units only). The
training forward after an evaluation one then computes with the weight the evaluation gathered,
and records nothing for it: the weight's history would miss the step ([Note: no data] keeps it
sane, not equal to one device's). So an evaluation all-gather records its shard's amax aside, as a
shared cast does ([Note: delayed casts in the float8 styles] in f8dist/tp/style.py): the sync
takes it only for a step in which no training all-gather recorded its own, i.e. when the training
forward computed with the evaluation's weight, whose amax then is the step's. ``fp8_amax`` and
every other ``state_dict`` buffer stay as they were. The all-gathered Float8Tensor keeps a copy of
the scale, never the ``fp8_scale`` buffer itself, which the sync updates in place while the
tensor may still be in use.

[Note: record after the cast]
A cast with the history's scale (after the first sync, without re-scaling) does not wait for its
amax, but the amax still reads the whole tensor. Inductor's CPU backend fuses two independent
passes over one tensor only in one order: a pointwise pass (the cast) followed by a reduction
(the amax) share a loop, the reverse does not (``CppScheduling._why_fuse_nodes``), and a graph
keeps the order in which the code ran. So Float8Linear's forward and backward collect such
records in ``later`` and run them after their gemms: each weight, input and gradient is then read
once for its cast and its amax (scripts/bench_bytes.py, row ``delayed``; before and after in
docs/bench/history.md, Bytes). Eagerly the order changes nothing (the record is the same
``max`` into ``fp8_amax``), and a cast whose amax is not recorded (evaluation) skips it.

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
weight's device (:meth:`DelayedScaling.materialize`). The sync refuses buffers still on meta next
to a weight with values, which would record nothing.
"""

from __future__ import annotations

import warnings
import weakref
import zlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from f8dist.config import Float8LinearConfig, Gemm, Operand, ScalingType
from f8dist.placement import all_reduce, is_dtensor, local_part, reduce_over_shards
from f8dist.scaling import amax_to_scale, fp8_max, in_memory, tensor_amax
from f8dist.tensor import Float8Tensor

__all__ = [
    "DELAYED_BUFFER_PREFIXES", "in_range", "DelayedScaling", "delayed_operands",
    "shared_scale", "delayed_buffers", "ignore_in_ddp", "set_amax_group", "sync_float8_amax_and_scale_history",
    "delayed_scaling_counters", "strip_delayed_scaling_state", "apply_to_delayed_module",
]

DELAYED_BUFFER_PREFIXES = ("fp8_amax_history_", "fp8_amax_", "fp8_scale_")
# [Note: out of range]: the binades below a tensor's max that a delayed cast keeps in normal
# numbers, and how far above the format's max its max may land
KEPT_BINADES, SATURATION = 10, 2.0
_KINDS = ("amax", "amax_history", "scale", "steps")  # the buffers fp8_{kind}_{op}
_INITIAL = {"amax": 0.0, "amax_history": 0.0, "scale": 1.0, "steps": 0.0}  # their fresh values
_FLAG, _OWN, _SHARED_AMAX, _SHARED_FLAG, _COUNTERS = 0, 1, 2, 3, slice(4, 6)  # fp8_steps_{op}

Scales = Dict[Tuple[Gemm, Operand], torch.Tensor]
Shardings = Dict[Operand, tuple]  # (mesh, placements) of an operand's local shard
Records = List[Callable[[], object]]  # amax records to run after the casts


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


def _check(ok: torch.Tensor, message: str) -> None:
    """Raise ``message`` unless ``ok`` is all true (an async assert inside a compiled graph)."""
    if torch.compiler.is_compiling():
        torch._assert_async(ok.all(), message)
    elif not bool(ok.all()):
        raise RuntimeError(message)


@torch.compiler.assume_constant_result
def _fingerprint(name: str) -> float:
    """A number that is the same on every rank for the same name (24 bits: exact in float32)."""
    return float(zlib.crc32(name.encode()) & 0xFFFFFF)


class DelayedScaling:
    """The delayed-scaling state of one :class:`~f8dist.linear.Float8Linear` and everything that
    reads or writes it ([Note: delayed scaling]): the linear's forward and backward, the TP styles
    (:func:`shared_scale`), the FSDP2 float8 all-gather (:meth:`all_gather_scale`) and the sync.

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
        self.group = None  # [Note: the amax group]; None: all ranks
        self._verified = None  # (group, fingerprint) the sync last checked
        self.sync_called = False  # [Note: a forgotten sync]
        self.unsynced_steps = 0
        _watch_for_missing_sync(self)
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

    def materialize(self) -> None:
        """Fresh buffers on the weight's device in place of those still on the meta device once
        the weight has values: ``load_state_dict(sd, assign=True)`` into a model built on meta
        assigns only the tensors that ``sd`` holds ([Note: delayed checkpoints])."""
        device = self.module.weight.device
        if device.type == "meta":
            return
        for op in self.operands:
            for kind in _KINDS:
                name = f"fp8_{kind}_{op}"
                if getattr(self.module, name).is_meta:
                    setattr(self.module, name, torch.empty_like(getattr(self.module, name), device=device))
                    self.buffer(kind, op).fill_(_INITIAL[kind])

    def check_materialized(self) -> None:
        """Raise if the buffers are on the meta device while the weight has values: then no step
        records (a weight set by hand on a model built on meta)."""
        if self.on_meta() and not self.module.weight.is_meta:
            raise RuntimeError(
                f"{self._fqn()}: its delayed-scaling buffers (fp8_amax_*, fp8_amax_history_*, "
                f"fp8_scale_*) are on the meta device while its weight is on "
                f"{self.module.weight.device}: delayed scaling would record nothing. Materialize a "
                "model built on meta with model.to_empty(device=...) and then its init "
                "(reset_parameters, init_weights), or with load_state_dict(sd, assign=True), "
                "rather than setting its weights alone"
            )

    def on_meta(self) -> bool:
        """Whether the buffers are on the meta device (no values)."""
        return any(self.buffer("scale", op).is_meta for op in self.operands)

    def buffer(self, kind: str, op: Operand) -> torch.Tensor:
        """``fp8_{kind}_{op}`` as a plain tensor. ``parallelize_module`` makes buffers Replicate
        DTensors; their local tensor is the whole buffer, and writing it writes the DTensor."""
        return local_part(getattr(self.module, f"fp8_{kind}_{op}"))

    def keeps(self, op: Operand) -> bool:
        """Whether ``op`` has an amax history here."""
        return op in self.operands

    def _fqn(self) -> str:
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
                scale = _scale([self], op, t, record, later=later,
                               sharding=(sharding or {}).get(op))
                scales.update(self._cells(op, scale))
        return scales

    def grad_output_scales(self, grad: torch.Tensor, record: bool, later: Records,
                           sharding: Optional[Shardings] = None) -> Scales:
        """The scales of backward's delayed grad_output casts; ``record``: that of the forward;
        ``later``, ``sharding``: as in :meth:`forward_scales`."""
        if Operand.GRAD_OUTPUT not in self.operands:
            return {}
        scale = _scale([self], Operand.GRAD_OUTPUT, grad, record, later=later,
                       sharding=(sharding or {}).get(Operand.GRAD_OUTPUT))
        return self._cells(Operand.GRAD_OUTPUT, scale)

    def all_gather_scale(self, shard: torch.Tensor, mesh, placements) -> torch.Tensor:
        """The weight scale of the FSDP2 float8 all-gather, which casts this rank's ``shard`` of
        the weight sharded over ``mesh`` with ``placements`` before the forward (on the first step
        from the amax of all shards).

        FSDP2 all-gathers under ``no_grad``, so the amax is recorded in ``train()`` mode whatever
        the grad mode; in ``eval()`` mode it is recorded aside, for a training forward that
        computes with the weight this all-gather made ([Note: eval forwards under FSDP2])."""
        return _scale([self], Operand.WEIGHT, shard, True, communicated=True,
                      own=self.module.training, sharding=(mesh, placements))

    def _cells(self, op: Operand, scale: torch.Tensor) -> Scales:
        return {(g, op): scale for g in self.cells[op]}

    def float32_apply(self, fn):
        """``fn`` for ``nn.Module._apply`` that moves the delayed buffers with the module but keeps
        them float32 (``model.half()`` would overflow a scale to inf)."""
        ids = {id(b) for name, b in self.module._buffers.items() if name.startswith("fp8_")}

        def apply(t):
            out = fn(t)
            return t.to(device=out.device) if id(t) in ids and out.dtype != t.dtype else out

        return apply

    # -- pieces of a cast (see _scale) --------------------------------------------------------

    def _to_scale(self, op: Operand, amax: torch.Tensor) -> torch.Tensor:
        return amax_to_scale(amax, self.operands[op], round_to_power_of_2=self.round_pow2)

    def _record(self, op: Operand, amax: torch.Tensor, out_of_range: Optional[torch.Tensor],
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

    def _out_of_range(self, op: Operand, amax: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """[Note: out of range], or a non-finite ``amax``; never an all-zero tensor."""
        low, high = self.bounds[op]
        x = amax * scale  # [], where the tensor's max lands in float8 units
        return ~(((x >= low) & (x <= high)) | (amax <= 0))  # NaN compares False: out


def in_range(dtype: torch.dtype) -> Tuple[float, float]:
    """Where a delayed cast's max may land in float8 units ([Note: out of range]): from
    ``2**KEPT_BINADES`` times the smallest normal to ``SATURATION`` times the max (e4m3: 16..896,
    e5m2: 2**-4..114688)."""
    return torch.finfo(dtype).tiny * 2.0**KEPT_BINADES, SATURATION * fp8_max(dtype)


def _inf_for_nan(amax: torch.Tensor) -> torch.Tensor:
    """A MAX all-reduce may drop a NaN (max(NaN, x) is x on some backends); inf survives it."""
    return torch.where(torch.isnan(amax), torch.inf, amax)


def _scale(
    owners: Sequence[DelayedScaling], op: Operand, hp: torch.Tensor, record: bool,
    communicated: bool = False, later: Optional[Records] = None, own: bool = True,
    sharding=None,
) -> torch.Tensor:
    """The scale of one delayed cast of ``hp`` (its local part is cast) made for ``owners``
    (several when one cast feeds several linears), from ``owners[0]``'s history; the amax is
    recorded into every owner when ``record`` (into ``owners[0]`` aside unless ``own``).

    Until the first sync ([Note: first step]) a training cast and a cast whose bytes are
    ``communicated`` follow the amax of the logical tensor: the scale comes from it (amax init), or it decides whether scale 1.0 is out of range. After it, the history's scale,
    re-scaled when out of range ([Note: out of range]). Every rank must pick the same scale for
    bytes it communicates: a communicated DTensor decides on its logical amax (a scalar
    all-reduce over the axes sharding it), a communicated shard that is no DTensor (the FSDP2
    all-gather's) keeps the history's scale. A tensor that already is float8 was recorded where it
    was cast: its scale is the history's. ``sharding``: (mesh, placements) of a ``hp`` that is
    the local shard of a sharded tensor without being a DTensor (the FSDP2 all-gather's).
    """
    first = owners[0]
    local = local_part(hp)
    first_step = first.first_step[op]
    if isinstance(local, Float8Tensor):
        return first.buffer("scale", op)
    if later is not None and not first_step and not first.rescale:  # [Note: record after the cast]
        if record:
            later.append(lambda: _scale(owners, op, hp, record, communicated, own=own,
                                         sharding=sharding))
        return first.buffer("scale", op)
    local = local.detach()
    if first.rescale or first_step:  # the cast may wait for this amax
        local = in_memory(local)  # [Note: a cast that waits for its amax] in f8dist/scaling.py
    amax = tensor_amax(local)  # [], this rank's part: what the sync reduces
    seen, decides = amax, not communicated  # [], what this cast's scale follows; may it re-scale
    if (first_step and (record or communicated)) or (communicated and is_dtensor(hp)):
        seen, decides = _logical_amax(amax, hp, sharding), True  # [Note: first step]
    if first.enable_amax_init and first_step:
        out_of_range = None
        scale = first._to_scale(op, seen)
    else:
        scale = first.buffer("scale", op)
        out_of_range = first._out_of_range(op, seen, scale)
    if record and local.numel() > 0:  # an empty tensor is no data ([Note: no data])
        first._record(op, amax, out_of_range, own=own)
        for o in owners[1:]:
            o._record(op, amax, out_of_range, own=False)
    if out_of_range is None or not first.rescale:  # [Note: the price of re-scaling]
        return scale
    current = out_of_range if decides else ~torch.isfinite(seen)
    return torch.where(current, first._to_scale(op, seen), scale)


def _logical_amax(amax: torch.Tensor, hp: torch.Tensor, sharding) -> torch.Tensor:
    """``amax`` of this rank's part of ``hp`` made the amax of the logical tensor: reduced over
    the mesh axes that shard it (a DTensor's placements, or ``sharding``), over none for a plain
    tensor, which is whole on this rank ([Note: first step])."""
    mesh, placements = (hp.device_mesh, hp.placements) if is_dtensor(hp) else sharding or (None, ())
    if not any(not p.is_replicate() for p in placements):
        return amax
    return reduce_over_shards(_inf_for_nan(amax), mesh, placements, "max")


def shared_scale(owners: Sequence[DelayedScaling], op: Operand, hp: torch.Tensor,
                 record: Optional[bool] = None) -> torch.Tensor:
    """The scale of a cast that the float8 TP styles make for linears outside their forward,
    before its bytes are all-gathered ([Note: delayed casts in the float8 styles] in
    f8dist/tp/style.py): ``hp``'s shard amax is recorded into every owner, the scale is
    ``owners[0]``'s. ``record``: that of the forward whose gradient is cast (backward); None for
    a forward cast, made now.
    """
    record = owners[0].training() if record is None else record
    return _scale(owners, op, hp, record, communicated=True)


def _owners(model: nn.Module) -> List[DelayedScaling]:
    owners = [getattr(m, "delayed", None) for m in model.modules()]
    return [o for o in owners if isinstance(o, DelayedScaling)]


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


def set_amax_group(model: nn.Module, group) -> None:
    """Reduce the delayed amaxes of ``model`` over ``group`` (a process group or a device mesh;
    None: all ranks) in the sync ([Note: the amax group]). Needed only
    when ranks hold different layers (pipeline parallelism): call it before the first step.

    Example::

        >>> set_amax_group(stage_model, mesh["dp"])         # doctest: +SKIP
    """
    for o in _owners(model):
        o.group, o._verified = group, None


def _verify_layers(owners: List[DelayedScaling], entries, group) -> None:
    """[Note: the amax group]: every rank of ``group`` syncs the same delayed operands, checked by
    one fixed-size all-reduce the first time this set of layers syncs over ``group``."""
    names = ";".join(f"{o._fqn()}:{op}" for o, op in entries)
    key = (group, len(entries), _fingerprint(names))
    if all(o._verified == key for o in owners):
        return
    n, fp = float(len(entries)), key[2]
    mine = torch.tensor([n, -n, fp, -fp], device=owners[0].buffer("scale", entries[0][1]).device)
    _check(all_reduce(mine, "max", group) == mine, (
        f"sync_float8_amax_and_scale_history: the ranks of the group hold different delayed layers "
        f"(this rank: {len(entries)} delayed operands in {len(owners)} layers, from "
        f"{owners[0]._fqn()} to {owners[-1]._fqn()}); pass group=<the ranks that hold the same "
        "layers> (pipeline parallelism: each stage's data-parallel group)"
    ))
    for o in owners:
        o._verified = key


@torch.no_grad()
def sync_float8_amax_and_scale_history(model: nn.Module, group=None) -> None:
    """Roll every delayed amax history of ``model`` and recompute its scales.

    Call once per optimizer step, after the step's last backward and before the next training
    forward (e.g. just before ``optimizer.step()``). With torch.distributed initialized, the
    amaxes of the whole model go through ONE all-reduce (MAX) over ``group`` (a process group or a
    device mesh; None: the group given to :func:`set_amax_group`, by default all ranks), so every
    rank ends with the histories and scales of one device that saw the global batch and the
    logical (unsharded) tensors. The first call checks that the ranks hold the same delayed layers
    ([Note: the amax group]). Can be wrapped in ``torch.compile``. See [Note: delayed scaling].

    Example::

        >>> config = Float8LinearConfig.from_recipe_name("delayed")
        >>> model = convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)), config=config)
        >>> model(torch.randn(16, 32)).sum().backward()
        >>> sync_float8_amax_and_scale_history(model)
    """
    owners = _owners(model)
    if not owners:
        return
    for o in owners:
        o.sync_called = True  # [Note: a forgotten sync]
        o.check_materialized()
    group = group if group is not None else owners[0].group
    entries = [(o, op) for o in owners for op in o.operands]
    _verify_layers(owners, entries, group)
    steps = torch.stack([o.buffer("steps", op) for o, op in entries])  # [E, 6]
    own = steps[:, _OWN] >= 1  # [E]; else the step's shared-cast records, if any
    amaxes = torch.where(own, torch.stack([o.buffer("amax", op) for o, op in entries]),
                         steps[:, _SHARED_AMAX])  # [E]
    amaxes = torch.where(steps[:, _OWN] > 0, _inf_for_nan(amaxes), -1.0)  # [E]; [Note: no data]
    flags = torch.where(own, steps[:, _FLAG], steps[:, _SHARED_FLAG])  # [E]
    reduced = all_reduce(torch.cat([amaxes, flags]), "max", group)  # [2E]
    amaxes, finite = reduced[: len(entries)], torch.isfinite(reduced[: len(entries)])  # [E]
    seen = amaxes >= 0  # [E]: some rank of the group recorded data in this step
    out_of_range = (reduced[len(entries):] > 0) & finite  # [E]; a non-finite amax is counted apart
    # the first step's amax (amax init) and that of a step out of range fill the whole history
    restart = out_of_range | torch.tensor(
        [o.enable_amax_init and o.first_step[op] for o, op in entries], device=amaxes.device)  # [E]

    # histories of one length and scales of one dtype are updated as one stacked tensor each
    groups: Dict[tuple, List[int]] = {}
    for i, (o, op) in enumerate(entries):
        groups.setdefault((o.history_len, o.operands[op], o.round_pow2), []).append(i)
    for (_, dtype, round_pow2), idx in groups.items():
        histories = torch.stack([entries[i][0].buffer("amax_history", entries[i][1]) for i in idx])  # [G, L]
        amax, ok = amaxes[idx], finite[idx] & seen[idx]  # [G]
        rolled = torch.roll(histories, 1, dims=1)  # [G, L]
        rolled[:, 0] = amax
        new_hist = torch.where(restart[idx, None], amax[:, None].expand_as(rolled), rolled)
        new_hist = torch.where(ok[:, None], new_hist, histories)  # non-finite or no data: kept out
        old = torch.stack([entries[i][0].buffer("scale", entries[i][1]) for i in idx])  # [G]
        scales = torch.where(seen[idx], amax_to_scale(
            new_hist.amax(dim=1), dtype, round_to_power_of_2=round_pow2), old)  # [G]
        for j, i in enumerate(idx):
            o, op = entries[i]
            o.buffer("amax_history", op).copy_(new_hist[j])
            o.buffer("scale", op).copy_(scales[j])
    # this step's records to 0, the counters up
    counters = steps[:, _COUNTERS] + torch.stack([out_of_range, ~finite], dim=1)  # [E, 2]
    new_steps = torch.cat([torch.zeros_like(steps[:, :4]), counters], dim=1)  # [E, 6]
    for i, (o, op) in enumerate(entries):
        o.buffer("amax", op).zero_()
        o.buffer("steps", op).copy_(new_steps[i])
    _mark_synced(owners, entries, seen)


def _mark_synced(owners: List[DelayedScaling], entries, seen: torch.Tensor) -> None:
    """[Note: no data]: an operand leaves its first step once a sync saw data for it. Read on the
    host only while some operand has not (eagerly; a compiled sync marks every operand)."""
    if all(o.synced for o in owners) or torch.compiler.is_compiling():
        for o in owners:
            o.synced = True
        return
    for (o, op), s in zip(entries, seen.tolist()):
        o.first_step[op] = o.first_step[op] and not s


# [Note: a forgotten sync]
# Without sync_float8_amax_and_scale_history a delayed layer never leaves its first step: every
# cast follows its own amax, i.e. dynamic scaling, with an all-reduce per cast. Nothing in forward
# may count steps (Python state in a compiled region), so an optimizer step post-hook, registered
# for every optimizer once the first delayed layer exists, counts the steps over each delayed
# layer's weight, and after the second one without any sync warns once per process, naming the
# fix. The hook does nothing once every delayed layer alive has synced.
MISSING_SYNC_STEPS = 2
_pending: "weakref.WeakSet[DelayedScaling]" = weakref.WeakSet()
_hook = None


def _watch_for_missing_sync(owner: DelayedScaling) -> None:
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
                    f"{o._fqn()}) without sync_float8_amax_and_scale_history: their casts follow "
                    "each tensor's own amax (dynamic scaling, an all-reduce per cast). Call "
                    "f8dist.sync_float8_amax_and_scale_history(model) once per optimizer step, "
                    "before optimizer.step(), or use a dynamic recipe.",
                    UserWarning, stacklevel=2,
                )
                return


def delayed_scaling_counters(model: nn.Module) -> Dict[str, Dict[str, Dict[str, int]]]:
    """``{fqn: {operand: {"out_of_range_steps": n, "nonfinite_steps": n}}}`` of every delayed
    layer of ``model`` since it was built: steps in which a cast found its history scale out of
    range ([Note: out of range]; on any rank of the group) and steps whose amax was non-finite
    and kept out of the history. Counted by the sync; reading them syncs with the device.

    Example::

        >>> delayed_scaling_counters(model)["0"]["input"]             # doctest: +SKIP
        {'out_of_range_steps': 0, 'nonfinite_steps': 1}
    """
    out = {}
    for o in _owners(model):
        out[getattr(o.module, "fqn", "")] = {
            str(op): dict(zip(("out_of_range_steps", "nonfinite_steps"),
                              map(int, o.buffer("steps", op)[_COUNTERS].tolist())))
            for op in o.operands
        }
    return out


def apply_to_delayed_module(delayed: Optional[DelayedScaling], fn, apply):
    """``nn.Module._apply`` of a module that owns ``delayed`` (None: none): ``apply(fn)`` (the
    module's super()._apply with ``recurse`` bound), the delayed buffers kept float32, restarted
    when they leave the meta device (``to_empty``: garbage memory otherwise)."""
    if delayed is None:
        return apply(fn)
    from_meta = delayed.on_meta()
    out = apply(delayed.float32_apply(fn))
    if from_meta and not delayed.on_meta():
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
    owner.materialize()  # assign=True into a model built on meta
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
