"""scripts/memory_report.py: its recipes are every recipe, and what nvfp4 keeps for backward."""

import os
import sys

import pytest
import torch

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "..", "scripts")
sys.path.insert(0, os.path.abspath(SCRIPTS))

import memory_report  # noqa: E402
from f8dist.config.recipe_names import Float8LinearRecipeName  # noqa: E402
from f8dist.models.llama import ModelArgs  # noqa: E402
from f8dist.testing import measure_fwd_bwd  # noqa: E402


def test_recipes_are_bf16_then_every_recipe():
    assert memory_report.RECIPES == ["bf16", *(r.value for r in Float8LinearRecipeName)]
    assert {"nvfp4", "nvfp4_no_rht"} <= set(memory_report.RECIPES)


# bytes an element of a kept cast, and its tensor scale: e4m3 + an e8m0 per 32; e2m1 (two an
# byte) + an e4m3 per 16, and one float32 tensor scale
PER_ELEMENT = {"mxfp8": (1 + 1 / 32, 0), "nvfp4": (1 / 2 + 1 / 16, 4),
               "nvfp4_no_rht": (1 / 2 + 1 / 16, 4)}


@pytest.mark.parametrize("recipe", sorted(PER_ELEMENT))
def test_float8_activations_keep_one_cast_of_each_linear_input(recipe):
    """Two linears in a row with f8 act on keep, for backward, one cast of each input (the
    grad_weight gemm's), nothing in bf16: nvfp4 its packed 4-bit data, its 1x16 e4m3 scales
    and its float32 tensor scale, against bf16's 2 bytes an element."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False),
                              torch.nn.Linear(64, 64, bias=False)).bfloat16()
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    configs = {(r, on): c for r, on, c in memory_report.configs(ModelArgs(dim=64), (recipe,))}
    bf16 = measure_fwd_bwd(memory_report.convert(net, configs["bf16", "off"]), x).kept_bytes
    kept = measure_fwd_bwd(memory_report.convert(net, configs[recipe, "on"]), x).kept_bytes
    per_element, tensor_scale = PER_ELEMENT[recipe]
    assert bf16 == 2 * x.numel() * 2
    assert kept == 2 * (x.numel() * per_element + tensor_scale)
