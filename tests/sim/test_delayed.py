"""f8dist/delayed.py on 2 simulated ranks (threads): the sync across ranks that bring different
data."""

import torch

from f8dist import sync_float8_amax_and_scale_history
from tests.sim.threads import run_threads
from tests.test_delayed import COUNTED, assert_buffers_equal, batches, delayed_buffers, float8_model


def _step(model, x, t):
    (model(x) - t).square().sum().backward()
    sync_float8_amax_and_scale_history(model)
    return delayed_buffers(model)


def test_a_rank_with_an_empty_batch_takes_the_amax_of_the_others():
    # [Note: no data]: each step one rank has an empty batch (rank 0 in the first step, rank 1
    # after it); every rank's histories are those of one device running the other rank's batch
    data = batches(2)
    models = [float8_model(COUNTED) for _ in range(3)]  # here: the threads share torch's RNG
    expected = [_step(models[2], x, t) for x, t in data]

    def rank_main(rank):
        model = models[rank]
        got = []
        for step, (x, t) in enumerate(data):
            empty = rank == (0 if step == 0 else 1)
            got.append(_step(model, x[:0] if empty else x, t[:0] if empty else t))
        return got

    for got in run_threads(2, rank_main, timeout=60):
        for b, b_ref in zip(got, expected):
            assert_buffers_equal(b_ref, b)
