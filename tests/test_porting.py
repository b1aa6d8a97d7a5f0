"""The README's table of torchao.float8 names: every f8dist name it gives imports."""

import importlib
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _table_rows():
    text = README.read_text()
    section = text.split("### Porting from torchao.float8", 1)[1].split("\n### ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| `")]


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_every_f8dist_name_in_the_porting_table_exists():
    rows = _table_rows()
    assert len(rows) >= 18, rows
    names = []
    for row in rows:
        f8dist_cell = row.split("|")[2]
        for name in re.findall(r"`(f8dist[\w.]*)", f8dist_cell):
            names.append(name.rstrip("."))
    assert len(names) >= 25, names
    missing = []
    for name in names:
        try:
            _resolve(name)
        except (ModuleNotFoundError, AttributeError):
            missing.append(name)
    assert not missing, missing
