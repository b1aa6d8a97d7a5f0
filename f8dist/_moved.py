"""Deprecated module paths: the package was laid out in layers (docs/design.md, "Layout"); the old
paths still import, each as the same module object as its new path, with a DeprecationWarning."""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old module path -> new module path (a package's submodules follow it)
MOVED = {
    "f8dist.cells": "f8dist.config.cells",
    "f8dist.specs": "f8dist.config.specs",
    "f8dist.recipes": "f8dist.config.recipes",
    "f8dist.recipe_names": "f8dist.config.recipe_names",
    "f8dist.config_rules": "f8dist.config.rules",
    "f8dist.scaling": "f8dist.core.scaling",
    "f8dist.numerics": "f8dist.core.numerics",
    "f8dist.placement": "f8dist.core.placement",
    "f8dist.agreement": "f8dist.core.agreement",
    "f8dist.tensor": "f8dist.core.tensor",
    "f8dist.gemm": "f8dist.core.gemm",
    "f8dist.grouped_gemm": "f8dist.core.gemm",
    "f8dist.cast": "f8dist.core.cast",
    "f8dist.fsdp.weight": "f8dist.core.weight",
    "f8dist.delayed": "f8dist.policy.delayed",
    "f8dist.sac": "f8dist.policy.sac",
    "f8dist.filters": "f8dist.policy.filters",
    "f8dist.checkpoint": "f8dist.policy.checkpoint",
    "f8dist.linear": "f8dist.nn.linear",
    "f8dist.grouped": "f8dist.nn.grouped",
    "f8dist.swiglu": "f8dist.nn.swiglu",
    "f8dist.convert": "f8dist.nn.convert",
    "f8dist.fsdp": "f8dist.parallel.fsdp",
    "f8dist.tp": "f8dist.parallel.tp",
    "f8dist.ep": "f8dist.parallel.ep",
    "f8dist.dispatch": "f8dist.parallel.ep.dispatch",
}


def new_name(name: str):
    """The module path that the old path ``name`` moved to, or None."""
    if name in MOVED:
        return MOVED[name]
    for old in sorted(MOVED, key=len, reverse=True):
        if name.startswith(old + "."):
            return MOVED[old] + name[len(old):]
    return None


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if new_name(name) else None

    def create_module(self, spec):
        new = new_name(spec.name)
        warnings.warn(f"{spec.name} moved to {new}: import it from there", DeprecationWarning,
                      stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module):
        pass  # the module at its new path is already executed


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
