"""A per-step hook for training scripts: record float8 cast statistics every N steps."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Callable, List, Optional

import torch.nn as nn

from f8dist.debug.recorder import StatsRecorder, is_rank0
from f8dist.policy.delayed import delayed_scaling_counters

__all__ = ["Float8StatsLogger"]


class Float8StatsLogger:
    """Records the casts of every ``every``-th step, prints their table on rank 0 and, with
    ``out_dir``, appends them to ``out_dir/float8_stats.jsonl``; ``close()`` writes the last table
    (``float8_stats.txt``) and, with matplotlib, the plot (``float8_stats.png``). Delayed layers
    add their ``delayed_scaling_counters``. Wrap each step in ``logger.step(i)``; unrecorded steps
    cost nothing.

    Example::

        >>> stats = Float8StatsLogger(model, every=10, out_dir="out")
        >>> for i in range(steps):
        ...     with stats.step(i):
        ...         loss_fn(model(x), y).backward()
        ...     optimizer.step()
        >>> stats.close()
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        every: int,
        out_dir: Optional[str] = None,
        print_fn: Optional[Callable[[str], None]] = print,
    ):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"Float8StatsLogger(every=...) must be a positive int, got {every!r}")
        self.recorder = StatsRecorder(model)
        self.model = model
        self.every = every
        self.out_dir = out_dir
        self.print_fn = print_fn
        if out_dir is not None and is_rank0():
            os.makedirs(out_dir, exist_ok=True)
            open(self._path("jsonl"), "w").close()

    def _path(self, ext: str) -> str:
        return os.path.join(self.out_dir, f"float8_stats.{ext}")

    @contextlib.contextmanager
    def step(self, step: int):
        """Record the casts inside the block if ``step % every == 0``."""
        if step % self.every != 0:
            yield
            return
        self.recorder.set_step(step)
        with self.recorder:
            yield
        self._emit(step)

    def _emit(self, step: int) -> None:
        if not is_rank0():
            return
        stats = self.recorder.stats(step)
        delayed = delayed_scaling_counters(self.model)  # {fqn: {operand: {counter: steps}}}
        if self.print_fn is not None:
            self.print_fn(self.recorder.table(step))
            events = [f"{fqn or '<root>'}:{op} {name}={n}" for fqn, ops in delayed.items()
                      for op, counts in ops.items() for name, n in counts.items() if n]
            if events:
                self.print_fn("delayed scaling, steps so far: " + ", ".join(events))
        if self.out_dir is not None:
            with open(self._path("jsonl"), "a") as f:
                for site, s in stats.items():
                    line = dict(step=step, fqn=site.fqn, gemm=site.gemm, operand=site.operand)
                    line.update(s.as_dict())
                    counts = delayed.get(site.fqn, {}).get(str(site.operand), {})
                    line.update({f"delayed_{name}": n for name, n in counts.items()})
                    f.write(json.dumps(line) + "\n")

    def close(self) -> List[str]:
        """Write the last table and the plot (rank 0, with ``out_dir``); returns the stats files."""
        if self.out_dir is None or not is_rank0() or not self.recorder.steps:
            return []
        with open(self._path("txt"), "w") as f:
            f.write(self.recorder.table() + "\n")
        written = [self._path("txt"), self._path("jsonl")]
        try:
            self.recorder.plot(self._path("png"))
            written.append(self._path("png"))
        except ImportError as e:
            if self.print_fn is not None:
                self.print_fn(f"f8dist: no float8 stats plot: {e}")
        return written
