"""Ranks that shard one float8 model must cast alike: a check, once, before its first step.

[Note: ranks that disagree]
f8dist's settings decide which collectives run (float8 or plain all-gathers, amax syncs, float8
TP styles), so ranks whose settings differ (a flag read differently on one node, a rank that never
converts) hang in mismatched collectives, or train with different numerics per rank.

So before the first forward (a global forward pre-hook, ahead of FSDP2's and DDP's
collectives) the ranks compare their :func:`settings` through the c10d store, not a collective,
which a missing rank would hang: the group's first rank gathers hashes for at most
``F8DIST_AGREEMENT_TIMEOUT_S`` seconds and sets a verdict, and every rank raises the same error
naming the differences or the missing ranks. Sharding must not hang before it either: the float8
TP styles make delayed buffers Replicate in place (no broadcast); with PyTorch's own styles on a
delayed model, call :func:`check` before ``parallelize_module``.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import hashlib
import json
import os
import time
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from f8dist.config import Float8LinearConfig
from f8dist.core.placement import _whole_mesh_group, is_dtensor

__all__ = [
    "TIMEOUT_ENV", "agree", "canonical_name", "check", "check_before_first_forward", "check_once", "record_style",
    "settings", "timeout_s",
]
TIMEOUT_ENV = "F8DIST_AGREEMENT_TIMEOUT_S"

Settings = Dict[Tuple[str, str], str]  # (module, field) -> value

_unchecked: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_hook = None
_WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")  # not in names
_SHOWN = 5  # differences named in the error
# (group name, rank) -> checks made: the store keys of the next one. Per rank, not per process:
# threads may simulate ranks (tests/sim/threads.py)
_rounds: Dict[Tuple[str, int], int] = {}


def check_before_first_forward(model: nn.Module) -> None:
    """Check ``model`` before its first forward ([Note: ranks that disagree])."""
    import torch.distributed as dist

    global _hook
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return  # one process: no hook, no cost
    _unchecked.add(model)
    if _hook is None:
        _hook = nn.modules.module.register_module_forward_pre_hook(_before_forward)


def record_style(module: nn.Module, style) -> None:
    """Note the float8 parallel style applied to ``module`` (part of its :func:`settings`)."""
    module._f8dist_tp_style = repr(style)


def _before_forward(module: nn.Module, args) -> None:
    if torch.compiler.is_compiling():  # a traced hook must not run collectives
        return
    module = getattr(module, "_orig_mod", module)  # torch.compile(model) wraps the model
    group = getattr(module, "process_group", None)  # DDP's; its forward runs before the model's
    if group is not None and isinstance(getattr(module, "module", None), nn.Module):
        check_once(getattr(module.module, "_orig_mod", module.module), group)
    else:
        check_once(module)


def check_once(model: nn.Module, group=None) -> None:
    """:func:`check` ``model`` over ``group`` (default: the largest mesh its DTensor parameters
    live on), if it is registered and not yet checked (nothing to do otherwise).

    Example::

        >>> convert_to_float8_training(model, config=config)   # registers the model
        >>> fully_shard(model)                                 # doctest: +SKIP
        >>> check_once(model)   # or implicitly, at the first forward  # doctest: +SKIP
    """
    global _hook
    if model not in _unchecked:
        return
    for m in model.modules():
        _unchecked.discard(m)
    if not _unchecked and _hook is not None:
        _hook.remove()
        _hook = None
    if group is not None:
        _check_group(model, group)
        return
    meshes = {p.device_mesh for p in model.parameters() if is_dtensor(p)}
    if meshes:
        check(model, max(meshes, key=lambda m: m.size()))


def check(model: nn.Module, mesh) -> None:
    """Compare ``model``'s :func:`settings` across the ranks of ``mesh`` now (every one of them
    must call it); raises a RuntimeError naming the differences. Call it before
    ``parallelize_module`` with a plan of your own ([Note: ranks that disagree]).

    Example::

        >>> convert_to_float8_training(model, config=config)
        >>> check(model, tp_mesh)                       # doctest: +SKIP
        >>> parallelize_module(model, tp_mesh, plan)    # doctest: +SKIP
    """
    import torch.distributed as dist

    if mesh.size() == 1 or not dist.is_initialized():
        return
    group = _whole_mesh_group(mesh)
    _check_group(model, group.get_group() if group is not None else dist.group.WORLD)


def _check_group(model: nn.Module, group) -> None:
    agree(
        settings(model), group,
        what=f"the ranks training {type(model).__name__} disagree on its float8 settings",
        fix="Give every rank the same convert_to_float8_training config and module_filter_fn and "
        "the same parallel styles, and convert on every rank.",
    )


def agree(mine: Settings, group, *, what: str, fix: str) -> None:
    """Compare ``mine`` across the ranks of ``group`` (every one calls it) through the c10d
    store; raise ``what``, the differences and ``fix`` if they differ, or name the ranks that did
    not check in time ([Note: ranks that disagree]). Checks compare in the order each rank makes
    them."""
    import torch.distributed as dist

    if dist.get_backend(group) == "fake":  # every rank simulated in this process
        return
    ranks = dist.get_process_group_ranks(group)
    me, leader = dist.get_rank(), ranks[0]
    name = getattr(group, "group_name", None) or dist.distributed_c10d._get_process_group_name(group)
    _rounds[name, me] = _rounds.get((name, me), -1) + 1
    prefix = f"f8dist/agreement/{name}/{_rounds[name, me]}/"
    store = dist.distributed_c10d._get_default_store()
    text = json.dumps(sorted([m, f, v] for (m, f), v in mine.items()))
    store.set(f"{prefix}hash/{me}", hashlib.sha256(text.encode()).hexdigest())
    seconds = timeout_s()
    deadline = time.monotonic() + seconds
    late = (f"did not check its float8 settings within {seconds:g} s ({TIMEOUT_ENV}); did it "
            "convert the model with convert_to_float8_training (and run the same program)?")
    head = f"f8dist: {what} (checked before its first step; they would hang in mismatched " \
           "collectives or train with different numerics per rank):\n"
    if me != leader:
        verdict = _get(store, f"{prefix}verdict", seconds)
        if verdict is None:
            raise RuntimeError(f"{head}  rank {leader}, which compares the ranks, {late}\n{fix}")
        if verdict.startswith("send "):
            if str(me) in verdict[5:].split(","):
                store.set(f"{prefix}settings/{me}", text)
            verdict = _get(store, f"{prefix}error", seconds) or f"{head}  rank {leader} {late}\n{fix}"
        if verdict != "ok":
            raise RuntimeError(verdict)
        return
    # one deadline for all: ranks that never come cost the timeout once, not once each
    hashes = {r: _get(store, f"{prefix}hash/{r}", deadline - time.monotonic()) for r in ranks}
    missing = [r for r, h in hashes.items() if h is None]
    if missing:
        many = len(missing) > 1
        late = late.replace(" its ", " their ").replace("did it", "did they") if many else late
        error = f"{head}  rank{'s' if many else ''} {_ranks(missing)} {late}\n{fix}"
        store.set(f"{prefix}verdict", error)
        raise RuntimeError(error)
    sender = {h: r for r, h in reversed(list(hashes.items()))}  # one rank per distinct hash
    if len(sender) == 1:
        store.set(f"{prefix}verdict", "ok")
        return
    store.set(f"{prefix}verdict", "send " + ",".join(str(r) for r in sender.values() if r != me))
    texts = {me: text}
    for r in sender.values():
        texts[r] = texts.get(r) or _get(store, f"{prefix}settings/{r}", seconds) or "[]"
    by_hash = {h: {(m, f): v for m, f, v in json.loads(texts[r])} for h, r in sender.items()}
    error = head + _differences([by_hash[hashes[r]] for r in ranks], ranks) + "\n" + fix
    store.set(f"{prefix}error", error)
    raise RuntimeError(error)


def timeout_s() -> float:
    """Seconds a rank waits for the others in a check: ``F8DIST_AGREEMENT_TIMEOUT_S`` (60)."""
    raw = os.environ.get(TIMEOUT_ENV, "60")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: expected a positive number of seconds, e.g. 60")
    return seconds


def _get(store, key: str, seconds: float) -> Optional[str]:
    """The value of ``key`` once some rank set it, or None after ``seconds``."""
    import torch.distributed as dist

    if seconds <= 0:  # past the deadline: only what is there already
        return store.get(key).decode() if store.check([key]) else None
    try:
        store.wait([key], datetime.timedelta(seconds=seconds))
    except (dist.DistStoreError, RuntimeError) as e:
        if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
            raise
        return None
    return store.get(key).decode()


# Module types convert_to_float8_training converts, registered by their defining modules (this
# module imports none of them: the layers above import it)
CONVERTIBLE: List[type] = [nn.Linear]


def settings(model: nn.Module) -> Settings:
    """What the ranks sharding ``model`` must agree on: whether each convertible module is float8,
    its config field by field, and each module's float8 parallel style (TP or EP)."""
    out: Settings = {}
    for name, m in model.named_modules():
        name = canonical_name(name) or "<root>"
        # a Float8Linear's config (the class is not imported here: f8dist.parallel.fsdp imports this module)
        config = getattr(m, "config", None)
        if isinstance(m, tuple(CONVERTIBLE)):  # a linear, or an MoE layer's experts
            out[name, "float8"] = str(isinstance(config, Float8LinearConfig))
            if isinstance(config, Float8LinearConfig):
                out.update(((name, field), value) for field, value in _fields(config))
        if hasattr(m, "_f8dist_tp_style"):
            out[name, "tp_style"] = m._f8dist_tp_style
    return out


def canonical_name(name: str) -> str:
    """``name`` without the parts wrappers add (activation checkpointing, torch.compile, FSDP1):
    the name ``get_model_state_dict`` and the other ranks use."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPERS)


def _fields(obj, prefix: str = ""):
    """(dotted field name, repr of the value) of a nested frozen config."""
    if not dataclasses.is_dataclass(obj):
        yield prefix, str(obj) if isinstance(obj, enum.Enum) else repr(obj)
        return
    for f in dataclasses.fields(obj):
        yield from _fields(getattr(obj, f.name), f"{prefix}.{f.name}" if prefix else f.name)


def _differences(per_rank: List[Settings], ranks: List[int]) -> str:
    """One line per differing field and set of values, naming the ranks and modules."""
    keys = sorted(set().union(*per_rank))
    values = {k: [s.get(k, "<not set>") for s in per_rank] for k in keys}
    converted_differently = {m for (m, f), v in values.items() if f == "float8" and len(set(v)) > 1}
    groups: Dict[tuple, List[str]] = {}
    for (module, field), vals in values.items():
        if len(set(vals)) == 1 or (field != "float8" and module in converted_differently):
            continue
        by_value: Dict[str, List[int]] = {}
        for rank, v in zip(ranks, vals):
            by_value.setdefault(v, []).append(rank)
        key = (field, tuple((v, tuple(r)) for v, r in by_value.items()))
        groups.setdefault(key, []).append(module)
    lines = []
    for (field, by_value), modules in list(groups.items())[:_SHOWN]:
        on = ", ".join(f"{v} on rank{'s' if len(r) > 1 else ''} {_ranks(r)}" for v, r in by_value)
        more = f" and {len(modules) - 3} more" if len(modules) > 3 else ""
        lines.append(f"  {field}: {on} (modules {', '.join(modules[:3])}{more})")
    if len(groups) > _SHOWN:
        lines.append(f"  ... and {len(groups) - _SHOWN} more differences")
    return "\n".join(lines)


def _ranks(ranks) -> str:
    more = f", ... ({len(ranks)} ranks)" if len(ranks) > 8 else ""
    return ", ".join(map(str, ranks[:8])) + more
