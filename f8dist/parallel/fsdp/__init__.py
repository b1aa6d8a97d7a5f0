"""FSDP2 with float8 on the wire: weights all-gathered in float8 ([Note: float8 all-gather]) and
gradients reduce-scattered in float8 ([Note: float8 reduce-scatter])."""

from f8dist.parallel.fsdp.precompute import precompute_float8_dynamic_scale_for_fsdp
from f8dist.parallel.fsdp.reduce_scatter import Float8ReduceScatterConfig, enable_float8_reduce_scatter
from f8dist.core.weight import Float8AllGatherWeight, wrap_weight_for_float8_all_gather

__all__ = [
    "Float8AllGatherWeight",
    "Float8ReduceScatterConfig",
    "enable_float8_reduce_scatter",
    "precompute_float8_dynamic_scale_for_fsdp",
    "wrap_weight_for_float8_all_gather",
]
