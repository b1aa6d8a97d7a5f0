"""scripts/wire_bytes.py: the SP all-gather row's bytes, exact (docs/performance.md shows them)."""

import os
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "..", "scripts")
sys.path.insert(0, os.path.abspath(SCRIPTS))

import wire_bytes  # noqa: E402

# bytes an element on the wire: bf16; e4m3 and one e8m0 scale per 32; e2m1 and one e4m3 per 16
PER_ELEMENT = {None: 2, "mxfp8": 1 + 1 / 32, "nvfp4": 1 / 2 + 1 / 16,
               "nvfp4+derive": 1 / 2 + 1 / 16}


@pytest.mark.parametrize("recipe", wire_bytes.SP_RECIPES)
def test_sp_all_gathers_move_each_cast_of_the_activation_and_gradient(recipe):
    """bf16 gathers the [2, 64, 64] activation (forward) and output gradient (backward) once; a
    float8 recipe gathers its two casts of each (one per gemm), each with its block scales; with
    sp_grad_weight="derive" one (grad_weight derives its operands from it)."""
    numel = 2 * 64 * wire_bytes.DIM
    casts = 1 if recipe is None or recipe.endswith("+derive") else 2
    assert wire_bytes.SP_SHAPE == (2, 64, wire_bytes.DIM)
    expected = casts * numel * PER_ELEMENT[recipe] * wire_bytes.WORLD / 2  # gathered on 2 ranks
    rows = wire_bytes.sp_all_gather(recipe)
    assert rows == {"SP all-gather, forward (bytes, rank 0)": expected,
                    "SP all-gather, backward (bytes, rank 0)": expected}
