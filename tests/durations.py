"""Where the suite's time goes: sums a ``pytest --durations=0`` report per test file and per kind.

    OMP_NUM_THREADS=1 python -m pytest -q tests --durations=0 -p no:cacheprovider > durations.txt
    python -m tests.durations durations.txt [--top 25]

Kinds, by what a file runs: ``torchrun`` (it launches processes: ``run_torchrun`` or ``launch``),
``sim`` (tests/sim/: simulated ranks), ``compile`` (it names compile: ``torch.compile``, or a
script that compiles), ``other``. A
launch shared by several modules counts in the file of the first test that asks for it. Figures
are wall seconds of that run: compare two runs only on the same machine, one after the other
(docs/tests.md, "What the suite costs").
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path
from typing import Dict

REPO_ROOT = Path(__file__).resolve().parents[1]
_LINE = re.compile(r"\s*([\d.]+)s (?:setup|call|teardown)\s+(\S+)")


def per_file(report: str) -> Dict[str, float]:
    """Seconds per test file (setup, call and teardown of its tests)."""
    seconds: Dict[str, float] = collections.Counter()
    for line in report.splitlines():
        m = _LINE.match(line)
        if m:
            seconds[m.group(2).split("::")[0]] += float(m.group(1))
    return seconds


def kind(path: str) -> str:
    if path.startswith("tests/sim/"):
        return "sim"
    source = (REPO_ROOT / path).read_text() if (REPO_ROOT / path).exists() else ""
    if "run_torchrun" in source or "launch(" in source:
        return "torchrun"
    return "compile" if "compile" in source else "other"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    seconds = per_file(Path(args.report).read_text())
    kinds: Dict[str, float] = collections.Counter()
    for path, s in seconds.items():
        kinds[kind(path)] += s
    print(f"total: {sum(seconds.values()):.1f} s in {len(seconds)} files")
    print(" ".join(f"{k} {s:.1f} s," for k, s in kinds.most_common()).rstrip(","))
    for path, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{s:7.1f} s  {kind(path):8s} {path}")


if __name__ == "__main__":
    main()
