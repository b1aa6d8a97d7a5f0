"""Simulate ``world`` ranks in this process: one thread per rank on torch's threaded process group
(in-memory collectives, functional ones included), for fast tests of rank-divergent programs.

[Note: simulating ranks in one process]
``torch.distributed._local_tensor.LocalTensorMode`` runs ONE program over LocalTensors that hold
every rank's value: its per-rank sizes are ``LocalIntNode`` SymInts, and a Python branch on a
size (an empty token group, the grouped gemm padding its groups to 16 rows) is evaluated once
for all ranks (``LocalIntNode.eq`` is "equal on every rank"; ``<`` raises where ranks disagree;
slicing a tensor of a symbolic size fails in torch 2.13). Expert parallelism with uneven token
slices and empty experts is rank-divergent by nature, so it runs here as threads instead: each
rank runs f8dist's real code on plain tensors, and only the collectives are simulated. LocalTensorMode
suits programs where every rank has the same shapes.

Example::

    >>> run_threads(4, lambda rank: rank * 2)
    [0, 2, 4, 6]
"""

from __future__ import annotations

import threading
from typing import Callable, List

import torch
import torch.distributed as dist


def run_threads(world: int, fn: Callable[[int], object], timeout: float = 120) -> List[object]:
    """``fn(rank)`` on ``world`` simulated ranks, each in a default process group of its own
    thread; their results, by rank. The first rank to raise fails every rank's collectives (no
    hang) and its exception is re-raised here."""
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup, _install_threaded_pg, _uninstall_threaded_pg,
    )

    store = dist.HashStore()
    results: List[object] = [None] * world
    errors: List[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 (SystemExit: another rank failed first)
            if not isinstance(e, SystemExit):
                errors.append(e)
            ProcessLocalGroup.exception_handle(e)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    _install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # functional collectives per thread
    ProcessLocalGroup.reset()
    try:
        threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        if any(t.is_alive() for t in threads):
            ProcessLocalGroup.exception_handle(TimeoutError())
            raise TimeoutError(f"a simulated rank ran past {timeout} s")
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        _uninstall_threaded_pg()
        ProcessLocalGroup.reset()
    if errors:
        raise errors[0]
    return results
