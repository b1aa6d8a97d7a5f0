"""scripts/auto_filter_table.py: the table docs/auto_filter.md shows."""

import os
import sys

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "..", "scripts")
sys.path.insert(0, os.path.abspath(SCRIPTS))

import auto_filter_table  # noqa: E402


def test_table_rows_are_the_filter_decisions(capsys):
    rows = auto_filter_table.main(["--tokens", "8192"])
    printed = capsys.readouterr().out
    assert "| " + " | ".join(auto_filter_table.COLUMNS) + " |" in printed
    assert len(rows) == len(auto_filter_table.SHAPES)
    for row in rows:
        for recipe in auto_filter_table.RECIPES:
            if row[recipe] == "-":  # an FP4 recipe: H100 has no FP4 tensor cores
                assert recipe in auto_filter_table._FP4, row
                continue
            speedup, decision = row[recipe].split()
            assert decision == ("float8" if float(speedup) > 1.0 else "keep"), row
        assert all(row[f"torchao_{r}"] in ("float8", "keep", "-")
                   for r in auto_filter_table.TORCHAO_RECIPES)
    # the LLaMA 8B linears gain from every recipe, the debug model's from none
    by_name = {row["shape"]: row for row in rows}
    float8 = [r for r in auto_filter_table.RECIPES if r not in auto_filter_table._FP4]
    assert all(by_name["llama3 8B wo"][r].endswith("float8") for r in float8)
    assert all(by_name["llama3 debugmodel wqkv"][r].endswith("keep") for r in float8)


def test_b200_choice_is_the_fastest_recipe_above_one(capsys):
    auto_filter_table.main(["--tokens", "8192"])
    assert "| " + " | ".join(auto_filter_table.CHOICE_COLUMNS) + " |" in capsys.readouterr().out
    for row in auto_filter_table.choice_rows(8192):
        gains = {r: float(row[r]) for r in auto_filter_table.CHOICES}
        best = max(gains, key=gains.get)
        assert row["choice"] == (best if gains[best] > 1.0 else "bf16"), row
        # nvfp4 is no choice in its high-precision tail ([Note: a high-precision tail])
        assert row["choice in the tail"] == ("mxfp8" if gains["mxfp8"] > 1.0 else "bf16"), row
