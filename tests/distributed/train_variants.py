"""torchrun program: scripts/train.py several times in one launch, one run per ``--variant``
(flags appended to ``--train``, later flags winning); reports each run's steps and losses, what it
printed on rank 0, and every warning torch raised or logged in it (see
tests/distributed/test_train.py); a ``--count-sends NAME`` run also the bytes rank 0 sent point to
point (pipeline stages)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shlex
import sys
import warnings

from f8dist.testing import count_collectives
from tests.distributed.common import main, write_result

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts")
sys.path.insert(0, os.path.abspath(SCRIPTS))
import train  # noqa: E402


def _args(parser):
    parser.add_argument("--train", default="", help="flags of every run, one string")
    parser.add_argument("--variant", action="append", default=[], help="NAME=FLAGS, one per run")
    parser.add_argument("--count-sends", action="append", default=[], help="NAME of a run to count")


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
        counted = count_collectives() if name in args.count_sends else contextlib.nullcontext()
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(printed), \
                counted as counts:
            warnings.simplefilter("always")
            result[name] = train.train(train.parse_args(shlex.split(args.train) + shlex.split(flags)))
        if counts is not None:
            result[name]["sent_bytes"] = counts["send"].input_bytes
        print(printed.getvalue(), end="", flush=True)
        result[name]["stdout"] = printed.getvalue()
        result[name]["torch_warnings"] = [str(w.message) for w in caught] + logged
        logged.clear()
    write_result(args, result)


if __name__ == "__main__":
    main(run, _args)
