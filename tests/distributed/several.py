"""torchrun program: several programs of tests/distributed/ in one launch, one after the other on
the same ranks and process group (each ``--case KEY=PROGRAM ARGS``); rank 0 writes
``{KEY: that program's result}``. See [Note: one launch, several programs] in harness.py."""

from __future__ import annotations

import json
import os
import runpy
import shlex
import sys

from tests.distributed import common
from tests.distributed.common import init, main, write_result


def _args(parser):
    parser.add_argument("--case", action="append", default=[], help="KEY=PROGRAM ARGS, one per program")


def run(args):
    rank, _, _ = init()
    results = {}
    common.NESTED = True  # the programs' main() runs them and leaves the group to ours
    try:
        for case in args.case:
            key, _, command = case.partition("=")
            program, *argv = shlex.split(command)
            path = f"{args.result}.{key}" if args.result else None
            sys.argv = [program, *argv, *(["--result", path] if path else [])]
            try:
                runpy.run_module(f"tests.distributed.{program}", run_name="__main__", alter_sys=False)
            except BaseException as e:
                raise RuntimeError(f"case {key!r} ({program} {' '.join(argv)}) failed") from e
            if rank == 0 and path and os.path.exists(path):  # rank 0 wrote it
                with open(path) as f:
                    results[key] = json.load(f)
            else:
                results[key] = None
    finally:
        common.NESTED = False
    write_result(args, results)


if __name__ == "__main__":
    main(run, _args)
