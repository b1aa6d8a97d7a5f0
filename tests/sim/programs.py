"""Run a torchrun program of tests/distributed/ on simulated ranks: the program's own code and
checks, on ``world`` threads of torch's threaded process group instead of ``world`` gloo
processes, its result the dict a torchrun launch returns. A claim that a program makes
(bit-identical to one device, exact byte counts) is then checked in a second instead of a launch;
each parallelism and float8 wire path keeps a torchrun/gloo smoke in tests/distributed/
(docs/tests.md).

Example::

    >>> run_program("comm_counts", 2)["all_reduce"]                    # doctest: +SKIP
    {'all_reduce': {'calls': 1, 'input_bytes': 40, 'output_bytes': 40}}

[Note: one rank at a time]
A torchrun program is written for processes: each rank seeds torch's global generator and draws
from it (models, batches), and parses ``sys.argv``. Threads share both, so rank 1's draws would
interleave with rank 0's. So the ranks run one at a time, each holding a baton
(:class:`_Baton`) that it hands on only where it waits for the others (a collective's join, the
store, the store barrier of a new group) and that carries each rank's random state (torch's CPU
generator, Python's ``random``) out and back in: every rank draws what its own process would
draw, from a fresh process's seed. The ranks' arithmetic runs as it would in their processes;
the collectives are the threaded group's (a sum in rank order; on two ranks any order gives the
same bits). Each run starts without earlier runs' agreement checks ([Note: a run starts as
processes do] in tests/sim/threads.py), and each rank has its own float8 cast observers
(``f8dist.core.cast.cast_observers``, f8dist.debug's recorder): a rank records its own casts, as
its process would, not those of the ranks it hands the baton to.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import random
import runpy
import sys
import tempfile
import threading
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from tests.distributed import common
from tests.sim.threads import run_threads


class _Baton:
    """Lets one rank run at a time; see [Note: one rank at a time]."""

    def __init__(self):
        self._lock = threading.Lock()
        self._states = {}  # rank -> (torch's CPU random state, Python's random state)
        self._local = threading.local()
        fresh = torch.Generator().get_state()  # a fresh process's default seed
        self._fresh = (fresh, random.Random(torch.initial_seed()).getstate())

    def take(self, rank: int) -> None:
        self._lock.acquire()
        self._local.rank = rank
        torch_state, py_state = self._states.get(rank, self._fresh)
        torch.set_rng_state(torch_state)
        random.setstate(py_state)

    def give(self) -> None:
        self._states[self._local.rank] = (torch.get_rng_state(), random.getstate())
        self._local.rank = None
        self._lock.release()

    @contextlib.contextmanager
    def handed_on(self):
        """Around a wait for other ranks: another rank runs meanwhile (no-op off a rank)."""
        rank = getattr(self._local, "rank", None)
        if rank is None:
            yield
            return
        self.give()
        try:
            yield
        finally:
            self.take(rank)


class _Store(dist.Store):
    """A HashStore whose blocking calls hand the baton on."""

    def __init__(self, baton: _Baton):
        super().__init__()
        self._inner, self._baton = dist.HashStore(), baton

    def set(self, key, value):
        return self._inner.set(key, value)

    def get(self, key):
        with self._baton.handed_on():
            return self._inner.get(key)

    def add(self, key, value):
        return self._inner.add(key, value)

    def compare_set(self, key, expected, desired):
        return self._inner.compare_set(key, expected, desired)

    def check(self, keys):
        return self._inner.check(keys)

    def delete_key(self, key):
        return self._inner.delete_key(key)

    def num_keys(self):
        return self._inner.num_keys()

    def set_timeout(self, timeout):
        return self._inner.set_timeout(timeout)

    def wait(self, keys, timeout: Optional[datetime.timedelta] = None):
        with self._baton.handed_on():
            return self._inner.wait(keys) if timeout is None else self._inner.wait(keys, timeout)


@contextlib.contextmanager
def _waits_hand_on(baton: _Baton):
    """The threaded group's collectives and new groups' store barriers hand the baton on."""
    import torch.distributed.distributed_c10d as c10d
    from torch.testing._internal.distributed import multi_threaded_pg as threaded

    def handing_on(fn):
        def wrapped(*args, **kwargs):
            with baton.handed_on():
                return fn(*args, **kwargs)
        return wrapped

    patched = [(threaded.Collective, "join"), (threaded, "_store_based_barrier"),
               (c10d, "_store_based_barrier")]
    originals = [getattr(owner, name) for owner, name in patched]
    for (owner, name), fn in zip(patched, originals):
        setattr(owner, name, handing_on(fn))
    try:
        yield
    finally:
        for (owner, name), fn in zip(patched, originals):
            setattr(owner, name, fn)


class _PerRank:
    """``f8dist.core.cast.cast_observers`` with one list per simulated rank (thread)."""

    def __init__(self):
        self._local = threading.local()

    def _mine(self) -> list:
        return self._local.__dict__.setdefault("observers", [])

    def append(self, observer) -> None:
        self._mine().append(observer)

    def remove(self, observer) -> None:
        self._mine().remove(observer)

    def __iter__(self):
        return iter(list(self._mine()))

    def __len__(self) -> int:
        return len(self._mine())


def run_as_processes(world: int, fn: Callable[[int], object], timeout: float = 300) -> List[object]:
    """``fn(rank)`` on ``world`` simulated ranks that run one at a time, each with the random
    state and the cast observers of its own process ([Note: one rank at a time]); their results,
    by rank."""
    from f8dist.core import cast

    baton = _Baton()

    def rank_main(rank):
        baton.take(rank)
        try:
            return fn(rank)
        finally:
            baton.give()

    observers, cast.cast_observers = cast.cast_observers, _PerRank()
    try:
        with _waits_hand_on(baton):
            return run_threads(world, rank_main, timeout=timeout, store=_Store(baton))
    finally:
        cast.cast_observers = observers


def run_program(program: str, world: int, *args, timeout: float = 300) -> Optional[dict]:
    """``tests/distributed/<program>.py args...`` on ``world`` simulated ranks; what rank 0 wrote
    with ``common.write_result`` (``None`` if nothing). ``TMP`` in ``args``: a fresh folder. A
    rank that raises re-raises here."""
    with tempfile.TemporaryDirectory(prefix=f"f8dist_sim_{program}_") as tmp:
        path = os.path.join(tmp, "result.json")
        argv = [program, *[os.path.join(tmp, "ckpt") if a == "TMP" else str(a) for a in args],
                "--result", path]

        def rank_main(rank):
            sys.argv = argv  # read by the program's argument parser, before any wait
            runpy.run_module(f"tests.distributed.{program}", run_name="__main__", alter_sys=False)

        nested, common.NESTED = common.NESTED, True  # main() runs the program, the group is ours
        saved_argv = sys.argv
        try:
            run_as_processes(world, rank_main, timeout)
        finally:
            common.NESTED, sys.argv = nested, saved_argv
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)


@functools.lru_cache(maxsize=None)
def simulated(program: str, world: int, *args) -> Optional[dict]:
    """:func:`run_program`'s result, run once per session for the tests that read it."""
    return run_program(program, world, *args)
