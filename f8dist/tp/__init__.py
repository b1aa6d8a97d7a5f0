"""Float8 tensor and sequence parallelism: PyTorch's parallel styles, communicating in float8."""

from f8dist.tp.style import Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput

__all__ = ["Float8ColwiseParallel", "Float8RowwiseParallel", "PrepareFloat8ModuleInput"]
