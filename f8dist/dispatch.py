"""Deprecated alias of :mod:`f8dist.ep.dispatch` (expert parallelism's all-to-alls moved to
``f8dist.ep``; the style that runs them is :class:`f8dist.ep.Float8ExpertParallel`)."""

import warnings

from f8dist.ep.dispatch import all_to_all, expert_parallel

__all__ = ["expert_parallel", "all_to_all"]

warnings.warn("f8dist.dispatch is deprecated: import from f8dist.ep (Float8ExpertParallel, "
              "expert_parallel, all_to_all)", DeprecationWarning, stacklevel=2)
