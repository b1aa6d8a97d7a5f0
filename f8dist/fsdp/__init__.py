"""FSDP2 float8 all-gather: weights travel as 1 byte per element ([Note: float8 all-gather])."""

from f8dist.fsdp.precompute import precompute_float8_dynamic_scale_for_fsdp
from f8dist.fsdp.weight import Float8AllGatherWeight, wrap_weight_for_float8_all_gather

__all__ = [
    "Float8AllGatherWeight",
    "precompute_float8_dynamic_scale_for_fsdp",
    "wrap_weight_for_float8_all_gather",
]
