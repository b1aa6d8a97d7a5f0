"""The documents (README.md, docs/*.md) against the code: their python examples run, their tables
render, and the commands they give leave the checkout as it was.

The conventions (README.md, "Documents"):

* A fenced ```python block is a complete program: this test runs it (in this process, each in a
  fresh namespace, as ``__main__``). A block that needs what the test cannot give (torchrun, a
  GPU, torchtitan's Trainer) says so on its first line, ``# needs: <what>``; it is compiled only.
* A markdown table ends with a blank line (else the next paragraph's first line is read as a row).
* A command's output flag (``--csv``, ``--result``, ``--out-dir``, ...) names a path outside the
  checkout (``/tmp/...``, ``$OUT...``) or a placeholder (``OUTDIR``): the recorded runs under
  ``docs/bench/`` are tracked files that a copied command would overwrite.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# the scripts' docstrings give commands too
SOURCES = DOCS + sorted((ROOT / "scripts").glob("*.py")) + sorted((ROOT / "scripts").glob("*.sh"))
NEEDS = "# needs:"


def python_blocks(path: Path) -> List[Tuple[int, str]]:
    """(line of the opening fence, code) of every ```python block of a markdown file."""
    blocks, code, start = [], None, 0
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if code is None and line.strip() == "```python":
            code, start = [], i
        elif code is not None and line.strip() == "```":
            blocks.append((start, "\n".join(code) + "\n"))
            code = None
        elif code is not None:
            code.append(line)
    return blocks


BLOCKS = [(p, line, code) for p in DOCS for line, code in python_blocks(p)]


@pytest.mark.parametrize("path,line,code", BLOCKS,
                         ids=[f"{p.relative_to(ROOT)}:{line}" for p, line, _ in BLOCKS])
def test_python_block_runs(path, line, code):
    where = f"{path.relative_to(ROOT)}:{line}"
    compiled = compile(code, where, "exec")  # every block, marked or not, is valid python
    first = code.splitlines()[0] if code.strip() else ""
    if first.startswith(NEEDS):
        assert first[len(NEEDS):].strip(), f"{where}: say what the block needs after {NEEDS!r}"
        return
    exec(compiled, {"__name__": "__main__"})


def table_ends(text: str) -> List[int]:
    """Lines (1-based) where a table runs into text: a row with text after its last ``|``, or a
    line that follows a row without a blank line between."""
    lines = text.splitlines() + [""]
    fenced, bad = False, []
    for i, line in enumerate(lines[:-1], 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not line.lstrip().startswith("|"):
            continue
        nxt = lines[i]
        if not line.rstrip().endswith("|"):
            bad.append(i)
        elif nxt.strip() and not nxt.lstrip().startswith("|"):
            bad.append(i + 1)
    return bad


def test_table_ends_check_finds_a_missing_blank_line():
    assert table_ends("| a |\n|---|\n| 1 |\ntext\n") == [4]
    assert table_ends("| a |\n|---|\n| 1 | text\nmore text\n") == [3]
    assert table_ends("| a |\n|---|\n| 1 |\n\ntext\n") == []
    assert table_ends("```\n| not a table |\ncode\n```\n") == []


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_tables_end_with_a_blank_line(path):
    bad = table_ends(path.read_text())
    assert not bad, (f"{path.relative_to(ROOT)}: a table row runs into the next line at lines "
                     f"{bad}; put a blank line after the table")


OUTPUT_FLAG = re.compile(r"--(csv|result|out|out-dir|output|json)[ \t]*\\?\s+([^\s`'\")\]]+)")


def writes_into_checkout(text: str) -> List[str]:
    """The output paths of commands in ``text`` that are neither absolute, nor a variable, nor a
    placeholder in capitals (OUTDIR, OUT.csv)."""
    bad = []
    for m in OUTPUT_FLAG.finditer(text):
        path = m.group(2)
        if path.startswith(("/", "$", "~")) or re.fullmatch(r"[A-Z_]+(\.[a-z]+)?", path):
            continue
        bad.append(m.group(0))
    return bad


def test_writes_into_checkout_check():
    assert writes_into_checkout("x.py --csv docs/bench/a.csv") == ["--csv docs/bench/a.csv"]
    assert writes_into_checkout("x.py --result out.json`") == ["--result out.json"]
    assert writes_into_checkout("x.py --csv\ndocs/a.csv") == ["--csv\ndocs/a.csv"]
    assert writes_into_checkout("--csv /tmp/a.csv --out-dir $OUT/x --csv OUT.csv DIR") == []


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_commands_write_outside_the_checkout(path):
    bad = writes_into_checkout(path.read_text())
    assert not bad, (f"{path.relative_to(ROOT)}: commands write into the checkout: {bad}; write "
                     "to /tmp (or a path the user names) and name the tracked file of the "
                     "recorded run next to the command")
