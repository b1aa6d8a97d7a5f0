"""Ranks that shard one float8 model must cast alike: a check, once, before its first step.

[Note: ranks that disagree]
Ranks that shard a model (FSDP2, tensor parallel) run its collectives in lockstep, and f8dist's
settings decide which collectives run: a float8 all-gather sends 1 byte per element where a plain
one sends 2 or 4, a delayed cast syncs amax histories that a dynamic one does not keep, a
tensorwise cast all-reduces an amax that a rowwise one takes per row, a float8 TP style all-gathers
float8 where PyTorch's sends high precision. Ranks whose settings differ (a flag or environment
variable read differently on one node) hang in mismatched collectives until the process-group
timeout, or train silently with different numerics per rank.

So ``convert_to_float8_training`` registers the model, and before its first forward the ranks
that shard it compare their :func:`settings` (each linear's float8 config, field by field, and
the float8 TP style applied to each module) in one all-gather of a fixed-size fingerprint: a hash
of the settings and their length, 16 bytes per rank. Every rank runs that same collective
whatever its settings, so the check cannot hang on the disagreement it looks for. Equal
fingerprints end the check. Otherwise every rank has seen the difference: they exchange their
settings (``all_gather_object``) and all raise the same error, naming the differing fields, the
ranks and the modules.

The check runs from a global forward pre-hook, which runs before a module's own hooks, i.e. before
FSDP2's pre-forward all-gather; the hook is removed once no registered model is left unchecked.
``precompute_float8_dynamic_scale_for_fsdp`` checks too, as it may run before the first forward.
Tensor parallelism needs a check before sharding as well: ``parallelize_module`` broadcasts the
buffers of delayed scaling, which ranks that disagree do not all have. ``parallelize_llama``
checks over the tp mesh first (every rank calls it, with float8 styles or without); a custom plan
calls :func:`check` before ``parallelize_module``. The styles themselves do not check: a rank
that applies PyTorch's styles instead would never join.
The group is the largest device mesh among the model's DTensor parameters; a model without DTensor
parameters (one device, DDP) is not checked, and a model converted without an initialized process
group of several ranks registers nothing (no hook, no cost). A rank that never converts cannot be
checked: convert on every rank, after ``init_process_group``.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import weakref
from typing import Dict, List, Tuple

import torch
import torch.nn as nn

from f8dist.config import Float8LinearConfig
from f8dist.grouped import GroupedExperts
from f8dist.placement import _whole_mesh_group, is_dtensor

__all__ = ["agree", "check", "check_before_first_forward", "check_once", "record_style", "settings"]

Settings = Dict[Tuple[str, str], str]  # (module, field) -> value

_unchecked: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_hook = None
_WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")  # not in names
_SHOWN = 5  # differences named in the error


def check_before_first_forward(model: nn.Module) -> None:
    """Check ``model`` against the other ranks before its first forward ([Note: ranks that
    disagree]); ``convert_to_float8_training`` calls it."""
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
    check_once(getattr(module, "_orig_mod", module))  # torch.compile(model) wraps the model


def check_once(model: nn.Module) -> None:
    """:func:`check` ``model`` over the largest mesh its DTensor parameters live on, if it is
    registered and not yet checked (no collective otherwise).

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
    meshes = {p.device_mesh for p in model.parameters() if is_dtensor(p)}
    if meshes:
        check(model, max(meshes, key=lambda m: m.size()))


def check(model: nn.Module, mesh) -> None:
    """Compare ``model``'s :func:`settings` across the ranks of ``mesh`` now (every one of them
    must call it); raises a RuntimeError naming the differences. ``parallelize_llama`` calls it
    before sharding: a TP plan broadcasts delayed-scaling buffers, where ranks that disagree
    would hang. Call it before ``parallelize_module`` with a plan of your own.

    Example::

        >>> convert_to_float8_training(model, config=config)
        >>> check(model, tp_mesh)                       # doctest: +SKIP
        >>> parallelize_module(model, tp_mesh, plan)    # doctest: +SKIP
    """
    import torch.distributed as dist

    if mesh.size() == 1 or not dist.is_initialized():
        return
    group = _whole_mesh_group(mesh)
    agree(
        settings(model), group.get_group() if group is not None else dist.group.WORLD,
        what=f"the ranks sharding {type(model).__name__} disagree on its float8 settings",
        fix="Give every rank the same convert_to_float8_training config and module_filter_fn and "
        "the same parallel styles.",
    )


def agree(mine: Settings, group, *, what: str, fix: str) -> None:
    """Compare ``mine`` across the ranks of ``group`` (every one of them calls it) in one
    fixed-size all-gather; raise a RuntimeError ``what``, the differences and ``fix`` if they
    differ ([Note: ranks that disagree])."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    ranks = dist.get_process_group_ranks(group)
    text = "\n".join(f"{k}={v}" for k, v in sorted(mine.items()))
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    fingerprint = torch.tensor([digest, len(text)], device=device)  # [2] int64
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # torch < 2.13
    gathered = funcol.wait_tensor(gather(fingerprint, 0, group))  # [ranks * 2]
    if bool((gathered.view(-1, 2) == fingerprint).all()):
        return
    everyone: List[Settings] = [{} for _ in ranks]
    dist.all_gather_object(everyone, mine, group=group)
    raise RuntimeError(
        f"f8dist: {what} (checked before its first step; they would hang in mismatched "
        "collectives or train with different numerics per rank):\n"
        + _differences(everyone, ranks) + "\n" + fix
    )


def settings(model: nn.Module) -> Settings:
    """What the ranks sharding ``model`` must agree on: for each linear (and each MoE layer's
    experts) whether it is float8 and its config (field by field), the float8 TP style of each
    module, and whether each MoE layer dispatches float8 tokens."""
    out: Settings = {}
    for name, m in model.named_modules():
        name = ".".join(p for p in name.split(".") if p not in _WRAPPERS) or "<root>"
        # a Float8Linear's config (the class is not imported here: f8dist.fsdp imports this module)
        config = getattr(m, "config", None)
        if isinstance(m, (nn.Linear, GroupedExperts)):  # a linear, or an MoE layer's experts
            out[name, "float8"] = str(isinstance(config, Float8LinearConfig))
            if isinstance(config, Float8LinearConfig):
                out.update(((name, field), value) for field, value in _fields(config))
        if hasattr(m, "float8_dispatch"):  # an MoE layer: its EP dispatch (f8dist/dispatch.py)
            out[name, "float8_dispatch"] = str(m.float8_dispatch)
        if hasattr(m, "_f8dist_tp_style"):
            out[name, "tp_style"] = m._f8dist_tp_style
    return out


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
