"""The scale of one delayed cast: the history's, the first step's from the logical amax, or
re-scaled when out of range; its amax recorded now or after the cast.

[Note: first step]
Before the first sync there is no history. Until then a training cast, or one whose bytes are
communicated, follows the amax of the *logical* tensor (an evaluation cast: its own): its local
amax reduced over the mesh axes that shard it, as the dynamic recipes do.
A plain tensor (a micro-batch) is whole on its rank, so no reduction spans ranks that may run
different casts. With ``enable_amax_init`` the scale comes from that amax and the first sync fills
the history with it; without, the scale is 1.0 (torchao's) unless out of range.

[Note: out of range]
A delayed cast whose current amax times the history's scale lands outside :func:`in_range` proves
the history wrong: above ``SATURATION * fp8_max`` the top of the range saturates; below
``2**KEPT_BINADES`` times the smallest normal, the tensor's top binades are no longer all normal
(heavy-tailed tensors keep most elements that far below their max). The sync counts the step and
restarts the history from its amax. The cast keeps the history's scale (torchao's and Transformer
Engine's behaviour) unless ``rescale_out_of_range=True`` ([Note: the price of re-scaling]). An
all-zero tensor is never out of range; a non-finite amax makes the output non-finite ([Note:
non-finite values] in f8dist/core/scaling.py) and is kept out of the history. The rule is tensor ops
(``torch.where``), so compiled graphs keep it. Figures: docs/numerics.md
(``scripts/delayed_cases.py``).

[Note: the price of re-scaling]
A cast that may re-scale needs its own tensor's amax first: it reads the tensor twice and a
producer cannot fuse the cast, every step; no graph expresses "a second pass only when out of
range" without a host sync. It buys precision only in the step of a rare, counted range jump, so
``rescale_out_of_range`` defaults to False (figures: docs/numerics.md, Re-scaling or not).
The decision is per rank; bytes that are communicated must share one scale, so the TP styles'
casts decide on the logical amax (one scalar all-reduce per cast) and the FSDP2 weight all-gather
keeps the history's scale (an optimizer step does not move a weight out of range) and only counts.

[Note: eval forwards under FSDP2]
An evaluation forward records nothing, except for the FSDP2 float8 all-gather: FSDP2 skips
re-gathering a still-unsharded root after a forward without backward, so the next training
forward computes with the weight the evaluation gathered and records nothing for it. So an
evaluation all-gather records its amax aside, as a shared cast does, and the sync takes it only
for a step in which no training all-gather recorded its own. The all-gathered Float8Tensor holds a
copy of the scale, never the ``fp8_scale`` buffer, which the sync updates in place.

[Note: record after the cast]
Inductor's CPU backend fuses a cast followed by an amax over the same tensor, not the reverse
(``CppScheduling._why_fuse_nodes``), so a cast with the history's scale has its amax record
deferred to ``later``, after the gemms: each tensor is read once. Eagerly nothing changes.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from f8dist.config import Operand
from f8dist.core.placement import is_dtensor, local_part, reduce_over_shards
from f8dist.core.scaling import amax_to_scale, fp8_max, in_memory, tensor_amax
from f8dist.core.tensor import Float8Tensor

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
    """The scale of one delayed cast of ``hp``'s local part for ``owners`` (several when one cast
    feeds several linears), from ``owners[0]``'s history ([Note: first step], [Note: out of
    range]); the amax is recorded into every owner when ``record`` (into ``owners[0]`` aside
    unless ``own``). A ``communicated`` DTensor decides on its logical amax; a float8 ``hp`` takes
    the history's scale. ``sharding``: (mesh, placements) of a non-DTensor shard (FSDP2's).
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
        local = in_memory(local)  # [Note: a cast that waits for its amax] in f8dist/core/scaling.py
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
    """``amax`` of this rank's part of ``hp`` reduced over the mesh axes that shard it ([Note:
    first step])."""
    mesh, placements = (hp.device_mesh, hp.placements) if is_dtensor(hp) else sharding or (None, ())
    if not any(not p.is_replicate() for p in placements):
        return amax
    return reduce_over_shards(inf_for_nan(amax), mesh, placements, "max")


def shared_scale(owners: Sequence[DelayedScaling], op: Operand, hp: torch.Tensor,
                 record: Optional[bool] = None) -> torch.Tensor:
    """The scale of a TP style's cast made outside the linears' forward ([Note: delayed casts in
    the float8 styles] in f8dist/parallel/tp/style.py). ``record``: that of the forward whose gradient is
    cast; None for a forward cast.
    """
    record = owners[0].training() if record is None else record
    return cast_scale(owners, op, hp, record, communicated=True)
