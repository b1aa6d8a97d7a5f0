"""Swap ``nn.Linear`` modules for :class:`~f8dist.linear.Float8Linear`, in place."""

from __future__ import annotations

import logging
from typing import Callable, List, Optional

import torch.nn as nn

from f8dist import agreement
from f8dist.config import Float8LinearConfig
from f8dist.gemm import GEMM_ALIGNMENT
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
    a :class:`Float8Linear` sharing its parameters. Returns ``module`` (or the new module if
    ``module`` itself is a linear).

    Linears whose ``in_features`` or ``out_features`` is not a multiple of 16 cannot run
    ``torch._scaled_mm``: they stay high precision, with a log note, unless
    ``config.pad_inner_dim`` is set (they are then padded) or ``skip_incompatible=False``, which
    raises instead.

    Example::

        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        >>> _ = convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != "2")
        >>> type(model[0]).__name__, type(model[2]).__name__
        ('Float8Linear', 'Linear')
    """
    config = config if config is not None else Float8LinearConfig()
    skipped: List[str] = []

    def swap(mod: nn.Module, fqn: str) -> nn.Module:
        if type(mod) is nn.Linear and (module_filter_fn is None or module_filter_fn(mod, fqn)):
            if not is_float8_compatible(mod) and not config.pad_inner_dim and not config.emulate:
                if skip_incompatible:
                    skipped.append(f"{fqn or '<root>'} ({mod.in_features} -> {mod.out_features})")
                    return mod
                # Float8Linear's constructor raises the error that says what to change
            return Float8Linear.from_float(mod, config, fqn=fqn)
        for name, child in mod.named_children():
            new = swap(child, f"{fqn}.{name}" if fqn else name)
            if new is not child:
                setattr(mod, name, new)
        return mod

    out = swap(module, "")
    agreement.check_before_first_forward(out)  # [Note: ranks that disagree]
    if skipped:
        logger.warning(
            "f8dist: kept %d linear(s) in high precision because their dims are not multiples of "
            "%d: %s. Set Float8LinearConfig(pad_inner_dim=True) to pad them instead.",
            len(skipped), GEMM_ALIGNMENT, ", ".join(skipped),
        )
    return out
