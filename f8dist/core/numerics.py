"""Signal-to-quantization-noise ratio: the one yardstick for float8 numerics."""

from __future__ import annotations

import math

import torch

__all__ = ["sqnr", "sqnr_from_energies"]


def sqnr_from_energies(signal_sq: float, error_sq: float) -> float:
    """``10 log10(signal_sq / error_sq)`` in dB from summed squares (so partial sums from shards
    or casts can be added first); inf for an exact result, -inf for a zero signal."""
    if error_sq == 0:
        return math.inf
    if signal_sq == 0:
        return -math.inf
    return 10.0 * math.log10(signal_sq / error_sq)


def sqnr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """SQNR of ``actual`` against ``reference`` in dB, computed in float64; inf if equal."""
    ref = reference.detach().to(torch.float64)
    err = ref - actual.detach().to(torch.float64)
    return sqnr_from_energies(ref.square().sum().item(), err.square().sum().item())
