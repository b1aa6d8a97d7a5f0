"""scripts/train.py and scripts/compare_loss.py pieces that need no process group."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import compare_loss  # noqa: E402
import train  # noqa: E402


def test_lr_warms_up_then_decays_to_a_tenth():
    args = train.parse_args(["--steps", "100", "--warmup-steps", "10", "--lr", "1.0"])
    assert train.lr_at(5, args) == 0.5
    assert train.lr_at(10, args) == 1.0
    lrs = [train.lr_at(s, args) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert train.lr_at(100, args) == pytest.approx(0.1)


@pytest.mark.parametrize("argv, match", [
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--float8", "rowwise", "--float8-all-gather"], "tensorwise weight cast"),
    (["--float8", "fp8"], "invalid choice"),
    (["--grad-accum-steps", "0"], "--grad-accum-steps must be >= 1"),
])
def test_bad_flags_say_what_to_change(argv, match, capsys):
    with pytest.raises(SystemExit):
        train.parse_args(argv)
    assert match in capsys.readouterr().err


def test_float8_config_follows_the_flag():
    assert train.float8_config(train.parse_args(["--float8", "none"])) is None
    config = train.float8_config(train.parse_args(["--float8", "rowwise"]))
    assert config.round_scales_to_power_of_2  # the rowwise recipe, not the default table


def test_loss_table_compares_each_recipe_with_bf16():
    curves = {"none": [5.0, 2.0, 2.0], "tensorwise": [5.0, 2.2, 2.0]}
    table = compare_loss.loss_table(curves, tail=2, title="t")
    assert "| bf16 | 2.0000 |  |" in table
    assert "| tensorwise | 2.1000 | +5.00% |" in table
