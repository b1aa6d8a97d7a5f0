"""Float8 expert parallelism: a parallel style whose hooks dispatch an experts module's tokens
to their experts' ranks (in float8 where the experts cast per token) and combine them back.

A ready plan for the MoE model lives next to it: ``f8dist.models.moe_parallel.parallelize_moe``.
"""

from f8dist.ep.dispatch import all_to_all, expert_parallel
from f8dist.ep.style import Float8ExpertParallel

__all__ = ["Float8ExpertParallel", "expert_parallel", "all_to_all"]
