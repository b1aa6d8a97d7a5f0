"""Swap ``nn.Linear`` modules for :class:`~f8dist.linear.Float8Linear`, in place."""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, List, Optional

import torch.nn as nn

from f8dist import agreement
from f8dist.config import Float8LinearConfig
from f8dist.gemm import GEMM_ALIGNMENT
from f8dist.grouped import Float8GroupedExperts, GroupedExperts, is_float8_grouped_compatible
from f8dist.linear import Float8Linear

__all__ = ["convert_to_float8_training", "is_float8_compatible"]

logger = logging.getLogger(__name__)

ModuleFilter = Callable[[nn.Module, str], bool]


def is_float8_compatible(mod: nn.Linear) -> bool:
    """Whether ``torch._scaled_mm`` can take this linear's gemms as they are (dims % 16 == 0)."""
    return mod.in_features % GEMM_ALIGNMENT == 0 and mod.out_features % GEMM_ALIGNMENT == 0


def convert_to_float8_training(
    module: nn.Module,
    *,
    config: Optional[Float8LinearConfig] = None,
    module_filter_fn: Optional[ModuleFilter] = None,
    skip_incompatible: bool = True,
) -> nn.Module:
    """Replace every ``nn.Linear`` in ``module`` (that ``module_filter_fn(mod, fqn)`` accepts) with
    a :class:`Float8Linear` sharing its parameters, and every
    :class:`~f8dist.grouped.GroupedExperts` (a mixture-of-experts layer's experts) with a
    :class:`~f8dist.grouped.Float8GroupedExperts` whose grouped gemms run in float8 through the
    same cast table ([Note: grouped gemms] in f8dist/grouped.py). A router is no nn.Linear (see
    f8dist/models/moe.py) and stays in high precision. Returns ``module`` (or the new module if
    ``module`` itself is a linear).

    Linears whose ``in_features`` or ``out_features`` is not a multiple of 16 cannot run
    ``torch._scaled_mm``: they stay high precision, with a log note, unless
    ``config.pad_inner_dim`` is set (they are then padded) or ``skip_incompatible=False``, which
    raises instead.

    All or nothing: every layer is decided and built before the model changes, so an error
    (a raising ``module_filter_fn``, an incompatible layer) leaves it as it was. A linear's child
    modules move to its Float8Linear, converted as well. Converting a converted model again is a
    no-op with the same config and an error with another (a Float8Linear's config is fixed).

    Example::

        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        >>> _ = convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != "2")
        >>> type(model[0]).__name__, type(model[2]).__name__
        ('Float8Linear', 'Linear')
    """
    config = config if config is not None else Float8LinearConfig()
    skipped: List[str] = []
    swaps = []  # (parent, name, old, new): children before their parents

    def plan(mod: nn.Module, fqn: str) -> nn.Module:
        """What replaces ``mod`` (itself if nothing); records its children's replacements."""
        for name, child in mod.named_children():
            new = plan(child, f"{fqn}.{name}" if fqn else name)
            if new is not child:
                swaps.append((mod, name, child, new))
        grouped = isinstance(mod, GroupedExperts)  # [Note: grouped gemms] in f8dist/grouped.py
        if type(mod) is not nn.Linear and not isinstance(mod, Float8Linear) and not grouped:
            return mod
        if module_filter_fn is not None and not module_filter_fn(mod, fqn):
            return mod
        if isinstance(mod, (Float8Linear, Float8GroupedExperts)):
            _check_same_config(mod, config, fqn)
            return mod
        if grouped:
            if not is_float8_grouped_compatible(mod) and not config.emulate:
                if skip_incompatible:
                    skipped.append(f"{fqn} (experts {mod.dim} <-> {mod.hidden_dim})")
                    return mod
            return Float8GroupedExperts.from_float(mod, config, fqn=fqn)
        if not is_float8_compatible(mod) and not config.pad_inner_dim and not config.emulate:
            if skip_incompatible:
                skipped.append(f"{fqn or '<root>'} ({mod.in_features} -> {mod.out_features})")
                return mod
            # Float8Linear's constructor raises the error that says what to change
        return Float8Linear.from_float(mod, config, fqn=fqn)

    out = plan(module, "")
    if out is not module:
        swaps.append((None, "", module, out))
    for parent, name, old, new in swaps:
        for child_name, child in old.named_children():  # already replaced: children come first
            new.register_module(child_name, child)
        if parent is not None:
            setattr(parent, name, new)
    agreement.check_before_first_forward(out)  # [Note: ranks that disagree]
    if skipped:
        logger.warning(
            "f8dist: kept %d linear(s) in high precision because their dims are not multiples of "
            "%d: %s. Set Float8LinearConfig(pad_inner_dim=True) to pad them instead.",
            len(skipped), GEMM_ALIGNMENT, ", ".join(skipped),
        )
    return out


def _check_same_config(mod, config: Float8LinearConfig, fqn: str) -> None:
    differ = [
        f.name for f in dataclasses.fields(config)
        if getattr(mod.config, f.name) != getattr(config, f.name)
    ]
    if differ:
        raise ValueError(
            f"{fqn or '<root>'}: already a Float8Linear, with a config that differs from the one "
            f"given in {', '.join(differ)}. A Float8Linear's config is fixed: convert the "
            f"unconverted model (e.g. a fresh copy) with the config you want."
        )
