"""Float8 tensor and sequence parallelism: PyTorch's parallel styles, communicating in float8,
and a ready plan for the LLaMA-style model."""

from f8dist.tp.plan import llama_tp_plan, parallelize_llama
from f8dist.tp.style import Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput

__all__ = [
    "Float8ColwiseParallel",
    "Float8RowwiseParallel",
    "PrepareFloat8ModuleInput",
    "llama_tp_plan",
    "parallelize_llama",
]
