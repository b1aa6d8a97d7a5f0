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
            speedup, decision = row[recipe].split()
            assert decision == ("float8" if float(speedup) > 1.0 else "keep"), row
        assert all(row[f"torchao_{r}"] in ("float8", "keep", "-")
                   for r in auto_filter_table.TORCHAO_RECIPES)
    # the LLaMA 8B linears gain from every recipe, the debug model's from none
    by_name = {row["shape"]: row for row in rows}
    assert all(by_name["llama3 8B wo"][r].endswith("float8") for r in auto_filter_table.RECIPES)
    assert all(by_name["llama3 debugmodel wqkv"][r].endswith("keep")
               for r in auto_filter_table.RECIPES)
