"""f8dist/policy/delayed/ on 2 simulated ranks (threads): the sync across ranks that bring different
data; delayed scaling under FSDP2 (default config, float8 all-gather, amax init off) and TP
against one device, and ranks that hold different layers (tests/distributed/delayed_sync.py run by
tests/sim/programs.py: its checks run inside, the figures are re-checked here)."""

import copy

import torch

from f8dist import sync_float8_amax_and_scale_history
from f8dist.config import E4M3
from f8dist.core.scaling import amax_to_scale
from tests.sim.programs import simulated
from tests.sim.threads import run_threads
from tests.policy.test_delayed import COUNTED, assert_buffers_equal, batches, delayed_buffers, float8_model


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


FSDP = ("fsdp", "fsdp_fp8_all_gather", "fsdp_init_off", "fsdp_eval_reshard_True",
        "fsdp_eval_reshard_False")


def test_delayed_sync_fsdp_and_tp_match_one_device():
    r = simulated("delayed_sync", 2)
    assert r["world"] == 2
    for scenario in FSDP + ("tp",):
        steps = r[scenario]["collectives_per_step"]
        assert len(steps) == 5
        # one all-reduce of every delayed amax and out-of-range flag of the model (fp32, 8 bytes
        # per operand) per sync, after the first sync's 16-byte check of the layers
        n = {"tp": 2 * 3}.get(scenario, 3 * 3)
        first = {"all_reduce": {"calls": 2, "input_bytes": 8 * n + 16, "output_bytes": 8 * n + 16}}
        later = {"all_reduce": {"calls": 1, "input_bytes": 8 * n, "output_bytes": 8 * n}}
        assert [s["sync"] for s in steps] == [first] + [later] * 4, steps
        floor = 60 if scenario == "tp" else 120  # FSDP: only summation order differs
        assert min(r[scenario]["weight_sqnr_db"].values()) >= floor, r[scenario]
    # the first step reduces the amaxes of sharded tensors only: the 3 weights all-gathered in
    # float8 (forward, and backward after the reshard), not a data-parallel micro-batch (issue 23,
    # item 10: before, every cast all-reduced its amax with its layer's fingerprint, >= 9 calls)
    assert all("all_reduce" not in s["fwd_bwd"] for s in r["fsdp"]["collectives_per_step"])
    for scenario in ("fsdp_fp8_all_gather", "fsdp_init_off"):
        steps = r[scenario]["collectives_per_step"]
        assert steps[0]["fwd_bwd"]["all_reduce"] == {"calls": 6, "input_bytes": 24, "output_bytes": 24}, steps[0]
        assert all("all_reduce" not in s["fwd_bwd"] for s in steps[1:]), steps
    # weights all-gathered in float8 (1 byte per element, with the delayed scale), biases in
    # float32; twice per step (forward, and backward after the reshard)
    weights, biases = 32 * 64 + 64 * 32 + 32 * 16, 64 + 32 + 16
    for scenario in ("fsdp_fp8_all_gather", "fsdp_init_off"):
        assert all(s["fwd_bwd"]["all_gather"]["output_bytes"] == 2 * (weights + 4 * biases)
                   for s in r[scenario]["collectives_per_step"]), r[scenario]

    mismatch = r["mismatch"]
    assert mismatch["first_step_collectives"] == 0, mismatch
    assert "hold different delayed layers" in mismatch["first_sync"], mismatch
    assert "hold different delayed layers" in mismatch["sync"] and "group=" in mismatch["sync"], mismatch
    assert mismatch["trained_with_own_group"] is True
