"""Record the statistics of every float8 cast of a model, by module, gemm and operand.

[Note: telemetry is free when off]
The recorder hooks into ``f8dist.core.cast.cast_observers``, a plain Python list that
``cast_to_float8`` checks after each cast. Nothing is registered until a recorder is entered and
it is removed on exit (also on an exception), so with telemetry off a cast runs exactly the ops
it runs without this module, eager or traced.

[Note: statistics of the logical tensor]
Under FSDP2 or tensor parallel a cast may see DTensors: ``hp`` and a DTensor of Float8Tensors
sharing its placements (FSDP2's float8 all-gather casts each rank's shard as a part of the
sharded weight, f8dist/core/weight.py). Each rank computes the statistics of its shard (``cast_stats_tensors``,
sums and maxima) and they are reduced over exactly the mesh dims that shard the tensor, the same
rule as the amax (``[Note: amax]`` in f8dist/core/placement.py): a sum or max over the mesh axes
whose placement shards the tensor, nothing over a Replicate one. So every rank holds the statistics of the logical tensor
and a one-device run of the same model reports the same figures. Data parallelism does not shard
activations: each rank records the casts of its own micro-batch, and rank 0 prints its own.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from f8dist.core import cast as _cast_module
from f8dist.config import CastSite, Gemm, Operand
from f8dist.debug.stats import CastStats, cast_stats_tensors
from f8dist.nn.grouped import WEIGHTS as EXPERT_WEIGHTS, Float8GroupedExperts
from f8dist.nn.linear import Float8Linear
from f8dist.core.placement import has_partial, is_dtensor, local_part, reduce_over_shards

__all__ = ["StatsRecorder", "record", "is_rank0"]

Callback = Callable[[CastSite, torch.Tensor, torch.Tensor], None]

_NEEDS_EAGER = (
    "f8dist.debug records cast statistics in eager mode only: a compiled graph cannot hand "
    "tensors to Python callbacks. Run the steps you record uncompiled (keep the eager module, "
    "e.g. `compiled._orig_mod`, and call it inside the recorder), or leave the recorder off "
    "for compiled steps."
)


def is_rank0() -> bool:
    """True on one process: rank 0 of the default group, or the only process."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _is_fake(*tensors) -> bool:
    """Whether the tensors are being traced (FakeTensors, e.g. in a compiled backward)."""
    from torch._subclasses.fake_tensor import is_fake

    return any(is_fake(local_part(t)) for t in tensors)  # a Float8Tensor's: its inner tensors


def _reduce_over_shards(
    hp, sums: torch.Tensor, maxes: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sums and maxima of the logical tensor from those of the local shard (see
    [Note: statistics of the logical tensor])."""
    if has_partial(hp.placements):
        raise ValueError(
            f"f8dist.debug: a cast of a DTensor with Partial placements {hp.placements} has no "
            "well-defined statistics; reduce it (redistribute to Replicate or Shard) before the cast"
        )
    mesh, placements = hp.device_mesh, hp.placements
    return (reduce_over_shards(sums, mesh, placements, "sum"),
            reduce_over_shards(maxes, mesh, placements, "max"))


class StatsRecorder:
    """Collects :class:`~f8dist.debug.stats.CastStats` for every float8 cast of ``model``'s
    :class:`~f8dist.nn.linear.Float8Linear` modules and expert weights (of
    :class:`~f8dist.nn.grouped.Float8GroupedExperts`, FQNs ``....experts.w1`` ...) while entered (a
    context manager, re-entrant across steps). Statistics are kept per step (``set_step``) and per
    :class:`~f8dist.core.cast.CastSite`; several casts of one site in a step (gradient accumulation, a
    module called twice) are merged.

    ``callback(site, hp, fp8)``, if given, is called after each recorded cast with the tensor
    before quantization and the Float8Tensor (or DTensor of them) after it; ``fp8`` dequantizes
    with ``fp8.to_original_precision()`` (``fp8.to_local()`` first for a DTensor).

    Eager mode only: casts traced by ``torch.compile`` are not recorded, and leaving the ``with``
    block then raises a RuntimeError that says so.

    Example::

        >>> rec = StatsRecorder(model)
        >>> with rec:
        ...     model(x).sum().backward()
        >>> print(rec.table())
    """

    def __init__(self, model: nn.Module, *, callback: Optional[Callback] = None):
        fqns = []  # a linear's casts, and each expert weight's ([Note: grouped gemms])
        for m in model.modules():
            if isinstance(m, Float8Linear):
                fqns.append(m.fqn)
            elif isinstance(m, Float8GroupedExperts):
                fqns.extend(f"{m.fqn}.{w}" if m.fqn else w for w in EXPERT_WEIGHTS)
        if not fqns:
            raise ValueError(
                f"f8dist.debug: {type(model).__name__} has no Float8Linear module, so there are no "
                "casts to record; call f8dist.convert_to_float8_training(model) first"
            )
        self.fqns = set(fqns)
        self.callback = callback
        self.step = 0
        # step -> site -> list of (sums, maxes, float8 dtype), materialized lazily
        self._pending: Dict[int, Dict[CastSite, list]] = OrderedDict()
        self._order = {fqn: i for i, fqn in enumerate(fqns)}
        self._active = False
        self._traced_sites: List[CastSite] = []

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> "StatsRecorder":
        if self._active:
            raise RuntimeError("this StatsRecorder is already recording")
        _cast_module.cast_observers.append(self._observe)
        self._active = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        _cast_module.cast_observers.remove(self._observe)
        self._active = False
        traced = list(self._traced_sites)
        self._traced_sites.clear()
        if traced and exc_type is None:
            raise RuntimeError(
                f"{len(traced)} cast(s) ran under torch.compile and were not recorded (first: "
                f"{traced[0]}). " + _NEEDS_EAGER
            )

    def set_step(self, step: int) -> None:
        """Tag the casts that follow with ``step`` (e.g. the training step)."""
        self.step = int(step)

    # -- the observer -------------------------------------------------------------------------

    def _observe(self, site: CastSite, hp: torch.Tensor, fp8: torch.Tensor) -> None:
        if torch.compiler.is_compiling() or _is_fake(hp, fp8):
            # Raising here would graph-break inside the linear's autograd.Function; note the site
            # (dynamo replays a list append after the graph) and raise on exit, outside the graph.
            self._traced_sites.append(site)
            return
        if site.fqn not in self.fqns:
            return
        with torch.no_grad():
            if is_dtensor(hp):
                local = fp8.to_local()
                sums, maxes = cast_stats_tensors(hp.to_local(), local)
                sums, maxes = _reduce_over_shards(hp, sums, maxes)
            else:
                sums, maxes = cast_stats_tensors(hp, fp8)
                local = fp8
        entry = (sums, maxes, local.float8_layout.dtype)
        self._pending.setdefault(self.step, OrderedDict()).setdefault(site, []).append(entry)
        if self.callback is not None:
            self.callback(site, hp, fp8)

    # -- results ------------------------------------------------------------------------------

    @property
    def steps(self) -> List[int]:
        return list(self._pending)

    def stats(self, step: Optional[int] = None) -> Dict[CastSite, CastStats]:
        """The statistics of ``step`` (default: the last recorded one) by site, in model order and
        gemm order."""
        if not self._pending:
            return {}
        if step is None:
            step = self.steps[-1]
        if step not in self._pending:
            raise KeyError(f"no casts recorded at step {step}; recorded steps: {self.steps}")
        out = {}
        for site, entries in self._pending[step].items():
            merged = None
            for sums, maxes, dtype in entries:
                s = CastStats.from_tensors(sums, maxes, float8_dtype=dtype)
                merged = s if merged is None else merged + s
            out[site] = merged
        return dict(sorted(out.items(), key=lambda kv: self._site_key(kv[0])))

    def history(self) -> Dict[int, Dict[CastSite, CastStats]]:
        """``{step: {site: CastStats}}`` for every recorded step."""
        return {step: self.stats(step) for step in self.steps}

    def clear(self) -> None:
        self._pending.clear()

    def _site_key(self, site: CastSite):
        """Model order, then gemm and operand order; names outside them (casts with other
        sites) after the known ones, alphabetically."""
        def rank(name, known):
            return (known.index(name), "") if name in known else (len(known), name)

        return (self._order.get(site.fqn, len(self._order)), rank(site.gemm, tuple(Gemm)),
                rank(site.operand, tuple(Operand)))

    # -- reports (see f8dist/debug/report.py) ------------------------------------------------

    def table(self, step: Optional[int] = None) -> str:
        from f8dist.debug.report import format_table

        if step is None and self.steps:
            step = self.steps[-1]
        return format_table(self.stats(step), title=f"float8 casts, step {step}")

    def print_table(self, step: Optional[int] = None) -> None:
        """Print :meth:`table` on rank 0 only (every rank holds the same reduced figures)."""
        if is_rank0():
            print(self.table(step), flush=True)

    def plot(self, path: str) -> str:
        from f8dist.debug.report import plot_history

        return plot_history(self.history(), path)


def record(model: nn.Module, *, callback: Optional[Callback] = None) -> StatsRecorder:
    """Record float8 cast statistics of ``model`` while in the ``with`` block.

    Example::

        >>> with f8dist.debug.record(model) as rec:
        ...     model(x).sum().backward()
        >>> rec.print_table()
    """
    return StatsRecorder(model, callback=callback)
