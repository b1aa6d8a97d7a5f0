"""Prose and code lines of a package: how much of it is explanation.

    python scripts/prose_lines.py [f8dist]

A non-blank line is prose when it belongs to a docstring (a string statement: a module's,
class's or function's docstring, or a bare string) or holds only a comment; every other non-blank
line is code (a line of code with a trailing comment counts as code). Prints one row per file and
the totals.
"""

from __future__ import annotations

import argparse
import ast
import io
import tokenize
from pathlib import Path
from typing import Tuple


def prose_and_code(source: str) -> Tuple[int, int]:
    """(prose lines, code lines) of one Python source."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            docstrings.update(range(node.lineno, node.end_lineno + 1))
    comments, tokens = set(), set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments.add(tok.start[0])
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER):
            tokens.update(range(tok.start[0], tok.end[0] + 1))
    nonblank = {i for i, line in enumerate(source.splitlines(), 1) if line.strip()}
    prose = (docstrings | (comments - tokens)) & nonblank
    return len(prose), len(nonblank - prose)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", default="f8dist")
    args = parser.parse_args()
    total_prose = total_code = 0
    for path in sorted(Path(args.package).rglob("*.py")):
        prose, code = prose_and_code(path.read_text())
        total_prose += prose
        total_code += code
        print(f"{prose:6d} {code:6d}  {path}")
    share = total_prose / max(total_prose + total_code, 1)
    print(f"{total_prose:6d} {total_code:6d}  total (prose, code; prose {share:.1%} of non-blank lines)")


if __name__ == "__main__":
    main()
