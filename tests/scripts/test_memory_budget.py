"""scripts/memory_budget.py: the per-parameter and per-token figures docs/performance.md shows."""

import os
import sys

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "..", "scripts")
sys.path.insert(0, os.path.abspath(SCRIPTS))

import memory_budget  # noqa: E402


def test_bytes_per_parameter_of_each_optimizer():
    fp32, eight = (memory_budget.per_parameter("tensorwise", s) for s in ("fp32", "8bit"))
    assert fp32["params"] == eight["params"] and 4.0 < fp32["params"] < 4.1  # fp32 + rope buffer
    assert fp32["grads"] == eight["grads"] == 4.0
    assert 8.0 < fp32["optim"] < 8.01  # two fp32 moments and a step per tensor
    assert 2.125 < eight["optim"] <= 2.25  # the goal, padding of small tensors included
    assert eight["checkpoint"] == 8.0  # state_dict(): the two moments decoded to fp32


def test_float8_activations_cut_what_a_block_keeps_per_token():
    recipes = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # the rows checked: measured only
    rows = {(r, on): kept for r, on, kept in memory_budget.per_token(
        dim=32, tokens=16, recipes=recipes, modes=("off", "on", "on+rc"))}
    bf16 = rows["bf16", "off"]
    for recipe in recipes:
        # without the option, bf16's bytes and a float32 weight amax per linear at most
        assert rows[recipe, "on"]["plain"] < rows[recipe, "off"]["plain"] <= 1.01 * bf16["plain"]
        assert rows[recipe, "on+rc"]["plain"] < rows[recipe, "on"]["plain"]  # w2 keeps nothing
        assert rows[recipe, "on"]["full"] == bf16["full"]  # full AC keeps the block input only
