"""The model-wide sync of delayed scaling ([Note: delayed scaling] in f8dist/policy/delayed/) and the
counters it keeps.

[Note: the amax group]
The sync's all-reduce runs over the ranks that hold the same layers: all ranks by default; under
pipeline parallelism each stage's group (:func:`set_amax_group`). The first sync over a group
checks, with one fixed-size all-reduce of a fingerprint, that its ranks hold the same delayed
layers, so a mismatch raises naming the fix instead of hanging or mixing layers.
"""

from __future__ import annotations

import zlib
from typing import Dict, List

import torch
import torch.nn as nn

from f8dist.policy.delayed.hooks import check_materialized
from f8dist.policy.delayed.scale import inf_for_nan
from f8dist.policy.delayed.state import (
    _COUNTERS, _FLAG, _OWN, _SHARED_AMAX, _SHARED_FLAG, DelayedScaling, find_owners,
)
from f8dist.core.placement import all_reduce
from f8dist.core.scaling import amax_to_scale

__all__ = ["set_amax_group", "sync_float8_amax_and_scale_history", "delayed_scaling_counters"]


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


def set_amax_group(model: nn.Module, group) -> None:
    """Reduce the delayed amaxes of ``model`` over ``group`` (a process group or a device mesh;
    None: all ranks) in the sync ([Note: the amax group]); call it before the first step.

    Example::

        >>> set_amax_group(stage_model, mesh["dp"])         # doctest: +SKIP
    """
    for o in find_owners(model):
        o.group, o.verified = group, None


def _verify_layers(owners: List[DelayedScaling], entries, group) -> None:
    """Check [Note: the amax group] once per set of layers and group."""
    names = ";".join(f"{o.fqn()}:{op}" for o, op in entries)
    key = (group, len(entries), _fingerprint(names))
    if all(o.verified == key for o in owners):
        return
    n, fp = float(len(entries)), key[2]
    mine = torch.tensor([n, -n, fp, -fp], device=owners[0].buffer("scale", entries[0][1]).device)
    _check(all_reduce(mine, "max", group) == mine, (
        f"sync_float8_amax_and_scale_history: the ranks of the group hold different delayed layers "
        f"(this rank: {len(entries)} delayed operands in {len(owners)} layers, from "
        f"{owners[0].fqn()} to {owners[-1].fqn()}); pass group=<the ranks that hold the same "
        "layers> (pipeline parallelism: each stage's data-parallel group)"
    ))
    for o in owners:
        o.verified = key


@torch.no_grad()
def sync_float8_amax_and_scale_history(model: nn.Module, group=None) -> None:
    """Roll every delayed amax history of ``model`` and recompute its scales.

    Call once per optimizer step, after the last backward (e.g. just before ``optimizer.step()``).
    The whole model's amaxes go through ONE all-reduce (MAX) over ``group`` (None: the group of
    :func:`set_amax_group`, by default all ranks; [Note: the amax group]). Can be wrapped in
    ``torch.compile``. See [Note: delayed scaling].

    Example::

        >>> config = Float8LinearConfig.from_recipe_name("delayed")
        >>> model = convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)), config=config)
        >>> model(torch.randn(16, 32)).sum().backward()
        >>> sync_float8_amax_and_scale_history(model)
    """
    owners = find_owners(model)
    if not owners:
        return
    for o in owners:
        o.sync_called = True  # [Note: a forgotten sync]
        check_materialized(o)
    group = group if group is not None else owners[0].group
    entries = [(o, op) for o in owners for op in o.operands]
    _verify_layers(owners, entries, group)
    steps = torch.stack([o.buffer("steps", op) for o, op in entries])  # [E, 6]
    own = steps[:, _OWN] >= 1  # [E]; else the step's shared-cast records, if any
    amaxes = torch.where(own, torch.stack([o.buffer("amax", op) for o, op in entries]),
                         steps[:, _SHARED_AMAX])  # [E]
    amaxes = torch.where(steps[:, _OWN] > 0, inf_for_nan(amaxes), -1.0)  # [E]; [Note: no data]
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
    """[Note: no data]: an operand leaves its first step once a sync saw data for it."""
    if all(o.synced for o in owners) or torch.compiler.is_compiling():
        for o in owners:
            o.synced = True
        return
    for (o, op), s in zip(entries, seen.tolist()):
        o.first_step[op] = o.first_step[op] and not s


def delayed_scaling_counters(model: nn.Module) -> Dict[str, Dict[str, Dict[str, int]]]:
    """``{fqn: {operand: {"out_of_range_steps": n, "nonfinite_steps": n}}}`` of every delayed
    layer of ``model`` since it was built ([Note: out of range]); reading them syncs the device.

    Example::

        >>> delayed_scaling_counters(model)["0"]["input"]             # doctest: +SKIP
        {'out_of_range_steps': 0, 'nonfinite_steps': 1}
    """
    out = {}
    for o in find_owners(model):
        out[getattr(o.module, "fqn", "")] = {
            str(op): dict(zip(("out_of_range_steps", "nonfinite_steps"),
                              map(int, o.buffer("steps", op)[_COUNTERS].tolist())))
            for op in o.operands
        }
    return out
