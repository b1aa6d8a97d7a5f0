"""Configuration of float8 training: what users write (linear.py: Float8LinearConfig), the table
it fills (cells.py), the resolved table the code reads (specs.py) and named recipes (recipes.py).
``from f8dist.config import X`` works for each of their public names."""

from f8dist.config.cells import (
    E4M3, E5M2, E8M0, CastConfig, Gemm, Operand, SavedInput, ScaleRounding, ScalingGranularity,
    ScalingType, SPGradWeight,
)
from f8dist.config.linear import DelayedScalingConfig, Float8GemmConfig, Float8LinearConfig
from f8dist.config.recipes import Float8LinearRecipeName
from f8dist.config.specs import CastSite, CastSpec, CastSpecs, ScaledMMConfig

__all__ = [
    "ScalingType", "ScalingGranularity", "Gemm", "Operand", "CastConfig", "CastSpec", "CastSpecs",
    "CastSite", "DelayedScalingConfig", "Float8GemmConfig", "Float8LinearConfig",
    "Float8LinearRecipeName", "SavedInput", "ScaledMMConfig", "ScaleRounding", "SPGradWeight",
    "E4M3", "E5M2", "E8M0",
]
