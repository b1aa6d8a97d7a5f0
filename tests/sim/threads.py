"""Simulate ``world`` ranks in this process: one thread per rank on torch's threaded process group
(in-memory collectives, functional ones included): FSDP2, DTensor and rank-divergent programs.

See [Note: simulating ranks in one process] in tests/sim/__init__.py for which tests fit
threads and which fit LocalTensorMode (tests/sim/local.py).

Example::

    >>> run_threads(4, lambda rank: rank * 2)
    [0, 2, 4, 6]
"""

from __future__ import annotations

import threading
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from f8dist.core import agreement
from f8dist.core.cast import StochasticRounding, stochastic_rounding


def run_threads(world: int, fn: Callable[[int], object], timeout: float = 120,
                store: Optional[dist.Store] = None) -> List[object]:
    """``fn(rank)`` on ``world`` simulated ranks, each in a default process group of its own
    thread; their results, by rank. The first rank to raise fails every rank's collectives (no
    hang) and its exception is re-raised here. ``store``: the group's (a fresh HashStore).
    Ranks start as fresh processes do ([Note: a run starts as processes do])."""
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup, _install_threaded_pg, _uninstall_threaded_pg,
    )

    store = dist.HashStore() if store is None else store
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

    # [Note: a run starts as processes do] What a process starts without, a run starts without
    # too: f8dist.core.agreement's count of the checks each rank made over each group (``_rounds``,
    # the store keys of its next check). The threaded groups' names repeat from run to run, so
    # an earlier run's counts (2 ranks) would put this run's ranks 0-1 and 2-3 (4 ranks) on
    # different keys, waiting for each other until the agreement times out.
    # So are stochastic rounding's draw counts ([Note: the stochastic rounding key]): each run
    # starts from seed 0 on stream 0 with none drawn, as a process does.
    saved_rounds = dict(agreement._rounds)
    agreement._rounds.clear()
    saved_draws = stochastic_rounding.state_dict()
    stochastic_rounding.load_state_dict(StochasticRounding().state_dict())  # every rank's
    _install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # functional collectives per thread
    ProcessLocalGroup.reset()
    counted = _count_python_collectives(ProcessLocalGroup)
    counted.update(_point_to_point(ProcessLocalGroup))
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
        for name, method in counted.items():
            if method is None:
                delattr(ProcessLocalGroup, name)
            else:
                setattr(ProcessLocalGroup, name, method)
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        _uninstall_threaded_pg()
        ProcessLocalGroup.reset()
        agreement._rounds.clear()
        agreement._rounds.update(saved_rounds)
        stochastic_rounding.load_state_dict(saved_draws)
    if errors:
        raise errors[0]
    return results


# The threaded group's collectives that do not call another of its collectives: (kind, what
# each reads, what it writes) from the method's arguments ([Note: what is counted] in
# f8dist/testing/collectives.py).
_COLLECTIVES = {
    "allreduce": ("all_reduce", lambda a: a[0], lambda a: a[0]),
    "allreduce_coalesced": ("all_reduce", lambda a: a[0], lambda a: a[0]),
    "allgather": ("all_gather", lambda a: a[1], lambda a: a[0]),
    "reduce_scatter": ("reduce_scatter", lambda a: a[1], lambda a: a[0]),
    "all_to_all_single": ("all_to_all", lambda a: a[1], lambda a: a[0]),
    "alltoall": ("all_to_all", lambda a: a[1], lambda a: a[0]),
    "broadcast": ("broadcast", lambda a: a[0], lambda a: a[0]),
    "scatter": ("scatter", lambda a: a[1], lambda a: a[0]),
    "gather": ("gather", lambda a: a[1], lambda a: a[0]),
}


def _count_python_collectives(pg_class) -> dict:
    """Make ``f8dist.testing.count_collectives`` see the threaded group's collectives, which
    ``torch.distributed``'s c10d calls (FSDP2's all-gather and reduce-scatter) reach as Python
    methods, bypassing the dispatcher; returns the original methods, to restore."""
    from f8dist.testing.collectives import record_collective

    originals = {}
    for name, (kind, read, written) in _COLLECTIVES.items():
        method = originals[name] = getattr(pg_class, name)

        def counted(self, *args, _method=method, _kind=kind, _read=read, _written=written):
            opts = args[-1] if len(args) > 1 and hasattr(args[-1], "reduceOp") else None
            record_collective(_kind, _read(args), _written(args), self,
                              None if opts is None else opts.reduceOp)
            return _method(self, *args)

        setattr(pg_class, name, counted)
    # a barrier (the threaded group's runs an all-reduce) is not counted, as on gloo
    originals["barrier"] = pg_class.barrier
    pg_class.barrier = lambda self, opts=None: originals["allreduce"](self, [torch.ones(1)])
    return originals


def _point_to_point(pg_class) -> dict:
    """Give the threaded group ``send`` and ``recv`` (torch's has none; pipeline stages need
    them): a sent tensor is copied into a mailbox per (group, source, destination, tag), in
    order, and a receive completes when its message is there. Counted as ``send`` / ``recv``
    ([Note: what is counted]); returns the methods to restore (None: none before)."""
    from torch._C._distributed_c10d import _create_work_from_future
    from torch.futures import Future

    from f8dist.testing.collectives import record_collective

    lock = threading.Lock()
    mail: dict = {}  # key -> list of tensors sent, not yet received
    waiting: dict = {}  # key -> list of (tensor to fill, future) posted before their message

    def done() -> "dist.Work":
        fut = Future()
        fut.set_result(None)
        return _create_work_from_future(fut)

    def send(self, tensors, dst, tag=0):
        record_collective("send", tensors, tensors, self)
        key = (self.pg_name, self._rank, dst, tag)
        message = tensors[0].detach().view(-1).view(torch.uint8).clone()  # its bytes, as they are
        with lock:
            if waiting.get(key):
                tensor, fut = waiting[key].pop(0)
            else:
                mail.setdefault(key, []).append(message)
                return done()
        tensor.view(-1).view(torch.uint8).copy_(message)
        fut.set_result(None)
        return done()

    def recv(self, tensors, src, tag=0):
        record_collective("recv", tensors, tensors, self)
        key = (self.pg_name, src, self._rank, tag)
        with lock:
            if not mail.get(key):
                fut = Future()
                waiting.setdefault(key, []).append((tensors[0].detach(), fut))
                return _create_work_from_future(fut)
            message = mail[key].pop(0)
        tensors[0].detach().view(-1).view(torch.uint8).copy_(message)
        return done()

    backend = pg_class._get_backend

    def get_backend(self, device):
        # torch >= 2.15's batch_isend_irecv asks the group's backend whether it coalesces; the
        # threaded group has none registered: it is its own (no coalescing: one op at a time)
        try:
            return backend(self, device)
        except RuntimeError:
            return self

    originals = {name: pg_class.__dict__.get(name) for name in ("send", "recv", "_get_backend")}
    pg_class.send, pg_class.recv, pg_class._get_backend = send, recv, get_backend
    return originals
