"""scripts/path_costs.py on a one-layer model: the casts each float8 wire path adds per step (one
per tensor it sends: deterministic), the bytes it keeps for backward and the scales among them,
counted by the same :class:`StepCosts` (a ``LiveBytes``) for the high-precision and the float8 wire."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import path_costs  # noqa: E402
from path_costs import Variant  # noqa: E402

from f8dist import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from f8dist.testing import measure_fwd_bwd  # noqa: E402

ARGS = ["--dim", "64", "--seq", "16", "--batch", "2"]


def _costs(layout, *variants, layers=1):
    args = path_costs.step_table.add_args(path_costs.argparse.ArgumentParser()).parse_args(
        ARGS + ["--layers", str(layers)])
    return [path_costs.measure(layout, v, args) for v in variants]


def test_cp_casts_k_and_v_per_layer_and_keeps_what_bf16_keeps():
    hp, fp8 = _costs("cp", Variant("tensorwise", ("hp-wire",)),
                     Variant("tensorwise", ("grad_spec",)))
    assert fp8["casts"] - hp["casts"] == 4  # K and V of the one layer in forward, dK, dV in backward
    assert fp8["dequants"] - hp["dequants"] == 4  # each gathered or received back
    # attention keeps the dequantized gathered K/V, as it keeps bf16's; no scale kept
    assert fp8["kept"] == hp["kept"] > 0 and fp8["scales"] == hp["scales"]


def test_pp_stage0_casts_each_micro_batch_activation_once():
    hp, fp8 = _costs("pp", Variant("tensorwise", ("hp-wire",)), Variant("tensorwise"), layers=2)
    assert fp8["casts"] - hp["casts"] == 2  # 2 micro-batches sent by stage 0
    assert fp8["dequants"] - hp["dequants"] == 2  # their gradients, received
    assert fp8["scales"] == hp["scales"]


def test_kept_bytes_are_measure_fwd_bwds():
    """StepCosts counts what measure_fwd_bwd counts: its kept bytes are measure_fwd_bwd's plus the
    output and its gradient seed (alive when backward starts; measure_fwd_bwd leaves them out)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 32))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    x = torch.randn(16, 32)
    costs = path_costs.StepCosts()
    with costs:
        out = model(x.requires_grad_(True).clone())  # the clone as measure_fwd_bwd's
        out.backward(torch.ones_like(out))
    expected = measure_fwd_bwd(model, x).kept_bytes + 2 * out.numel() * out.element_size()
    assert costs.kept == expected
    assert costs.casts > 0 and costs.scales > 0
