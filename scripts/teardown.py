"""How a torchrun program starts and ends: ``one_gpu_per_rank()`` picks its device and backend,
``with exit_cleanly(): main()`` ends it.

Used by the scripts here and by the test programs (tests/distributed/common.py); not part of the
library, which never ends a process.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator, Optional

import torch
import torch.distributed as dist

__all__ = ["exit_cleanly", "one_gpu_per_rank", "shutdown_process_group"]


def one_gpu_per_rank(ranks: Optional[int] = None) -> bool:
    """CUDA (with nccl) where every local rank has a GPU of its own; else the CPU (with gloo): nccl
    cannot put two ranks on one GPU. ``ranks``: the local ranks of a program about to be
    launched; by default those of this torchrun program (which says when it falls back)."""
    gpus = torch.cuda.device_count()
    if ranks is None:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if 0 < gpus < ranks and os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"{ranks} ranks on {gpus} GPU(s): running on the CPU with gloo", flush=True)
    return gpus >= ranks


def shutdown_process_group(*, ok: bool = True) -> None:
    """End a torchrun program's process group cleanly.

    [Note: gloo teardown]
    gloo's worker threads can still hold work objects with Python references when the interpreter
    finalizes; destroying them then aborts the process ("terminate called without an active
    exception", SIGABRT) after all the work was done, intermittently, and torchrun reports the
    rank as failed. So: ranks leave together (a barrier, when ``ok``: after an error a peer may
    never arrive), the group is destroyed while the interpreter is fully alive, and a successful
    process exits at once, skipping finalization, once its output is flushed.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if ok:
        dist.barrier()
    dist.destroy_process_group()
    if ok:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


@contextlib.contextmanager
def exit_cleanly() -> Iterator[None]:
    """``with exit_cleanly(): main()`` in a torchrun program's ``__main__``: on success ends with
    :func:`shutdown_process_group` (which exits the process), on an exception destroys the group
    without waiting for peers and re-raises. See [Note: gloo teardown]."""
    try:
        yield
    except BaseException:
        shutdown_process_group(ok=False)
        raise
    shutdown_process_group(ok=True)
