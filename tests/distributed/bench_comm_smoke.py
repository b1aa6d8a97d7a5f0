"""torchrun program: scripts/bench_comm.py in its smoke mode; rank 0 returns the rows it printed
and the CSV file it wrote, read back (tests/scripts/test_bench_scripts.py checks their format and
byte ratios; it runs in the 2-rank launch of several programs, whose folders go at its end)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))

import bench_comm  # noqa: E402
from tests.distributed.common import init, main, write_result  # noqa: E402


def run(args):
    init()
    rows = bench_comm.run(args)
    written = None
    if args.csv and os.path.exists(args.csv):  # rank 0's
        with open(args.csv, newline="") as f:
            written = f.read()
    write_result(args, {"rows": rows, "csv": written})


if __name__ == "__main__":
    main(run, extra_args=bench_comm.add_args)
