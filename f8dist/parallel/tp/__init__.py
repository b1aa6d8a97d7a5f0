"""Float8 tensor and sequence parallelism: PyTorch's parallel styles, communicating in float8.

A ready plan for the LLaMA-style model lives next to it: ``f8dist.models.parallelize_llama``.
"""

from f8dist.parallel.tp.style import Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput

__all__ = ["Float8ColwiseParallel", "Float8RowwiseParallel", "PrepareFloat8ModuleInput"]
