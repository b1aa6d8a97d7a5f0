"""torchrun program: scripts/train.py several times in one launch, one run per ``--variant``
(flags appended to ``--train``); reports each run's steps and losses (see
tests/distributed/test_train.py)."""

from __future__ import annotations

import os
import shlex
import sys

from tests.distributed.common import init, main, write_result

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts")
sys.path.insert(0, os.path.abspath(SCRIPTS))
import train  # noqa: E402


def _args(parser):
    parser.add_argument("--train", default="", help="flags of every run, one string")
    parser.add_argument("--variant", action="append", default=[], help="NAME=FLAGS, one per run")


def run(args):
    init()
    result = {}
    for variant in args.variant:
        name, _, flags = variant.partition("=")
        result[name] = train.train(train.parse_args(shlex.split(args.train) + shlex.split(flags)))
    write_result(args, result)


if __name__ == "__main__":
    main(run, _args)
