"""Float8 gradient reduction under FSDP2's HSDP on a 2 x 2 mesh of simulated ranks (threads):
[Note: float8 HSDP] in f8dist/parallel/fsdp/reduce_scatter.py. Against FSDP2's own float32
reduction: the float8 reduce-scatter's floors (tests/sim/parallel/fsdp/test_reduce_scatter.py),
replicas bit-identical, no float32 all-reduce over dp_replicate, the gradient collectives'
bytes against FSDP2's float32 reduce-scatter and all-reduce, gradient accumulation
(set_requires_gradient_sync) and the refusal of set_requires_all_reduce(False); and on a
2 x 2 x 2 mesh (dp_replicate x dp_shard x tp), FSDP2 over a float8 TP pair's DTensor parameters
(scripts/step_table.py's 3-D layout): the same floors, replicas and wire."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from f8dist.core.numerics import sqnr
from f8dist.parallel.fsdp import enable_float8_reduce_scatter
from f8dist.testing import count_collectives
from tests.sim.parallel.fsdp.test_reduce_scatter import PARAM_FLOOR_DB, WHOLE_FLOOR_DB
from tests.sim.threads import run_threads

REPLICAS, SHARDS = 2, 2


def _model(mesh, reduce_dtype, float8, divide_factor=None):
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
    g = torch.Generator().manual_seed(0)  # not torch.manual_seed: the threads share its generator
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / 4)
    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for unit in (model[0], model[2], model):
        fully_shard(unit, mesh=mesh, mp_policy=mp)
        if divide_factor is not None:
            unit.set_gradient_divide_factor(divide_factor)
    if float8:
        enable_float8_reduce_scatter(model)
    return model


def _backward(model, rank):
    g = torch.Generator().manual_seed(rank)  # every rank its own batch
    x = torch.randn(8, 16, generator=g)
    with count_collectives() as counts:
        model(x).square().mean().backward()
    return counts


def _grads(model):
    return {name: p.grad.to_local().clone() for name, p in model.named_parameters()}


def _run(divide_factor=None):
    def rank_main(rank):
        mesh = init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("dp_replicate", "dp_shard"))
        out = {}
        for name, reduce_dtype, float8 in (("fp32", torch.float32, False),
                                           ("float8", torch.float32, True)):
            # the threaded group has no PREMUL_SUM: only float8 (its own sum) gets the factor
            model = _model(mesh, reduce_dtype, float8, divide_factor if float8 else None)
            _backward(model, rank)  # FSDP2's lazy init, uncounted
            model.zero_grad()
            counts = _backward(model, rank)
            out[name] = (_grads(model), counts)
        return out

    return run_threads(REPLICAS * SHARDS, rank_main)


@pytest.mark.parametrize("divide_factor", [None, 3.0])
def test_hsdp_gradients_reduced_in_float8_identical_on_replicas(divide_factor):
    out = _run(divide_factor)
    scale = 1.0 if divide_factor is None else REPLICAS * SHARDS / divide_factor  # FSDP2 averaged
    _assert_float8_grads(out, scale)


def _assert_float8_grads(out, scale=1.0):
    """Each rank's float8-reduced gradients within the floors of the float32-reduced ones (times
    ``scale``), and bit-identical on the replicas of each shard."""
    for rank, r in enumerate(out):
        ref = {name: g * scale for name, g in r["fp32"][0].items()}
        f8 = r["float8"][0]
        whole = sqnr(torch.cat([g.flatten() for g in ref.values()]),
                     torch.cat([g.flatten() for g in f8.values()]))
        assert whole > WHOLE_FLOOR_DB, (rank, whole)
        for name in ref:
            assert sqnr(ref[name], f8[name]) > PARAM_FLOOR_DB, (rank, name)
    for shard in range(SHARDS):  # rank = replica * SHARDS + shard
        replicas = [out[replica * SHARDS + shard]["float8"][0] for replica in range(REPLICAS)]
        for name in replicas[0]:
            assert torch.equal(replicas[0][name], replicas[1][name]), (shard, name)


def test_hsdp_gradient_collectives_move_float8():
    # [Note: buffer bytes] (f8dist/testing): an all-reduce's buffer, an all-gather's output. The
    # baseline is the step table's (scripts/step_table.py: bf16 weights, float32 reduction).
    r = _run()[0]
    fp32, f8 = r["fp32"][1], r["float8"][1]
    assert "all_reduce" not in f8.as_dict() and "reduce_scatter" not in f8.as_dict()
    replicate = (0, 2)  # rank 0's replicas
    # the all-gathers over dp_shard are the weights' (backward's re-gather)
    assert {w for w in f8["all_gather"].wires if w[0] == replicate} == {(replicate, "uint8")}
    assert set(fp32["all_reduce"].wires) == {(replicate, "float32")}
    f8_bytes = f8["all_to_all"].input_bytes + f8["all_gather"].wires[replicate, "uint8"][2]
    fp32_bytes = fp32["reduce_scatter"].input_bytes + fp32["all_reduce"].input_bytes
    assert f8_bytes <= 0.55 * fp32_bytes, (f8_bytes, fp32_bytes)


def test_hsdp_float8_refuses_set_requires_all_reduce_false():
    # set_requires_all_reduce(False) accumulates shards that were not summed over replicas; the
    # float8 comm sums over them in every reduce-scatter, so it refuses (naming setting and fix)
    def rank_main(rank):
        mesh = init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("dp_replicate", "dp_shard"))
        model = _model(mesh, torch.float32, float8=True)
        model.set_requires_all_reduce(False)
        _backward(model, rank)

    with pytest.raises(NotImplementedError) as e:
        run_threads(REPLICAS * SHARDS, rank_main)
    message = str(e.value)
    for part in ("set_requires_all_reduce(False)", "dp_replicate",
                 "keep set_requires_all_reduce(True)", "leave the float8 reduce-scatter off"):
        assert part in message, message


MICRO_STEPS = 3


def test_hsdp_float8_gradient_accumulation_matches_fp32():
    # set_requires_gradient_sync(False) micro-steps accumulate unsharded gradients (no
    # collective); the synced step reduces their sum once, over dp_shard and dp_replicate
    def rank_main(rank):
        mesh = init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("dp_replicate", "dp_shard"))
        out = {}
        for name, float8 in (("fp32", False), ("float8", True)):
            model = _model(mesh, torch.float32, float8)
            counts = []
            for step in range(MICRO_STEPS):
                model.set_requires_gradient_sync(step == MICRO_STEPS - 1)
                counts.append(_backward(model, rank * MICRO_STEPS + step))
            out[name] = (_grads(model), counts)
        return out

    out = run_threads(REPLICAS * SHARDS, rank_main)
    _assert_float8_grads(out)
    for r in out:
        *silent, synced = r["float8"][1]
        for counts in silent:  # the micro-steps reduce nothing (their all-gathers: weights)
            assert set(counts.as_dict()) == {"all_gather"}, counts
            assert {dtype for _, dtype in counts["all_gather"].wires} == {"float32"}, counts
        assert "all_to_all" in synced.as_dict(), synced
        assert any(dtype == "uint8" for _, dtype in synced["all_gather"].wires), synced


TP = 2  # the 3-D mesh: rank = (replica * SHARDS + shard) * TP + tp


def _tp_model(mesh, float8_reduce):
    """A tensorwise float8 colwise -> rowwise pair on mesh["tp"], under FSDP2 on
    mesh["dp_replicate", "dp_shard"] (parameters: DTensors over all three axes), as
    scripts/step_table.py's 3-D layout."""
    from torch.distributed.tensor.parallel import parallelize_module

    from f8dist import Float8LinearConfig, convert_to_float8_training
    from f8dist.parallel.tp import Float8ColwiseParallel, Float8RowwiseParallel

    model = nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 16))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / 4)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    parallelize_module(model, mesh["tp"], {"0": Float8ColwiseParallel(),
                                           "1": Float8RowwiseParallel()})
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for unit in (model[0], model[1], model):
        fully_shard(unit, mesh=mesh["dp_replicate", "dp_shard"], mp_policy=mp)
    if float8_reduce:
        enable_float8_reduce_scatter(model)
    return model


def test_hsdp_float8_reduction_over_tp_parameters():
    # FSDP2 over TP's DTensor parameters (dp_replicate 2 x dp_shard 2 x tp 2): the float8 comm
    # reduces each tp rank's local shards over dp_shard, then over dp_replicate as a uint8
    # all-gather; replicas (same dp_shard and tp coordinate) add the same rows in the same order
    def rank_main(rank):
        mesh = init_device_mesh("cpu", (REPLICAS, SHARDS, TP),
                                mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        out = {}
        for name, float8 in (("fp32", False), ("float8", True)):
            model = _tp_model(mesh, float8)
            _backward(model, rank // TP)  # FSDP2's lazy init, uncounted; tp ranks share a batch
            model.zero_grad()
            counts = _backward(model, rank // TP)
            out[name] = (_grads(model), counts)
        return out

    out = run_threads(REPLICAS * SHARDS * TP, rank_main)
    for rank, r in enumerate(out):
        ref, f8 = r["fp32"][0], r["float8"][0]
        whole = sqnr(torch.cat([g.flatten() for g in ref.values()]),
                     torch.cat([g.flatten() for g in f8.values()]))
        assert whole > WHOLE_FLOOR_DB, (rank, whole)
        for name in ref:
            assert sqnr(ref[name], f8[name]) > PARAM_FLOOR_DB, (rank, name)
        replica = (rank + SHARDS * TP) % (REPLICAS * SHARDS * TP)  # same dp_shard and tp
        for name in f8:
            assert torch.equal(f8[name], out[replica]["float8"][0][name]), (rank, replica, name)
        replicate = tuple(sorted((rank, replica)))
        shard = tuple(sorted((rank, rank ^ TP)))  # same dp_replicate and tp (SHARDS == 2)
        fp32, f8_counts = r["fp32"][1], r["float8"][1]
        assert fp32["all_reduce"].wires[replicate, "float32"][0] == 2, fp32  # FSDP2's, a module
        # what is left: the tensorwise casts' amax all-reduces over tp, in both
        tp_amax = {k: v for k, v in fp32["all_reduce"].wires.items() if k[0] != replicate}
        assert f8_counts["all_reduce"].wires == tp_amax, f8_counts
        assert "reduce_scatter" not in f8_counts.as_dict(), f8_counts
        assert set(f8_counts["all_to_all"].wires) == {(shard, "uint8")}, f8_counts
        gathers = f8_counts["all_gather"].wires  # over dp_shard: backward's weight re-gather
        assert set(gathers) == {(shard, "float32"), (replicate, "uint8")}, f8_counts
        assert gathers[replicate, "uint8"][0] == 2, f8_counts  # one per module
