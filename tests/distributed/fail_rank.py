"""torchrun program for the harness's own test: rank 1 raises (or every rank hangs)."""

import time

from tests.distributed.common import init, main


def extra(parser):
    parser.add_argument("mode", choices=["raise", "hang"])


def run(args):
    rank, world, device = init()
    if args.mode == "raise" and rank == 1:
        raise ValueError("rank 1 fails on purpose")
    if args.mode == "hang":
        time.sleep(600)


if __name__ == "__main__":
    main(run, extra)
