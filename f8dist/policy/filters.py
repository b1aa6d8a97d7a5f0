"""Which linears to convert: an FQN filter and an auto filter that keeps small linears in high
precision, both usable as ``convert_to_float8_training(..., module_filter_fn=...)``.

[Note: the auto filter's cost model]
Float8 speeds up a linear's three gemms and pays with memory-bound casts. The auto filter converts
a linear only where a roofline model of one fwd+bwd predicts float8 faster than bf16
(``t_bf16 / t_float8 > 1``), for K = in_features, N = out_features and M tokens per gemm (per rank
and micro-batch):

* each gemm takes ``max(2MKN / peak_flops, bytes / bandwidth)``, bytes being both operands (2 per
  element in bf16, 1 in float8, ``NVFP4_OPERAND_BYTES`` in NVFP4) plus the bf16 output; float8
  gemms use the float8 peak, NVFP4 gemms ``GpuSpec.fp4_flops`` (a GPU without it refuses them);
* the casts move ``CAST_BYTES[recipe]`` bytes per element of each operand, as compiled: a
  dynamic cast reads twice and writes 1 byte (5), a delayed or block cast one pass (3), each extra
  layout +1; an operand pays once per gemm it is cast for ([Note: what the matmul keeps for
  backward] in f8dist/nn/linear.py).

The model assumes the ideal float8 speedup, so a linear it keeps in high precision cannot gain
even then (``docs/auto_filter.md``, from ``scripts/auto_filter_table.py``). The per-layer choice
among recipes (``auto_recipe_filters``) is the same model: each linear takes the recipe of the
highest predicted speedup, bf16 when none is above 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch.nn as nn

from f8dist.config import Float8LinearConfig, Float8LinearRecipeName, Gemm
from f8dist.config.cells import E2M1
from f8dist.core.gemm import GEMM_ALIGNMENT, shape_problems

__all__ = [
    "B200",
    "CAST_BYTES",
    "GpuSpec",
    "H100_SXM",
    "ModuleFilter",
    "NVFP4_OPERAND_BYTES",
    "auto_filter_for_recipe",
    "auto_recipe_filters",
    "float8_gemms",
    "fqn_filter",
    "HIGH_PRECISION_TAIL",
    "high_precision_tail_filter",
    "predicted_speedup",
]

ModuleFilter = Callable[[nn.Module, str], bool]

# cast bytes per element of (input, grad_output, weight): [Note: the auto filter's cost model]
CAST_BYTES = {
    Float8LinearRecipeName.TENSORWISE: (6, 6, 10),
    Float8LinearRecipeName.ROWWISE: (10, 10, 10),
    Float8LinearRecipeName.ROWWISE_WITH_GW_HP: (5, 5, 10),
    Float8LinearRecipeName.DELAYED: (4, 4, 6),
    Float8LinearRecipeName.MXFP8: (6, 6, 6),
    Float8LinearRecipeName.MXFP8_WGRAD_WITH_HP: (3, 3, 6),
    Float8LinearRecipeName.MXFP8_SQUARE_WEIGHTS: (6, 6, 3),
    Float8LinearRecipeName.BLOCKWISE: (6, 6, 3),
    Float8LinearRecipeName.NVFP4: (6, 6, 3),
    Float8LinearRecipeName.NVFP4_NO_RHT: (6, 6, 3),
}


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """Peak rates of a GPU, the inputs of [Note: the auto filter's cost model]."""

    name: str
    bf16_flops: float  # dense bf16 tensor core FLOP/s
    fp8_flops: float  # dense float8 tensor core FLOP/s
    memory_bandwidth: float  # bytes/s
    fp4_flops: Optional[float] = None  # dense FP4 (NVFP4) tensor core FLOP/s; None: no FP4 cores

    def __post_init__(self):
        for field in ("bf16_flops", "fp8_flops", "memory_bandwidth"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"GpuSpec.{field} must be a positive number, got {value!r}")
        if self.fp4_flops is not None and not (
                isinstance(self.fp4_flops, (int, float)) and self.fp4_flops > 0):
            raise ValueError(
                f"GpuSpec.fp4_flops must be a positive number (dense FP4 tensor core FLOP/s) or "
                f"None for a GPU without FP4 tensor cores, got {self.fp4_flops!r}")


# NVIDIA H100 Tensor Core GPU datasheet, SXM5 column (dense, i.e. without sparsity); no FP4
H100_SXM = GpuSpec(name="H100 SXM", bf16_flops=989.4e12, fp8_flops=1978.9e12,
                   memory_bandwidth=3.35e12)
# NVIDIA B200 in HGX B200 (1000 W), dense (half the datasheet's "with sparsity" figures): FP4 9,
# FP8 4.5, BF16 2.25 PFLOP/s, HBM3e 8 TB/s. [Note: not read from NVIDIA's datasheet here, which
# this checkout lacks: taken from sources quoting it (glennklockwood.com/garden/processors/B200,
# stas00/ml-engineering's H200 vs B200 table); check them against the datasheet.]
B200 = GpuSpec(name="B200 (HGX)", bf16_flops=2.25e15, fp8_flops=4.5e15, fp4_flops=9e15,
               memory_bandwidth=8e12)

# bytes per element of an NVFP4 gemm operand: the e2m1 half byte and an e4m3 scale per 16
NVFP4_OPERAND_BYTES = 0.5 + 1 / 16


def _recipe(recipe: Union[str, Float8LinearRecipeName]) -> Float8LinearRecipeName:
    Float8LinearConfig.from_recipe_name(recipe)  # raises the error naming the known recipes
    return Float8LinearRecipeName(recipe)


# [Note: a high-precision tail]
# NVIDIA's NVFP4 pretraining recipe (arXiv 2509.25149) keeps a few linear layers in BF16, the
# last blocks among them, for stability; torchtitan's NVFP4 converter keeps the last
# ceil(0.15 * n_layers) decoder layers (and the output head) in bf16
# (``nvfp4_bf16_tail_fqns``). HIGH_PRECISION_TAIL is that share per recipe (none for float8).
HIGH_PRECISION_TAIL = {r.value: 0.15 for r in (  # recipe name -> share (nvfp4's variants alike)
    Float8LinearRecipeName.NVFP4, Float8LinearRecipeName.NVFP4_NO_RHT)}


def high_precision_tail_filter(recipe: Union[str, Float8LinearRecipeName], num_layers: int,
                               prefix: str = "layers") -> ModuleFilter:
    """A ``module_filter_fn`` that keeps the linears of the last ``ceil(num_layers * share)``
    blocks ``{prefix}.{i}`` in high precision, ``share`` the recipe's ``HIGH_PRECISION_TAIL``
    ([Note: a high-precision tail]), and accepts every other linear."""
    share = HIGH_PRECISION_TAIL.get(getattr(recipe, "value", recipe), 0.0)
    keep = math.ceil(num_layers * share)
    tail = tuple(f"{prefix}.{i}." for i in range(num_layers - keep, num_layers))
    return lambda mod, fqn: not (fqn + ".").startswith(tail) if tail else True


def float8_gemms(recipe: Union[str, Float8LinearRecipeName]) -> tuple:
    """Whether the recipe runs each gemm (output, grad_input, grad_weight) in float8."""
    config = Float8LinearConfig.from_recipe_name(recipe)
    return tuple(config.gemm_in_float8(g) for g in Gemm)


def _low_precision_gemm(recipe: Float8LinearRecipeName, gpu: GpuSpec) -> tuple:
    """(operand bytes per element, FLOP/s) of the recipe's low-precision gemms on ``gpu``."""
    config = Float8LinearConfig.from_recipe_name(recipe)
    if not any(config.resolved_dtype(g, g.operands[0]) == E2M1 for g in Gemm):
        return 1, gpu.fp8_flops
    if gpu.fp4_flops is None:
        # [Note: an error, not a prediction]: NVFP4 runs emulated there (bf16 gemms and the casts),
        # for its numerics; a filter answering "never faster" would silently convert nothing
        raise ValueError(
            f"recipe {recipe.value!r} runs FP4 gemms, but GpuSpec.fp4_flops is None for "
            f"{gpu.name!r} (no FP4 tensor cores), so the cost model has no rate to predict its "
            f"speed from; pass gpu=B200 (f8dist.policy.filters) or a GpuSpec with fp4_flops=its "
            f"dense FP4 FLOP/s, or choose the {recipe.value} linears without the auto filter "
            f"(module_filter_fn, high_precision_tail_filter)")
    return NVFP4_OPERAND_BYTES, gpu.fp4_flops


def _gemm_time(m: int, k: int, n: int, operand_bytes: float, flops: float, gpu: GpuSpec) -> float:
    """Roofline time of a [m, k] x [k, n] gemm with a bf16 output."""
    moved = operand_bytes * (m * k + k * n) + 2 * m * n
    return max(2 * m * k * n / flops, moved / gpu.memory_bandwidth)


def predicted_speedup(
    recipe: Union[str, Float8LinearRecipeName],
    in_features: int,
    out_features: int,
    *,
    tokens: int = 8192,
    gpu: GpuSpec = H100_SXM,
) -> float:
    """bf16 time / float8 time of one linear's fwd+bwd under [Note: the auto filter's cost model].

    Example::

        >>> round(predicted_speedup("tensorwise", 4096, 4096), 2)
        1.42
    """
    recipe = _recipe(recipe)
    if not (isinstance(tokens, int) and tokens > 0):
        raise ValueError(f"tokens must be a positive int (tokens per gemm), got {tokens!r}")
    m, k, n = tokens, in_features, out_features
    shapes = ((m, k, n), (m, n, k), (n, m, k))  # output, grad_input, grad_weight
    low_bytes, low_flops = _low_precision_gemm(recipe, gpu)
    bf16 = sum(_gemm_time(*s, 2, gpu.bf16_flops, gpu) for s in shapes)
    float8 = sum(
        _gemm_time(*s, low_bytes, low_flops, gpu) if fp8 else _gemm_time(*s, 2, gpu.bf16_flops, gpu)
        for s, fp8 in zip(shapes, float8_gemms(recipe))
    )
    b_in, b_go, b_w = CAST_BYTES[recipe]
    float8 += (b_in * m * k + b_go * m * n + b_w * n * k) / gpu.memory_bandwidth
    return bf16 / float8


def fqn_filter(filter_fqns: Sequence[str]) -> ModuleFilter:
    """A filter that keeps in high precision every module whose FQN contains one of
    ``filter_fqns`` (torchao's and torchtitan's ``filter_fqns`` rule).

    Example::

        >>> keep = fqn_filter(["output"])
        >>> keep(nn.Linear(16, 16), "layers.0.w1"), keep(nn.Linear(16, 16), "output")
        (True, False)
    """
    if isinstance(filter_fqns, str):
        raise TypeError(
            f"filter_fqns must be a sequence of strings, got the string {filter_fqns!r}"
        )
    fqns = tuple(filter_fqns)

    def accept(mod: nn.Module, fqn: str) -> bool:
        return not any(f in fqn for f in fqns)

    return accept


def auto_filter_for_recipe(
    recipe: Union[str, Float8LinearRecipeName],
    filter_fqns: Sequence[str] = (),
    *,
    tokens: int = 8192,
    gpu: GpuSpec = H100_SXM,
) -> ModuleFilter:
    """A ``module_filter_fn`` that converts a linear only if float8 is predicted to be faster for
    ``recipe`` ([Note: the auto filter's cost model]), its dims fit the gemm's alignment and the
    recipe's blocks, and its FQN contains none of ``filter_fqns``.

    It reads only ``in_features`` and ``out_features``, so it also takes torchtitan's
    ``Linear.Config``.

    Example::

        >>> model = nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 256), nn.Linear(256, 8192))
        >>> _ = convert_to_float8_training(
        ...     model, module_filter_fn=auto_filter_for_recipe("rowwise", filter_fqns=["2"]))
        >>> [type(m).__name__ for m in model]
        ['Float8Linear', 'Linear', 'Linear']
    """
    recipe = _recipe(recipe)
    predicted_speedup(recipe, GEMM_ALIGNMENT, GEMM_ALIGNMENT, tokens=tokens, gpu=gpu)  # validate
    by_fqn = fqn_filter(filter_fqns)
    specs = Float8LinearConfig.from_recipe_name(recipe).cast_specs()

    def accept(mod: nn.Module, fqn: str) -> bool:
        return by_fqn(mod, fqn) and _gain(recipe, specs, mod, tokens, gpu) > 1.0

    return accept


def _gain(recipe, specs, mod, tokens: int, gpu: GpuSpec) -> float:
    """The predicted speedup of converting ``mod`` to ``recipe``; 0 where its dims do not fit the
    gemm's alignment and the recipe's blocks."""
    k, n = mod.in_features, mod.out_features
    if shape_problems(specs, k, n):
        return 0.0
    return predicted_speedup(recipe, k, n, tokens=tokens, gpu=gpu)


def auto_recipe_filters(
    recipes: Sequence[Union[str, Float8LinearRecipeName]],
    filter_fqns: Sequence[str] = (),
    *,
    num_layers: Optional[int] = None,
    prefix: str = "layers",
    tokens: int = 8192,
    gpu: GpuSpec = H100_SXM,
) -> tuple:
    """One ``module_filter_fn`` per recipe of ``recipes``, mutually exclusive: each linear goes to
    the recipe of the highest ``predicted_speedup`` among those whose blocks its dims fit (the
    first one named on a tie), and to none, i.e. stays bf16, when no speedup is above 1 or its FQN
    contains one of ``filter_fqns``. A recipe with a high-precision tail (nvfp4) is not a choice
    in the last blocks ``{prefix}.{i}`` of ``num_layers`` ([Note: a high-precision tail]); the
    other recipes still are. Convert once per recipe with its filter (``docs/auto_filter.md``).
    """
    names = [_recipe(r) for r in recipes]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"auto_recipe_filters: recipes must name one or more distinct recipes, "
                         f"got {tuple(recipes)!r}; pass e.g. recipes=('nvfp4', 'mxfp8')")
    tails = {}
    for r in names:
        predicted_speedup(r, GEMM_ALIGNMENT, GEMM_ALIGNMENT, tokens=tokens, gpu=gpu)  # validate
        if HIGH_PRECISION_TAIL.get(r.value):
            if not (isinstance(num_layers, int) and num_layers > 0):
                raise ValueError(
                    f"auto_recipe_filters: num_layers={num_layers!r}, but {r.value!r} keeps its "
                    f"last blocks in high precision ([Note: a high-precision tail]); pass "
                    f"num_layers=the number of blocks (e.g. len(model.layers)), and prefix= their "
                    f"FQN prefix if it is not 'layers'")
            tails[r] = high_precision_tail_filter(r, num_layers, prefix)
    specs = {r: Float8LinearConfig.from_recipe_name(r).cast_specs() for r in names}
    by_fqn = fqn_filter(filter_fqns)

    def choice(mod: nn.Module, fqn: str) -> Optional[Float8LinearRecipeName]:
        best, best_gain = None, 1.0
        if by_fqn(mod, fqn):
            for r in names:
                if r in tails and not tails[r](mod, fqn):
                    continue
                gain = _gain(r, specs[r], mod, tokens, gpu)
                if gain > best_gain:
                    best, best_gain = r, gain
        return best

    return tuple((lambda mod, fqn, r=r: choice(mod, fqn) is r) for r in names)
