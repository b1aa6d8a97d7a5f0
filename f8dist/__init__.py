"""f8dist: distributed-first float8 training for PyTorch."""

__version__ = "0.1.0"  # the package's version (pyproject.toml reads it)

from f8dist import _moved

_moved.install()  # the module paths before the layout in layers still import (deprecated)

from f8dist.config import (
    CastConfig,
    DelayedScalingConfig,
    Float8GemmConfig,
    Float8LinearConfig,
    Float8LinearRecipeName,
    ScalingGranularity,
    ScalingType,
)
from f8dist.nn.convert import convert_to_float8_training
from f8dist import debug  # noqa: E402  (f8dist.debug.record)
from f8dist.policy.delayed import strip_delayed_scaling_state, sync_float8_amax_and_scale_history
from f8dist.policy.filters import auto_filter_for_recipe, auto_recipe_filters, fqn_filter
from f8dist.parallel.fsdp import precompute_float8_dynamic_scale_for_fsdp
from f8dist.nn.linear import Float8Linear
from f8dist.policy.sac import Float8SACConfig, float8_sac_context_fn
from f8dist.core.tensor import Float8Tensor

__all__ = [
    "CastConfig",
    "DelayedScalingConfig",
    "Float8GemmConfig",
    "Float8Linear",
    "Float8LinearConfig",
    "Float8LinearRecipeName",
    "Float8SACConfig",
    "Float8Tensor",
    "ScalingGranularity",
    "ScalingType",
    "auto_filter_for_recipe",
    "auto_recipe_filters",
    "convert_to_float8_training",
    "debug",
    "float8_sac_context_fn",
    "fqn_filter",
    "precompute_float8_dynamic_scale_for_fsdp",
    "strip_delayed_scaling_state",
    "sync_float8_amax_and_scale_history",
]
