"""Swap ``nn.Linear`` modules for :class:`~f8dist.nn.linear.Float8Linear`, in place."""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Dict, List, Optional, Union

import torch.nn as nn

from f8dist.core import agreement
from f8dist.config import Float8LinearConfig
from f8dist.policy.delayed import ignore_in_ddp
from f8dist.core.gemm import shape_problems
from f8dist.nn.grouped import Float8GroupedExperts, GroupedExperts, grouped_problems
from f8dist.nn.linear import Float8Linear
from f8dist.core.placement import is_dtensor

__all__ = ["convert_to_float8_training", "is_float8_compatible"]

logger = logging.getLogger(__name__)

ModuleFilter = Callable[[nn.Module, str], bool]


def is_float8_compatible(mod: nn.Linear, config: Optional[Float8LinearConfig] = None) -> bool:
    """Whether the float8 gemms can take this linear's dims as they are (alignment, and
    ``config``'s blocks). Reads only ``in_features`` and ``out_features``."""
    return not _problems(mod, config)


def _problems(mod: nn.Linear, config: Optional[Float8LinearConfig]) -> List[str]:
    specs = config.cast_specs() if config is not None else ()
    return shape_problems(specs, mod.in_features, mod.out_features)


def convert_to_float8_training(
    module: nn.Module,
    *,
    config: Union[Float8LinearConfig, str, None] = None,
    module_filter_fn: Optional[ModuleFilter] = None,
    skip_incompatible: bool = True,
) -> nn.Module:
    """Replace every ``nn.Linear`` in ``module`` (that ``module_filter_fn(mod, fqn)`` accepts) with
    a :class:`Float8Linear` sharing its parameters, and every
    :class:`~f8dist.nn.grouped.GroupedExperts` with a :class:`~f8dist.nn.grouped.Float8GroupedExperts`
    ([Note: grouped gemms] in f8dist/nn/grouped.py). Returns ``module`` (or its replacement).
    ``config``: a :class:`Float8LinearConfig`, a recipe name, or None (the default).

    Layers whose dims do not fit the float8 gemms (alignment, the recipe's blocks) stay high
    precision with a log note, unless ``config.pad_inner_dim`` pads them or
    ``skip_incompatible=False`` raises instead. A module registered at several places is replaced
    at all of them ([Note: shared modules]); tied weights stay tied ([Note: tied weights]);
    ``nn.Linear`` subclasses that override ``forward`` stay high precision ([Note: nn.Linear
    subclasses]). Convert before ``fully_shard`` and ``parallelize_module``.

    Linears and experts that want different configs ([Note: options of grouped experts] in
    f8dist/nn/grouped.py) are converted in two calls, each picking its modules::

        >>> is_experts = lambda mod, fqn: isinstance(mod, GroupedExperts)
        >>> convert_to_float8_training(model, config=config,   # doctest: +SKIP
        ...     module_filter_fn=lambda mod, fqn: not is_experts(mod, fqn))
        >>> convert_to_float8_training(model, config=experts_config,  # doctest: +SKIP
        ...     module_filter_fn=is_experts)

    All or nothing: an error leaves the model as it was. Converting again with another config
    raises.

    Example::

        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        >>> _ = convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != "2")
        >>> type(model[0]).__name__, type(model[2]).__name__
        ('Float8Linear', 'Linear')
    """
    config = _resolve_config(config)
    skipped: List[str] = []
    swaps = []  # (parent, name, old, new): children before their parents
    planned: Dict[int, nn.Module] = {}  # id(module) -> its replacement ([Note: shared modules])

    def plan(mod: nn.Module, fqn: str) -> nn.Module:
        """What replaces ``mod`` (itself if nothing); records its children's replacements."""
        if id(mod) in planned:  # the same module at another place: replaced by the same one
            return planned[id(mod)]
        planned[id(mod)] = mod  # a module cannot contain itself; set for real below
        for name, child in list(mod._modules.items()):  # duplicates too, unlike named_children
            if child is None:
                continue
            new = plan(child, f"{fqn}.{name}" if fqn else name)
            if new is not child:
                swaps.append((mod, name, child, new))
        planned[id(mod)] = new = _replacement(mod, fqn)
        return new

    def _replacement(mod: nn.Module, fqn: str) -> nn.Module:
        grouped = isinstance(mod, GroupedExperts)  # [Note: grouped gemms] in f8dist/nn/grouped.py
        if not isinstance(mod, nn.Linear) and not grouped:
            return mod
        if module_filter_fn is not None and not module_filter_fn(mod, fqn):
            return mod
        if isinstance(mod, (Float8Linear, Float8GroupedExperts)):
            _check_same_config(mod, config, fqn)
            return mod
        if grouped:
            problems = grouped_problems(mod, config)
            if problems and not config.emulate:
                if config.pad_inner_dim:  # [Note: options of grouped experts] in grouped.py
                    raise ValueError(
                        f"{fqn or '<root>'}: pad_inner_dim=True pads a Float8Linear's dims, not "
                        f"grouped experts' (dim {mod.dim}, hidden_dim {mod.hidden_dim}: "
                        f"{', '.join(problems)}); keep these experts in high precision "
                        "(module_filter_fn) or give them dims that fit")
                if skip_incompatible:
                    skipped.append(f"{fqn} (experts {mod.dim} <-> {mod.hidden_dim}: "
                                   f"{', '.join(problems)})")
                    return mod
            return Float8GroupedExperts.from_float(mod, config, fqn=fqn)
        if type(mod).forward is not nn.Linear.forward:  # [Note: nn.Linear subclasses]
            skipped_subclasses.append(f"{fqn or '<root>'} ({type(mod).__qualname__})")
            return mod
        _check_not_sharded(mod, fqn)
        problems = _problems(mod, config)
        if problems and not config.pad_inner_dim and not config.emulate:
            if skip_incompatible:
                skipped.append(f"{fqn or '<root>'} ({mod.in_features} -> {mod.out_features}: "
                               f"{', '.join(problems)})")
                return mod
            # Float8Linear's constructor raises the error that says what to change
        return Float8Linear.from_float(mod, config, fqn=fqn)

    skipped_subclasses: List[str] = []
    out = plan(module, "")
    if out is not module:
        swaps.append((None, "", module, out))
    if config.enable_fsdp_float8_all_gather:
        _share_tied_weights(module, swaps)  # [Note: tied weights]
    done = set()
    for parent, name, old, new in swaps:
        if id(old) not in done:  # a module at two places moves its children once
            done.add(id(old))
            for child_name, child in old._modules.items():  # already replaced: children first
                new.register_module(child_name, child)
        if parent is not None:
            setattr(parent, name, new)
    ignore_in_ddp(out)  # [Note: ranks that disagree]
    agreement.check_before_first_forward(out)
    if skipped_subclasses:
        logger.warning(
            "f8dist: kept %d nn.Linear subclass(es) in high precision because they override "
            "forward (a Float8Linear would drop it): %s. Convert them yourself "
            "(Float8Linear.from_float) if their forward is a plain linear.",
            len(skipped_subclasses), ", ".join(skipped_subclasses),
        )
    if skipped:
        logger.warning(
            "f8dist: kept %d layer(s) in high precision because their dims do not fit the float8 "
            "gemms (the kernels' alignment, the recipe's blocks): %s. Set "
            "Float8LinearConfig(pad_inner_dim=True) to pad them instead.",
            len(skipped), "; ".join(skipped),
        )
    return out


def _resolve_config(config) -> Float8LinearConfig:
    """``config`` as given: a Float8LinearConfig, a recipe name, or None (the default)."""
    if config is None:
        return Float8LinearConfig()
    if isinstance(config, str):
        return Float8LinearConfig.from_recipe_name(config)  # an unknown name: says the known ones
    if not isinstance(config, Float8LinearConfig):
        raise TypeError(
            f"convert_to_float8_training: config must be a Float8LinearConfig or a recipe name "
            f"(e.g. 'rowwise'), got {type(config).__name__}; build one with "
            "Float8LinearConfig(...) or Float8LinearConfig.from_recipe_name(...)."
        )
    return config


def _check_same_config(mod, config: Float8LinearConfig, fqn: str) -> None:
    differ = [
        f.name for f in dataclasses.fields(config)
        if getattr(mod.config, f.name) != getattr(config, f.name)
    ]
    if differ:
        kind = type(mod).__name__
        raise ValueError(
            f"{fqn or '<root>'}: already a {kind}, with a config that differs from the one "
            f"given in {', '.join(differ)}. A {kind}'s config is fixed: convert the "
            f"unconverted model (e.g. a fresh copy) with the config you want, or leave the "
            f"converted modules out of this call (module_filter_fn)."
        )


# [Note: shared modules]
# named_children skips a module seen under another name, so a module registered twice
# (``nn.Sequential(lin, act, lin)``) would stay high precision at its later places. ``plan`` walks
# ``_modules`` itself, memoized by id: each module is decided once, at its first FQN (the one
# ``named_modules`` gives), and replaced at every place.

# [Note: nn.Linear subclasses]
# torchao converts ``isinstance(m, nn.Linear)``. A subclass that keeps nn.Linear's forward is a
# linear and converts; one that overrides forward (LoRA, a scaled head) computes something else,
# which Float8Linear would silently replace: it stays high precision, logged by name.

# [Note: tied weights]
# With ``enable_fsdp_float8_all_gather`` each converted weight becomes a new wrapper Parameter, so
# linears that shared a weight share the first one's wrapper (one optimizer state, one
# all-gather). A weight also held by a module that is not converted (a tied embedding) would get
# a float8 tensor from FSDP2: that raises, naming both places and the fix.


def _share_tied_weights(model: nn.Module, swaps) -> None:
    """[Note: tied weights]: the converted linears of one weight share one wrapper Parameter;
    a weight tied to anything else raises."""
    holders: Dict[int, List[tuple]] = {}  # id(weight before conversion) -> (module fqn, name)s
    for fqn, mod in model.named_modules(remove_duplicate=False):
        for name, p in mod._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((fqn, name))
    converted = {id(old): (old, new) for _, _, old, new in swaps
                 if isinstance(new, Float8Linear) and not isinstance(old, Float8Linear)}
    converted_fqns = {f for f, m in model.named_modules(remove_duplicate=False) if id(m) in converted}
    wrappers: Dict[int, nn.Parameter] = {}
    for old, new in converted.values():
        others = [f"{fqn}.{name}" if fqn else name for fqn, name in holders.get(id(old.weight), [])
                  if fqn not in converted_fqns or name != "weight"]
        if others:
            raise ValueError(
                f"convert_to_float8_training: the weight of {new.fqn or '<root>'} is tied to "
                f"{', '.join(others)}, which is not converted; with "
                "enable_fsdp_float8_all_gather=True FSDP2 would all-gather it in float8 for both. "
                f"Keep {new.fqn or '<root>'} in high precision (module_filter_fn), or set "
                "enable_fsdp_float8_all_gather=False."
            )
        shared = wrappers.setdefault(id(old.weight), new.weight)
        if shared is not new.weight:
            new.weight = shared


def _check_not_sharded(mod: nn.Linear, fqn: str) -> None:
    """Raise for a linear already sharded: convert first."""
    if is_dtensor(mod.weight):
        raise ValueError(
            f"convert_to_float8_training: {fqn or '<root>'} already has a DTensor weight (the model "
            "was sharded with fully_shard or parallelize_module); convert the model first, then "
            "apply fully_shard / parallelize_module."
        )
