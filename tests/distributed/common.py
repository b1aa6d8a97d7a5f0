"""What every torchrun program in tests/distributed/ shares: process-group setup, result
reporting, and the comparison helpers.

A program looks like::

    from tests.distributed.common import init, main, write_result

    def run(args):
        rank, world, device = init()
        ...                        # raise on a mismatch
        write_result(args, {"ratio": 0.5})

    if __name__ == "__main__":
        main(run)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import traceback
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from scripts.teardown import exit_cleanly, one_gpu_per_rank
from f8dist.core.numerics import sqnr  # noqa: F401  (re-exported for the programs)

ERROR_DIR_ENV = "F8DIST_TEST_ERROR_DIR"
NESTED = False  # True while tests/distributed/several.py runs programs in its launch


def init(timeout_s: float = 120) -> Tuple[int, int, torch.device]:
    """Join the process group (nccl with one GPU per local rank, else gloo on the CPU); returns
    (rank, world_size, device)."""
    if one_gpu_per_rank():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


def parse_args(argv: Optional[List[str]] = None, extra: Optional[Callable] = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--result", default=None,
                        help="JSON file rank 0 writes its figures to (default: print them)")
    if extra is not None:
        extra(parser)
    return parser.parse_args(argv)


def write_result(args, obj: dict, table: Optional[Callable[[dict], str]] = None) -> None:
    """Rank 0 writes ``obj`` as JSON to the path the harness passed (``--result``), or prints it
    when there is none (a program run by hand leaves no file behind): ``table(obj)`` if given,
    else the JSON."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    if args.result:
        with open(args.result, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
    else:
        print(table(obj) if table is not None else json.dumps(obj, indent=1, sort_keys=True))


Scenarios = Callable[[int, int, torch.device, dict], Dict[str, Callable[[], None]]]


def scenario_args(parser) -> None:
    """The ``--scenarios a,b`` argument of a program that runs :func:`run_scenarios`."""
    parser.add_argument("--scenarios", required=True)


def run_scenarios(args, table: Scenarios, *, barrier: bool = False) -> None:
    """Join the group, run the scenarios ``--scenarios`` names, in ``table``'s order, and write
    the figures they put in one dict (``{"world": ...}`` to start). ``table(rank, world, device,
    out)`` maps each scenario's name to the call that runs it; a name it does not know raises.
    ``barrier``: wait for every rank before writing."""
    rank, world, device = init()
    out = {"world": world}
    named = args.scenarios.split(",")
    runs = table(rank, world, device, out)
    unknown = [name for name in named if name not in runs]
    if unknown:
        raise ValueError(f"unknown scenarios {unknown}: this program runs {list(runs)}")
    for name, fn in runs.items():
        if name in named:
            fn()
    if barrier:
        dist.barrier()
    write_result(args, out)


def main(fn: Callable, extra_args: Optional[Callable] = None) -> None:
    """Run ``fn(args)``; a raising rank writes its traceback where the harness finds it."""
    args = parse_args(extra=extra_args)
    if NESTED:  # several.py's main() reports a failure and ends the group
        fn(args)
        return
    with exit_cleanly():  # [Note: gloo teardown] in scripts/teardown.py
        try:
            fn(args)
        except BaseException:
            error_dir = os.environ.get(ERROR_DIR_ENV)
            if error_dir:
                rank = os.environ.get("RANK", "?")
                with open(os.path.join(error_dir, f"rank{rank}.txt"), "w") as f:
                    f.write(traceback.format_exc())
            raise


def assert_equal(name: str, ref: torch.Tensor, actual: torch.Tensor) -> None:
    """Bit-exact equality, with a message that says where and by how much it differs."""
    if ref.shape != actual.shape or ref.dtype != actual.dtype:
        raise AssertionError(
            f"{name}: shape/dtype {tuple(actual.shape)}/{actual.dtype} != "
            f"{tuple(ref.shape)}/{ref.dtype}"
        )
    if not torch.equal(ref, actual):
        diff = (ref.double() - actual.double()).abs()
        raise AssertionError(
            f"{name}: not bit-identical, max abs diff {diff.max().item():.3e}, "
            f"{int((diff != 0).sum())} of {diff.numel()} elements differ, "
            f"sqnr {sqnr(ref, actual):.1f} dB"
        )
