"""Which linears to convert: an FQN filter and an auto filter that keeps small linears in high
precision, both usable as ``convert_to_float8_training(..., module_filter_fn=...)``.

[Note: the auto filter's cost model]
Float8 speeds up a linear's three gemms and pays with memory-bound casts. The auto filter converts
a linear only where a roofline model of one fwd+bwd predicts float8 faster than bf16
(``t_bf16 / t_float8 > 1``), for K = in_features, N = out_features and M tokens per gemm (per rank
and micro-batch):

* each gemm takes ``max(2MKN / peak_flops, bytes / bandwidth)``, bytes being both operands (2 per
  element in bf16, 1 in float8) plus the bf16 output; float8 gemms use the float8 peak;
* the casts move ``CAST_BYTES[recipe]`` bytes per element of each operand, as compiled: a
  dynamic cast reads twice and writes 1 byte (5), a delayed or block cast one pass (3), each extra
  layout +1; an operand pays once per gemm it is cast for ([Note: what the matmul keeps for
  backward] in f8dist/nn/linear.py).

The model assumes the ideal float8 speedup, so a linear it keeps in high precision cannot gain
even then (``docs/auto_filter.md``, from ``scripts/auto_filter_table.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch.nn as nn

from f8dist.config import Float8LinearConfig, Float8LinearRecipeName, Gemm
from f8dist.core.gemm import GEMM_ALIGNMENT, shape_problems

__all__ = [
    "CAST_BYTES",
    "GpuSpec",
    "H100_SXM",
    "ModuleFilter",
    "auto_filter_for_recipe",
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

    def __post_init__(self):
        for field in ("bf16_flops", "fp8_flops", "memory_bandwidth"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"GpuSpec.{field} must be a positive number, got {value!r}")


# NVIDIA H100 Tensor Core GPU datasheet, SXM5 column (dense, i.e. without sparsity)
H100_SXM = GpuSpec(name="H100 SXM", bf16_flops=989.4e12, fp8_flops=1978.9e12,
                   memory_bandwidth=3.35e12)


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


def _gemm_time(m: int, k: int, n: int, operand_bytes: int, flops: float, gpu: GpuSpec) -> float:
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
    bf16 = sum(_gemm_time(*s, 2, gpu.bf16_flops, gpu) for s in shapes)
    float8 = sum(
        _gemm_time(*s, 1, gpu.fp8_flops, gpu) if fp8 else _gemm_time(*s, 2, gpu.bf16_flops, gpu)
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
        k, n = mod.in_features, mod.out_features
        if shape_problems(specs, k, n) or not by_fqn(mod, fqn):  # alignment, the recipe's blocks
            return False
        return predicted_speedup(recipe, k, n, tokens=tokens, gpu=gpu) > 1.0

    return accept
