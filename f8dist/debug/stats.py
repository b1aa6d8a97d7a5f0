"""Statistics of one float8 cast: pure functions of the tensors before and after quantization.

A cast ``hp -> (data, scale)`` is summarized by sums and extremes that add up across casts and
across the shards of a DTensor, so the statistics of a logical tensor are a reduction of the
per-shard ones (see ``f8dist/debug/recorder.py``):

* ``numel``, ``nonzero``: element counts;
* ``saturated``: elements the clamp changed (see [Note: saturation]);
* ``underflow``: nonzero elements of ``hp`` whose float8 value is 0;
* ``signal_sq``, ``error_sq``: ``sum(hp**2)`` and ``sum((hp - data / scale)**2)``, for the SQNR;
* ``amax``, ``scale_min``, ``scale_max``: extremes;
* block-scaled casts ([Note: block scales] in f8dist/config/cells.py) add, per block: ``blocks``,
  ``blocks_saturated`` and ``blocks_underflow`` (blocks with at least one saturated or underflowed
  element) and ``block_amax_log2``, a histogram of the blocks' amaxes by power of 2 (bin ``i``
  counts amaxes in [2**(i + BLOCK_HIST_LO), 2**(i + 1 + BLOCK_HIST_LO)), the ends open; all-zero
  blocks in none): how spread the magnitudes are that one tensor's scale could not cover;
* NVFP4 casts ([Note: NVFP4] in f8dist/config/cells.py) add ``e2m1_codes``, how many elements took
  each e2m1 magnitude (``E2M1_MAGNITUDES``, sign aside). Their blocks rarely saturate: a block's
  scale maps its amax to 6, and the e4m3 rounding of that scale leaves it below 6.375, which
  rounds to 6; what the two levels lose shows as blocks that flush elements to 0.

[Note: saturation]
A value counts as saturated when the clamp in ``saturated_cast`` changed its float8 value, i.e.
when ``|x * scale|`` lies beyond the interval that rounds to the format's max. Comparing with the
max itself would count rounding noise: a dynamic scale ``fp8_max / amax`` is rounded to float32,
so ``amax * scale`` lands one float32 ulp above ``fp8_max`` in about one cast in five, and that
element is then clamped by less than the float8 rounding it would get anyway. The interval ends
half a float8 ulp above the max: 464 for e4m3fn (a tie rounds to 448, the even neighbour) and
61440 for e5m2 (a tie rounds away, to inf).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Dict, Mapping, Optional, Tuple

import torch

from f8dist.core.numerics import sqnr_from_energies
from f8dist.core.scaling import E2M1, block_amax, dequantize, expand_blocks, fp8_max

__all__ = [
    "CastStats",
    "saturation_threshold",
    "saturated_mask",
    "underflow_mask",
    "cast_stats_tensors",
    "sqnr_db",
    "worst_per_layer",
    "BLOCK_HIST_LO",
    "BLOCK_HIST_BINS",
    "E2M1_MAGNITUDES",
]

# the block amax histogram's bins: powers of 2 from 2**-64 to 2**64
BLOCK_HIST_LO, BLOCK_HIST_BINS = -64, 128
# the e2m1 values' magnitudes, the bins of ``e2m1_codes``
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def saturation_threshold(float8_dtype: torch.dtype) -> Tuple[float, bool]:
    """``(threshold, inclusive)``: ``|x * scale|`` above (or at, if inclusive) ``threshold`` does
    not round to the format's max, so clamping it changes the value. See [Note: saturation]."""
    limit = fp8_max(float8_dtype)
    exponent = math.floor(math.log2(limit))
    eps = 0.5 if float8_dtype == E2M1 else torch.finfo(float8_dtype).eps  # finfo has no e2m1 eps
    ulp = 2.0**exponent * eps  # spacing just below the max
    mantissa_steps = round(limit / ulp)  # the max's significand, in ulps: odd means a tie rounds up
    return limit + ulp / 2, mantissa_steps % 2 == 1


def saturated_mask(hp: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """Elements of ``hp`` that ``saturated_cast(hp, scale, float8_dtype)`` clamps."""
    threshold, inclusive = saturation_threshold(float8_dtype)
    scaled = (hp.to(torch.float32) * scale).abs()  # the values saturated_cast clamps
    return scaled >= threshold if inclusive else scaled > threshold


def underflow_mask(hp: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """Nonzero elements of ``hp`` whose float8 ``data`` is (plus or minus) zero."""
    return (hp != 0) & (data.to(torch.float32) == 0)


def _block_sums(hp32: torch.Tensor, saturated: torch.Tensor, underflow: torch.Tensor,
                block: Tuple[int, int]) -> torch.Tensor:
    """[3 + BLOCK_HIST_BINS] float64: blocks, blocks with a saturated element, blocks with an
    underflowed one, then the histogram of the blocks' amaxes by power of 2."""
    f64 = torch.float64
    amax = block_amax(hp32, block).flatten()  # [blocks]
    nonzero = amax[amax > 0]
    bins = torch.clamp(torch.floor(torch.log2(nonzero)) - BLOCK_HIST_LO, 0, BLOCK_HIST_BINS - 1)
    hist = torch.bincount(bins.to(torch.int64), minlength=BLOCK_HIST_BINS).to(f64)
    counts = [torch.tensor(float(amax.numel()), dtype=f64, device=hp32.device)] + [
        (block_amax(mask.to(torch.float32), block) > 0).sum().to(f64)
        for mask in (saturated, underflow)]
    return torch.cat([torch.stack(counts), hist])


def cast_stats_tensors(
    hp: torch.Tensor, fp8: torch.Tensor, scale: Optional[torch.Tensor] = None,
    block: Optional[Tuple[int, int]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The statistics of the cast ``hp -> fp8`` (a Float8Tensor; or its float8 data with
    ``scale`` and, for block scales, ``block``, whose scales are one per block) as two float64
    vectors, without a host sync: ``sums`` (add across casts and shards) in the order of
    ``CastStats.SUM_FIELDS`` then the block fields, and ``maxes`` (max across them) in the order
    of ``CastStats.MAX_FIELDS`` (``scale_min`` negated)."""
    hp32 = hp.to(torch.float32)
    if scale is None:  # a Float8Tensor: its numbers, and its blocks where the block gemm has them
        data, per_element = fp8.float8_values()
        layout = fp8.float8_layout
        float8_dtype, block = layout.dtype, layout.block[-2:] if fp8.is_blockwise else None
    else:
        data, float8_dtype = fp8, fp8.dtype
        scale = scale.to(torch.float32)
        per_element = scale if block is None else expand_blocks(scale, block, hp.shape)
    error = hp32 - dequantize(data, per_element, torch.float32)
    f64 = torch.float64
    saturated = saturated_mask(hp, per_element, float8_dtype)
    underflow = underflow_mask(hp, data)
    blocks = (torch.zeros(3 + BLOCK_HIST_BINS, dtype=f64, device=hp.device) if block is None
              else _block_sums(hp32, saturated, underflow, block))
    codes = torch.zeros(len(E2M1_MAGNITUDES), dtype=f64, device=hp.device)  # [8]
    if float8_dtype == E2M1:
        magnitudes = torch.tensor(E2M1_MAGNITUDES, device=hp.device)
        index = torch.searchsorted(magnitudes, data.abs().reshape(-1))  # [numel]: exact values
        codes = torch.bincount(index, minlength=len(E2M1_MAGNITUDES)).to(f64)
    sums = torch.cat([torch.stack([
        torch.tensor(float(hp.numel()), dtype=f64, device=hp.device),
        (hp != 0).sum().to(f64),
        saturated.sum().to(f64),
        underflow.sum().to(f64),
        hp32.to(f64).square().sum(),
        error.to(f64).square().sum(),
    ]), blocks, codes])  # [6 + 3 + BLOCK_HIST_BINS + 8]
    # an empty cast (a rank's empty batch or shard) adds nothing to a max: amax 0, scales -inf (the
    # scale of amax 0, or no scale for per-row scales of no rows or an empty block grid, is no
    # scale a value was cast with; a site that only saw empty casts shows none)
    # [1], [rows] or [blocks] (each at least once); [0] if empty
    scale = (per_element if scale is None else scale).reshape(-1).to(f64)[: hp.numel()]
    none = torch.full((1,), -torch.inf, dtype=f64, device=hp.device)  # [1]
    maxes = torch.stack([
        torch.cat([hp32.reshape(-1).abs().to(f64), none.new_zeros(1)]).max(),
        torch.cat([scale, none]).max(),
        torch.cat([-scale, none]).max(),
    ])  # [3]
    return sums, maxes


# SQNR of a cast from its summed squares (summable across casts and shards)
sqnr_db = sqnr_from_energies


@dataclass(frozen=True, kw_only=True)
class CastStats:
    """Statistics of one or more casts of one site (merged with ``+``).

    Example::

        >>> from f8dist.core.cast import cast_to_float8
        >>> hp = torch.tensor([1.0, 1e-9, 0.0, 3.0])
        >>> fp8 = cast_to_float8(hp, torch.float8_e4m3fn)
        >>> s = CastStats.from_tensors(*cast_stats_tensors(hp, fp8),
        ...                            float8_dtype=torch.float8_e4m3fn)
        >>> s.underflow, s.saturated
        (1, 0)
    """

    float8_dtype: torch.dtype
    casts: int
    numel: int
    nonzero: int
    saturated: int
    underflow: int
    signal_sq: float
    error_sq: float
    amax: float
    scale_max: float
    scale_min: float
    # block-scaled casts only (0 and empty otherwise)
    blocks: int = 0
    blocks_saturated: int = 0
    blocks_underflow: int = 0
    block_amax_log2: Tuple[int, ...] = ()
    e2m1_codes: Tuple[int, ...] = ()  # NVFP4 casts only: elements per E2M1_MAGNITUDES entry

    SUM_FIELDS = ("numel", "nonzero", "saturated", "underflow", "signal_sq", "error_sq")
    MAX_FIELDS = ("amax", "scale_max", "scale_min")  # scale_min travels negated
    BLOCK_FIELDS = ("blocks", "blocks_saturated", "blocks_underflow")  # then the histogram
    _COUNTS = ("casts", "numel", "nonzero", "saturated", "underflow") + BLOCK_FIELDS

    @classmethod
    def from_tensors(
        cls, sums: torch.Tensor, maxes: torch.Tensor, *, float8_dtype: torch.dtype
    ) -> "CastStats":
        """One cast, from the vectors of :func:`cast_stats_tensors` (one host sync)."""
        values = dict(casts=1)
        sums = sums.tolist()
        values.update(zip(cls.SUM_FIELDS + cls.BLOCK_FIELDS, sums))
        hist = sums[len(cls.SUM_FIELDS) + len(cls.BLOCK_FIELDS):]
        hist, codes = hist[:BLOCK_HIST_BINS], hist[BLOCK_HIST_BINS:]
        values["block_amax_log2"] = tuple(int(round(h)) for h in hist) if values["blocks"] else ()
        values["e2m1_codes"] = tuple(int(round(c)) for c in codes) if float8_dtype == E2M1 else ()
        values.update(zip(cls.MAX_FIELDS, maxes.tolist()))
        values["scale_min"] = -values["scale_min"]
        for name in cls._COUNTS:
            values[name] = int(round(values[name]))
        return cls(float8_dtype=float8_dtype, **values)

    def __add__(self, other: "CastStats") -> "CastStats":
        if self.float8_dtype != other.float8_dtype:
            raise ValueError(
                f"cannot merge statistics of {self.float8_dtype} and {other.float8_dtype} casts"
            )
        values = {name: getattr(self, name) + getattr(other, name)
                  for name in ("casts",) + self.SUM_FIELDS + self.BLOCK_FIELDS}
        for name in ("block_amax_log2", "e2m1_codes"):  # histograms; () where none
            a, b = getattr(self, name), getattr(other, name)
            values[name] = tuple(x + y for x, y in zip(a, b)) if a and b else a or b
        values["amax"] = max(self.amax, other.amax)
        values["scale_max"] = max(self.scale_max, other.scale_max)
        values["scale_min"] = min(self.scale_min, other.scale_min)
        return CastStats(float8_dtype=self.float8_dtype, **values)

    @property
    def saturated_frac(self) -> float:
        """Fraction of all elements that the cast clamped."""
        return self.saturated / self.numel if self.numel else 0.0

    @property
    def underflow_frac(self) -> float:
        """Fraction of the nonzero elements that became 0 in float8."""
        return self.underflow / self.nonzero if self.nonzero else 0.0

    @property
    def sqnr_db(self) -> float:
        return sqnr_db(self.signal_sq, self.error_sq)

    @property
    def blocks_saturated_frac(self) -> float:
        """Fraction of the blocks with at least one clamped element (block-scaled casts)."""
        return self.blocks_saturated / self.blocks if self.blocks else 0.0

    @property
    def blocks_underflow_frac(self) -> float:
        """Fraction of the blocks with at least one nonzero element cast to 0."""
        return self.blocks_underflow / self.blocks if self.blocks else 0.0

    def block_amax_quantile(self, q: float) -> float:
        """The power of 2 at or below the ``q``-quantile of the nonzero block amaxes (from the
        histogram; 0.0 without blocks): e.g. q=0.01 and 0.99 bound the spread of magnitudes."""
        total = sum(self.block_amax_log2)
        if not total:
            return 0.0
        seen = 0
        for i, count in enumerate(self.block_amax_log2):
            seen += count
            if count and seen >= q * total:
                return 2.0 ** (i + BLOCK_HIST_LO)
        return 2.0 ** (len(self.block_amax_log2) - 1 + BLOCK_HIST_LO)

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["float8_dtype"] = str(self.float8_dtype).replace("torch.", "")
        out.update(
            saturated_frac=self.saturated_frac,
            underflow_frac=self.underflow_frac,
            sqnr_db=self.sqnr_db,
            blocks_saturated_frac=self.blocks_saturated_frac,
            blocks_underflow_frac=self.blocks_underflow_frac,
        )
        out["block_amax_log2"] = list(self.block_amax_log2)
        out["e2m1_codes"] = list(self.e2m1_codes)
        return out


def worst_per_layer(stats: Mapping) -> Dict[str, Tuple[float, float, float]]:
    """``{fqn: (worst SQNR dB, worst saturated fraction, worst underflow fraction)}`` over the
    casts of each module in ``stats`` (``{CastSite: CastStats}``): a layer is as bad as its worst
    cast."""
    worst: Dict[str, Tuple[float, float, float]] = {}
    for site, s in stats.items():
        q, sat, uf = worst.get(site.fqn, (math.inf, 0.0, 0.0))
        worst[site.fqn] = (min(q, s.sqnr_db), max(sat, s.saturated_frac), max(uf, s.underflow_frac))
    return worst
