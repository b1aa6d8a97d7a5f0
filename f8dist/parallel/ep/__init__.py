"""Float8 expert parallelism: a parallel style whose hooks dispatch an experts module's tokens
to their experts' ranks and combine them back (a ready plan: ``f8dist.models.moe_parallel``).
"""

from f8dist.parallel.ep.dispatch import all_to_all, expert_parallel
from f8dist.parallel.ep.style import Float8ExpertParallel

__all__ = ["Float8ExpertParallel", "expert_parallel", "all_to_all"]
