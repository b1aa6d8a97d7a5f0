"""f8dist/delayed/ on 2 simulated ranks (threads): the sync across ranks that bring different
data."""

import copy

import torch

from f8dist import sync_float8_amax_and_scale_history
from f8dist.config import E4M3
from f8dist.scaling import amax_to_scale
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


def test_a_rank_with_an_empty_shard_joins_the_first_steps_reduction():
    # an empty tensor records nothing, yet a first-step cast of a sharded DTensor reduces its amax
    # over the shards on every rank (a rank that skipped it would hang the others)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    lin = float8_model(COUNTED)[0]
    lins = [lin, copy.deepcopy(lin)]

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (2,))
        local = x if rank == 0 else x[:0]
        hp = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                shape=x.shape, stride=x.stride())
        scales = lins[rank].delayed.forward_scales(hp, lins[rank].weight, True, [])
        sync_float8_amax_and_scale_history(lins[rank])
        return scales[next(iter(scales))], lins[rank].fp8_amax_history_input[0]

    for scale, newest in run_threads(2, rank_main, timeout=60):
        assert newest == x.abs().max()
        assert scale == amax_to_scale(x.abs().max(), E4M3)
