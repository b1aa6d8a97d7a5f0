"""Optimizer states in few bits: block-scaled codes of one vector, held flat on a local shard.

A :class:`QuantizedState` stands for one flattened moment of a local shard, in blocks of
``block_size`` elements: encoding and decoding never communicate.

[Note: state formats]
Each :class:`StateFormat` is one row of this table (``s``: the block's scale)::

    format     bytes  code of x                                 below the block's max
    fp32       4      x                                         all of float32
    bf16       2      x in bfloat16 (saturated)                 all of float32, 8 significant bits
    e4m3       1      x * s in float8 e4m3 (s a power of 2)     2**17.8, 4 significant bits
    e5m2       1      x * s in float8 e5m2 (s a power of 2)     2**31.8, 3 significant bits
    int8       1      round(x / s), s = amax / 126              126 linear steps
    sqrt_e4m3  1      sqrt(x) * s in e4m3; x >= 0               2**35.6, 4 bits of sqrt(x)
    log8       1      round(8 log2(x / max')) + 252; x >= 0     2**31.4, steps of 2**(1/8) (9 %)
    log16      1      round(16 log2(x / max')) + 252; x >= 0    2**15.7, steps of 2**(1/16) (4.4 %)

Encoding a decoded vector gives it back bit for bit (power-of-2 float8 scales; int8's ``s``
keeps 17 bits so ``126 * s`` is exact), so checkpoints of decoded states resume exactly. The log
formats keep the block's largest value apart, exactly, and code the rest against ``max'``, the
largest of the rest ([Note: outliers in the second moment]). A positive value below the range
takes the smallest code, never 0 (a zero second moment would make the update ``m / eps``).
The defaults (int8, log16) come from ``scripts/optim_states_report.py`` (docs/optim.md): the
second moment needs range and steps finer than its per-step decay.

[Note: non-finite states]
Inf and NaN are kept in every format (``_NON_FINITE_CODES``; -inf is 0 in the unsigned ones) and
the block's scale comes from its finite values, so a step follows torch.optim.AdamW element by
element. A finite value stays finite (bf16 saturates; decoding clamps to float32's max).

[Note: outliers in the second moment]
One huge gradient ``G`` makes an element's second moment ``(1 - beta2) G**2``, decaying by
``beta2`` a step; coded against it, the block's other second moments fall below the range and
their updates stay near 0 until it has decayed. The log formats keep the block's largest value
apart, so one such element per block costs its neighbours nothing. The first moment keeps no
outlier: in int8 the neighbours' ``m`` round to 0 until the outlier's has decayed to within 126
steps of theirs. docs/optim.md has the figures (``scripts/optim_outlier_report.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Tuple

import torch
import torch.nn.functional as F

from f8dist.core.scaling import amax_to_scale, dequantize, saturated_cast

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
    def scales_per_block(self) -> int:
        """float32 scales per block: the log formats also keep their outlier."""
        return 2 if self in _LOG_STEPS_PER_OCTAVE else int(self.blockwise)

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
# log codes: 0 is exactly 0, 1 ... 252 steps up to the largest value but the outlier (252), 253
# the block's outlier ([Note: outliers in the second moment]), 254 and 255 non-finite
_TOP_CODE, _OUTLIER_CODE = 252, 253
_INT8_MAX = 126  # 127, -127 and -128 are non-finite

_INF, _NAN = float("inf"), float("nan")
# the codes (as uint8 bit patterns) that stand for inf and NaN: [Note: non-finite states]
_NON_FINITE_CODES = {
    StateFormat.E4M3: {0x7F: _INF, 0xFF: -_INF, 0x80: _NAN},  # 0x80: -0, made +0 when encoding
    StateFormat.E5M2: {0x7C: _INF, 0xFC: -_INF, 0x7F: _NAN},  # e5m2's own
    StateFormat.INT8: {0x7F: _INF, 0x81: -_INF, 0x80: _NAN},  # 127, -127, -128
    StateFormat.SQRT_E4M3: {0x7F: _INF, 0x80: _NAN},
    StateFormat.LOG8: {254: _INF, 255: _NAN},
    StateFormat.LOG16: {254: _INF, 255: _NAN},
}
_BF16_MAX, _F32_MAX = torch.finfo(torch.bfloat16).max, torch.finfo(torch.float32).max


@dataclass
class QuantizedState:
    """One vector in a :class:`StateFormat`, zero-padded to whole blocks; ``scales`` holds k
    float32 per block (``StateFormat.scales_per_block``)."""

    codes: torch.Tensor  # [blocks * block_size]
    scales: torch.Tensor  # [blocks * k] float32, or [0]
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
# A step computes on [blocks, block_size] (gradient and weight padded alike), slicing back to the
# parameter's numel only where it writes the weight: decoding into a padded view and slicing it in
# the same compiled kernel miscompiles with torch 2.13's CPU inductor (the last partial block's
# outputs are never written; tests/optim/test_adamw.py compiles a step on such a vector).


def _keep_17_bits(x: torch.Tensor) -> torch.Tensor:
    """Positive float32 ``x`` rounded to 17 significant bits (times 126 = 2 * 63: exact).
    To nearest, so that ``126 * s / 126`` gives ``s`` back however the division rounds."""
    return ((x.view(torch.int32) + 32) & -64).view(torch.float32)  # 6 low mantissa bits


def _encode_finite(xb: torch.Tensor, fmt: StateFormat) -> Tuple[torch.Tensor, torch.Tensor]:
    """Finite float32 blocks [blocks, B] -> codes [blocks, B] and scales [blocks, k]."""
    if fmt in _LOG_STEPS_PER_OCTAVE:
        xb = xb.clamp(min=0)
        top = xb.argmax(dim=1, keepdim=True)  # [blocks, 1]: the outlier, kept apart
        outlier = xb.gather(1, top)  # [blocks, 1]
        is_outlier = torch.zeros_like(xb, dtype=torch.bool).scatter_(1, top, True)
        rest = torch.where(is_outlier, 0.0, xb).amax(dim=1, keepdim=True)  # [blocks, 1]
        steps = torch.log2(xb / rest).mul_(_LOG_STEPS_PER_OCTAVE[fmt]).round_()  # <= 0
        codes = steps.add_(_TOP_CODE).clamp_(1, _TOP_CODE)
        codes = torch.where(xb > 0, codes, 0.0)
        codes = torch.where(is_outlier, float(_OUTLIER_CODE), codes)
        return codes.to(torch.uint8), torch.cat([rest, outlier], dim=1)
    if fmt is StateFormat.INT8:
        amax = xb.abs().amax(dim=1, keepdim=True)  # [blocks, 1]
        step = _keep_17_bits(torch.where(amax > 0, amax / _INT8_MAX, torch.ones_like(amax)))
        return torch.round(xb / step).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8), step
    if fmt is StateFormat.SQRT_E4M3:
        xb = xb.clamp(min=0).sqrt()
    dtype = fmt.code_dtype
    scale = amax_to_scale(xb.abs().amax(dim=1, keepdim=True), dtype, round_to_power_of_2=True)
    codes = saturated_cast(xb, scale, dtype).view(torch.uint8)  # [blocks, B]
    codes = torch.where(codes == 0x80, 0, codes)  # -0 is +0: e4m3 holds NaN there
    return codes.view(dtype), scale


def _encode_blocks(xb: torch.Tensor, fmt: StateFormat) -> Tuple[torch.Tensor, torch.Tensor]:
    """float32 blocks [blocks, B] -> codes [blocks, B] and scales [blocks, k]; the scales come
    from the finite values ([Note: non-finite states])."""
    finite = xb.isfinite()
    codes, scales = _encode_finite(torch.where(finite, xb, 0.0), fmt)
    raw = codes.view(torch.uint8)
    for code, value in _NON_FINITE_CODES[fmt].items():
        raw = torch.where(xb.isnan() if value != value else xb == value, code, raw)
    return raw.view(fmt.code_dtype), scales


def _decode_blocks(codes: torch.Tensor, scale: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """codes [blocks, B], scales [blocks, k] -> float32 [blocks, B]."""
    c = codes.to(torch.float32)
    if fmt is StateFormat.INT8:
        x = c * scale
    elif fmt in _LOG_STEPS_PER_OCTAVE:
        rest, outlier = scale[:, :1], scale[:, 1:]
        x = rest * torch.exp2((c - _TOP_CODE) / _LOG_STEPS_PER_OCTAVE[fmt])
        x = torch.where(c > 0, x, 0.0)
        x = torch.where(c == _OUTLIER_CODE, outlier, x)
    else:
        x = dequantize(c, scale, torch.float32)
        x = x * x if fmt is StateFormat.SQRT_E4M3 else x
    x = x.clamp(-_F32_MAX, _F32_MAX)  # rounded up past the max: [Note: non-finite states]
    raw = codes.view(torch.uint8)
    for code, value in _NON_FINITE_CODES[fmt].items():
        x = torch.where(raw == code, value, x)
    return x


def encode(x: torch.Tensor, fmt, block_size: int) -> QuantizedState:
    """``x`` (any shape, any float dtype) flattened and encoded in ``fmt``."""
    fmt = StateFormat(fmt)
    xb = blocks(x.detach().to(torch.float32), block_size)  # [blocks, B]
    state = QuantizedState(
        torch.empty(xb.numel(), dtype=fmt.code_dtype, device=x.device),
        torch.empty(xb.shape[0] * fmt.scales_per_block, dtype=torch.float32, device=x.device),
        fmt, block_size,
    )
    encode_into(state, xb)
    return state


def encode_into(state: QuantizedState, xb: torch.Tensor) -> None:
    """Re-encode ``state`` in place from float32 blocks ``xb`` [blocks, B]."""
    if state.format is StateFormat.BF16:  # saturated: [Note: non-finite states]
        xb = torch.where(xb.isfinite(), xb.clamp(-_BF16_MAX, _BF16_MAX), xb)
    if not state.format.blockwise:
        state.codes.copy_(xb.reshape(-1))
        return
    codes, scales = _encode_blocks(xb, state.format)
    state.codes.copy_(codes.reshape(-1))
    state.scales.copy_(scales.reshape(-1))


def decode(state: QuantizedState) -> torch.Tensor:
    """The float32 blocks [blocks, B] that ``state`` stands for (a fresh tensor)."""
    codes = state.codes.view(-1, state.block_size)  # [blocks, B]
    if not state.format.blockwise:
        return codes.to(torch.float32, copy=True)
    k = state.format.scales_per_block
    return _decode_blocks(codes, state.scales.view(-1, k), state.format)
