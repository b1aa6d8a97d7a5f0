"""Optimizer states in few bits: block-scaled codes of one vector, held flat on a local shard.

A :class:`QuantizedState` stands for a float32 vector ``x`` (an optimizer moment of one
parameter's local shard, flattened) in blocks of ``block_size`` consecutive elements, the last
zero-padded: ``codes`` (1 byte per element for the 8-bit formats) and, for the block-scaled
formats, ``scales`` (one float32 per block). :func:`encode` makes one, :func:`decode` gives the
blocks back up to the format's rounding, :func:`encode_into` re-encodes in place (what an
optimizer step does).

[Note: state formats]
Each :class:`StateFormat` is one row of this table (``s``: the block's scale)::

    format     bytes  code of x                                 below the block's max
    fp32       4      x                                         all of float32
    bf16       2      x in bfloat16                             all of float32, 8 significant bits
    e4m3       1      x * s in float8 e4m3 (s a power of 2)     2**17.8, 4 significant bits
    e5m2       1      x * s in float8 e5m2 (s a power of 2)     2**31.8, 3 significant bits
    int8       1      round(x / s), s = amax / 127              127 linear steps
    sqrt_e4m3  1      sqrt(x) * s in e4m3; x >= 0               2**35.6, 4 bits of sqrt(x)
    log8       1      round(8 log2(x / amax)) + 255; x >= 0     2**31.8, steps of 2**(1/8) (9 %)
    log16      1      round(16 log2(x / amax)) + 255; x >= 0    2**15.9, steps of 2**(1/16) (4.4 %)

Encoding a decoded vector again gives it back, bit for bit, so a checkpoint that holds decoded
states (``f8dist.optim.AdamW.state_dict``) resumes exactly. The float8 formats take
``f8dist.scaling.amax_to_scale`` of the block's amax rounded down to a power of 2 (a decoded value
is also exact in bfloat16); int8's step ``s`` keeps 17 significant bits, so that ``127 * s`` is
exact and a decoded block's amax gives ``s`` again. The log formats keep the block's max as their
scale and code 0 for exactly 0; a positive value below their range takes the smallest code (it is
overestimated, never flushed to 0: for a second moment that makes the update smaller, where zero
would make it ``m / eps``). A block of zeros decodes to zeros in every format.

Which format suits which moment is measured by ``scripts/optim_states_report.py``
(docs/optim.md): the first moment (signed, an average of gradients) loses least in int8, whose
127 linear steps are finer than e4m3's near the block's max; the second moment (non-negative,
divides the update) needs range (e4m3 flushes small values to zero: updates of ``m / eps``) and,
with round to nearest, steps finer than its per-step decay, or its codes stop following a
decaying average (sqrt_e4m3 and e5m2 fall to single-digit SQNR): log16.

The codes are laid out on the local shard, so encoding and decoding never communicate, and they
are the same for a tensor and for a DTensor's local part. This module imports nothing from
torch.distributed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Tuple

import torch
import torch.nn.functional as F

from f8dist.scaling import amax_to_scale, dequantize, saturated_cast

__all__ = [
    "StateFormat", "QuantizedState", "blocks", "unblock", "encode", "encode_into", "decode",
    "check_block_size",
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class StateFormat(str, enum.Enum):
    """How an optimizer moment is stored ([Note: state formats])."""

    FP32 = "fp32"
    BF16 = "bf16"
    E4M3 = "e4m3"
    E5M2 = "e5m2"
    INT8 = "int8"
    SQRT_E4M3 = "sqrt_e4m3"
    LOG8 = "log8"
    LOG16 = "log16"

    def __str__(self) -> str:
        return self.value

    @property
    def blockwise(self) -> bool:
        """Whether the format keeps a scale per block."""
        return self not in (StateFormat.FP32, StateFormat.BF16)

    @property
    def signed(self) -> bool:
        """Whether the format holds negative values."""
        return self not in (StateFormat.SQRT_E4M3, StateFormat.LOG8, StateFormat.LOG16)

    @property
    def code_dtype(self) -> torch.dtype:
        return _CODE_DTYPE[self]


_CODE_DTYPE = {
    StateFormat.FP32: torch.float32,
    StateFormat.BF16: torch.bfloat16,
    StateFormat.E4M3: E4M3,
    StateFormat.E5M2: E5M2,
    StateFormat.INT8: torch.int8,
    StateFormat.SQRT_E4M3: E4M3,
    StateFormat.LOG8: torch.uint8,
    StateFormat.LOG16: torch.uint8,
}

_LOG_STEPS_PER_OCTAVE = {StateFormat.LOG8: 8, StateFormat.LOG16: 16}
_TOP_CODE = 255  # the block's max; 1 ... 254 below it; 0 is exactly 0


@dataclass
class QuantizedState:
    """One vector in a :class:`StateFormat`, in blocks: ``codes`` [blocks * block_size] (the
    vector zero-padded to whole blocks) and ``scales`` [blocks] (empty for fp32 and bf16).
    :func:`encode_into` rewrites both in place."""

    codes: torch.Tensor  # [blocks * block_size]
    scales: torch.Tensor  # [blocks] float32, or [0]
    format: StateFormat
    block_size: int


def check_block_size(block_size) -> int:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    return block_size


def blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x`` flattened to [blocks, block_size], the last block zero-padded (zeros raise no
    amax and stay zero through an AdamW step). See [Note: whole blocks]."""
    n = x.numel()
    count = -(-n // block_size)
    return F.pad(x.reshape(-1), (0, count * block_size - n)).view(count, block_size)


def unblock(xb: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` elements of blocks [blocks, block_size], flat: ``blocks``' inverse."""
    return xb.reshape(-1)[:numel]


# [Note: whole blocks]
# States are kept padded to whole blocks, and a step computes on [blocks, block_size] (the
# gradient and the weight padded alike), slicing back to the parameter's numel only where it
# writes the weight. Decoding into a padded view and slicing it back inside the same compiled
# kernel miscompiles with torch 2.13's inductor on the CPU: for a vector of 300 elements in blocks
# of 128, the generated loop covers 2 rows of 128, and the last 44 outputs are never written.
# tests/optim/test_adamw.py compiles a step on such a vector.


def _keep_17_bits(x: torch.Tensor) -> torch.Tensor:
    """Positive float32 ``x`` rounded to 17 significant bits (times a 7-bit integer: exact).
    To nearest, so that ``127 * s / 127`` gives ``s`` back however the division rounds."""
    return ((x.view(torch.int32) + 32) & -64).view(torch.float32)  # 6 low mantissa bits


def _encode_blocks(xb: torch.Tensor, fmt: StateFormat) -> Tuple[torch.Tensor, torch.Tensor]:
    """float32 blocks [blocks, B] -> codes [blocks, B] and scales [blocks, 1]."""
    if fmt in _LOG_STEPS_PER_OCTAVE:
        amax = xb.amax(dim=1, keepdim=True).clamp_(min=0)  # [blocks, 1]
        steps = torch.log2(xb / amax).mul_(_LOG_STEPS_PER_OCTAVE[fmt]).round_()  # <= 0; -inf at 0
        codes = steps.add_(_TOP_CODE).clamp_(1, _TOP_CODE)
        return torch.where(xb > 0, codes, torch.zeros_like(codes)).to(torch.uint8), amax
    if fmt is StateFormat.INT8:
        amax = xb.abs().amax(dim=1, keepdim=True)  # [blocks, 1]
        step = _keep_17_bits(torch.where(amax > 0, amax / 127, torch.ones_like(amax)))
        return torch.round(xb / step).clamp_(-127, 127).to(torch.int8), step
    if fmt is StateFormat.SQRT_E4M3:
        xb = xb.clamp(min=0).sqrt()
    dtype = fmt.code_dtype
    scale = amax_to_scale(xb.abs().amax(dim=1, keepdim=True), dtype, round_to_power_of_2=True)
    return saturated_cast(xb, scale, dtype), scale  # [blocks, B], [blocks, 1]


def _decode_blocks(codes: torch.Tensor, scale: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """codes [blocks, B] (as float32), scales [blocks, 1] -> float32 [blocks, B]."""
    if fmt is StateFormat.INT8:
        return codes * scale
    if fmt in _LOG_STEPS_PER_OCTAVE:
        x = scale * torch.exp2((codes - _TOP_CODE) / _LOG_STEPS_PER_OCTAVE[fmt])
        return torch.where(codes > 0, x, torch.zeros_like(x))
    x = dequantize(codes, scale, torch.float32)
    return x * x if fmt is StateFormat.SQRT_E4M3 else x


def encode(x: torch.Tensor, fmt, block_size: int) -> QuantizedState:
    """``x`` (any shape, any float dtype) flattened and encoded in ``fmt``."""
    fmt = StateFormat(fmt)
    xb = blocks(x.detach().to(torch.float32), block_size)  # [blocks, B]
    state = QuantizedState(
        torch.empty(xb.numel(), dtype=fmt.code_dtype, device=x.device),
        torch.empty(xb.shape[0] if fmt.blockwise else 0, dtype=torch.float32, device=x.device),
        fmt, block_size,
    )
    encode_into(state, xb)
    return state


def encode_into(state: QuantizedState, xb: torch.Tensor) -> None:
    """Re-encode ``state`` in place from float32 blocks ``xb`` [blocks, B]."""
    if not state.format.blockwise:
        state.codes.copy_(xb.reshape(-1))
        return
    codes, scales = _encode_blocks(xb, state.format)
    state.codes.copy_(codes.reshape(-1))
    state.scales.copy_(scales.reshape(-1))


def decode(state: QuantizedState) -> torch.Tensor:
    """The float32 blocks [blocks, B] that ``state`` stands for (a fresh tensor)."""
    codes = state.codes.view(-1, state.block_size).to(torch.float32, copy=True)  # [blocks, B]
    if not state.format.blockwise:
        return codes
    return _decode_blocks(codes, state.scales[:, None], state.format)
