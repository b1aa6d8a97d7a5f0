"""Float8 context parallelism: a parallel style whose hook all-gathers an attention module's K and
V in float8 over the cp mesh ([Note: float8 context parallelism] in f8dist/parallel/cp/style.py).
"""

from f8dist.parallel.cp.style import (
    KV_SPEC, Float8ContextParallel, causal_mask, gather_kv, grad_to_wire, quantize_kv,
    sum_from_wire,
)

__all__ = ["Float8ContextParallel", "KV_SPEC", "causal_mask", "gather_kv", "grad_to_wire",
           "quantize_kv", "sum_from_wire"]
