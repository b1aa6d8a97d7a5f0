"""torchrun program: scripts/train.py several times in one launch, one run per ``--variant``
(flags appended to ``--train``, later flags winning); reports each run's steps and losses, what it
printed on rank 0, and every warning torch raised or logged in it (see
tests/distributed/test_train.py)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shlex
import sys
import warnings

from tests.distributed.common import main, write_result

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts")
sys.path.insert(0, os.path.abspath(SCRIPTS))
import train  # noqa: E402


def _args(parser):
    parser.add_argument("--train", default="", help="flags of every run, one string")
    parser.add_argument("--variant", action="append", default=[], help="NAME=FLAGS, one per run")


def run(args):
    train.init_distributed()  # torchrun's group, or one process of its own (plain python)
    result = {}
    logged = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("torch").addHandler(handler)
    for variant in args.variant:
        name, _, flags = variant.partition("=")
        printed = io.StringIO()
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(printed):
            warnings.simplefilter("always")
            result[name] = train.train(train.parse_args(shlex.split(args.train) + shlex.split(flags)))
        print(printed.getvalue(), end="", flush=True)
        result[name]["stdout"] = printed.getvalue()
        result[name]["torch_warnings"] = [str(w.message) for w in caught] + logged
        logged.clear()
    write_result(args, result)


if __name__ == "__main__":
    main(run, _args)
