"""Signal-to-quantization-noise ratio: the one yardstick for float8 numerics."""

from __future__ import annotations

import torch

__all__ = ["sqnr"]


def sqnr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """``20 * log10(||ref|| / ||ref - actual||)`` in dB, computed in float64; inf if equal."""
    ref = reference.detach().to(torch.float64)
    err = ref - actual.detach().to(torch.float64)
    noise = torch.linalg.vector_norm(err)
    if noise == 0:
        return float("inf")
    return (20 * torch.log10(torch.linalg.vector_norm(ref) / noise)).item()
