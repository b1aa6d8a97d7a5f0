"""The scale of one delayed cast: the history's, the first step's from the logical amax, or
re-scaled when out of range; its amax recorded now or after the cast.

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
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from f8dist.config import Operand
from f8dist.placement import is_dtensor, local_part, reduce_over_shards
from f8dist.scaling import amax_to_scale, fp8_max, in_memory, tensor_amax
from f8dist.tensor import Float8Tensor

__all__ = ["in_range", "shared_scale"]

# [Note: out of range]: the binades below a tensor's max that a delayed cast keeps in normal
# numbers, and how far above the format's max its max may land
KEPT_BINADES, SATURATION = 10, 2.0
Records = List[Callable[[], object]]  # amax records to run after the casts


def in_range(dtype: torch.dtype) -> Tuple[float, float]:
    """Where a delayed cast's max may land in float8 units ([Note: out of range]): from
    ``2**KEPT_BINADES`` times the smallest normal to ``SATURATION`` times the max (e4m3: 16..896,
    e5m2: 2**-4..114688)."""
    return torch.finfo(dtype).tiny * 2.0**KEPT_BINADES, SATURATION * fp8_max(dtype)


def inf_for_nan(amax: torch.Tensor) -> torch.Tensor:
    """A MAX all-reduce may drop a NaN (max(NaN, x) is x on some backends); inf survives it."""
    return torch.where(torch.isnan(amax), torch.inf, amax)


def _to_scale(owner: DelayedScaling, op: Operand, amax: torch.Tensor) -> torch.Tensor:
    return amax_to_scale(amax, owner.operands[op], round_to_power_of_2=owner.round_pow2)


def _out_of_range(owner: DelayedScaling, op: Operand, amax: torch.Tensor,
                  scale: torch.Tensor) -> torch.Tensor:
    """[Note: out of range], or a non-finite ``amax``; never an all-zero tensor."""
    low, high = owner.bounds[op]
    x = amax * scale  # [], where the tensor's max lands in float8 units
    return ~(((x >= low) & (x <= high)) | (amax <= 0))  # NaN compares False: out


def cast_scale(
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
            later.append(lambda: cast_scale(owners, op, hp, record, communicated, own=own,
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
        scale = _to_scale(first, op, seen)
    else:
        scale = first.buffer("scale", op)
        out_of_range = _out_of_range(first, op, seen, scale)
    if record and local.numel() > 0:  # an empty tensor is no data ([Note: no data])
        first.record_amax(op, amax, out_of_range, own=own)
        for o in owners[1:]:
            o.record_amax(op, amax, out_of_range, own=False)
    if out_of_range is None or not first.rescale:  # [Note: the price of re-scaling]
        return scale
    current = out_of_range if decides else ~torch.isfinite(seen)
    return torch.where(current, _to_scale(first, op, seen), scale)


def _logical_amax(amax: torch.Tensor, hp: torch.Tensor, sharding) -> torch.Tensor:
    """``amax`` of this rank's part of ``hp`` made the amax of the logical tensor: reduced over
    the mesh axes that shard it (a DTensor's placements, or ``sharding``), over none for a plain
    tensor, which is whole on this rank ([Note: first step])."""
    mesh, placements = (hp.device_mesh, hp.placements) if is_dtensor(hp) else sharding or (None, ())
    if not any(not p.is_replicate() for p in placements):
        return amax
    return reduce_over_shards(inf_for_nan(amax), mesh, placements, "max")


def shared_scale(owners: Sequence[DelayedScaling], op: Operand, hp: torch.Tensor,
                 record: Optional[bool] = None) -> torch.Tensor:
    """The scale of a cast that the float8 TP styles make for linears outside their forward,
    before its bytes are all-gathered ([Note: delayed casts in the float8 styles] in
    f8dist/tp/style.py): ``hp``'s shard amax is recorded into every owner, the scale is
    ``owners[0]``'s. ``record``: that of the forward whose gradient is cast (backward); None for
    a forward cast, made now.
    """
    record = owners[0].training() if record is None else record
    return cast_scale(owners, op, hp, record, communicated=True)
