"""torchrun program (2 ranks): f8dist.debug statistics of DTensor casts equal one-device ones.

* DTensors sharded on dim 0, dim 1, or replicated, through ``cast_to_float8`` (tensorwise and
  axiswise scales, and a given scale that saturates and underflows): the recorded statistics are
  those of the logical tensor, i.e. of the same cast on one device.
* A TP-like Float8Linear (weight Shard(0), input replicated) forward and backward.
* FSDP2 (fully_shard per layer, same data on every rank): every rank records one device's figures,
  also when the weights are cast before a float8 all-gather (each rank casts its shard).

Rank 0 reports the comparisons it ran (``{"checked": [...]}``); a mismatch raises on its rank.
Run by tests/sim/debug/test_distributed.py on simulated ranks (tests/sim/programs.py).
"""

import copy
import math

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import f8dist
from f8dist import Float8LinearConfig
from f8dist.core.cast import CastSite, cast_to_float8
from f8dist.config import CastSpec, ScalingGranularity
from f8dist.debug import record
from tests.distributed.common import init, main, write_result

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
COUNTS = ("casts", "numel", "nonzero", "saturated", "underflow")


def assert_same(dist_stats, ref_stats, what):
    assert ref_stats, f"{what}: no cast recorded"
    assert set(dist_stats) == set(ref_stats), (what, set(dist_stats) ^ set(ref_stats))
    for site, ref in ref_stats.items():
        got = dist_stats[site]
        for name in COUNTS + ("amax", "scale_min", "scale_max"):
            assert getattr(got, name) == getattr(ref, name), (what, site, name, got, ref)
        for name in ("signal_sq", "error_sq"):  # float64 sums in another order
            assert math.isclose(getattr(got, name), getattr(ref, name), rel_tol=1e-9), (what, site, name)
        assert got.float8_dtype == ref.float8_dtype


def tiny_model(device, config=Float8LinearConfig(emulate=True)):
    torch.manual_seed(0)
    with torch.device(device):
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    return f8dist.convert_to_float8_training(model, config=config)


def direct_casts(mesh, device, checked):
    model = tiny_model(device)  # only gives the recorder the FQN "0"
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 32, generator=g) * torch.logspace(-6, 1, 32)  # [16, 32] wide range
    x[3, 5] = 0.0
    x = x.to(device)
    # four casts of x, told apart by the (gemm, operand) of their sites
    axiswise = ScalingGranularity.AXISWISE
    casts = [
        (CastSpec(dtype=E4M3, gemm="output", operand="input", fqn="0"), None),  # tensorwise
        (CastSpec(dtype=E4M3, granularity=axiswise, gemm="output", operand="weight", fqn="0"), None),
        (CastSpec(dtype=E5M2, granularity=axiswise, gemm="grad_input", operand="grad_output",
                  fqn="0"), None),
        # a given scale that saturates and underflows
        (CastSpec(dtype=E4M3, gemm="grad_weight", operand="input", fqn="0"),
         torch.tensor(100.0, device=device)),
    ]
    for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
        xd = distribute_tensor(x, mesh, placements)
        with record(model) as ref_rec:
            for spec, scale in casts:
                cast_to_float8(x, spec, scale)
        with record(model) as rec:
            for spec, scale in casts:
                cast_to_float8(xd, spec, scale)
        ref = ref_rec.stats()
        given = ref[CastSite("0", "grad_weight", "input")]
        assert given.saturated > 0 and given.underflow > 0, given  # the test can see both
        assert_same(rec.stats(), ref, f"cast_to_float8 {placements}")
        checked.append(f"direct {placements}")


def tp_like_linear(mesh, device, checked):
    ref = tiny_model(device)
    model = copy.deepcopy(ref)
    lin = model[0]  # colwise: weight [64, 32] sharded on out_features
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(0)]))
    lin.bias = nn.Parameter(distribute_tensor(lin.bias.detach(), mesh, [Shard(0)]))
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(2)).to(device)
    with record(ref) as ref_rec:
        ref[0](x).sum().backward()
    xd = distribute_tensor(x, mesh, [Replicate()])
    with record(model) as rec:
        lin(xd).full_tensor().sum().backward()
    assert_same(rec.stats(), ref_rec.stats(), "TP-like colwise Float8Linear")
    checked.append("tp-like colwise linear")


def fsdp(mesh, device, checked):
    ref = tiny_model(device)
    model = copy.deepcopy(ref)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(3)).to(device)  # same on every rank
    with record(ref) as ref_rec:
        ref(x).sum().backward()
    with record(model) as rec:
        model(x).sum().backward()
    assert_same(rec.stats(), ref_rec.stats(), "FSDP2")
    checked.append("fsdp2")


def fsdp_float8_all_gather(mesh, device, checked):
    # each rank casts its half of a weight (rows) before the all-gather; the weights' maxima are
    # put in rank 1's half, so a shard's statistics are not the weight's
    ref = tiny_model(device, Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True))
    with torch.no_grad():
        for layer in (ref[0], ref[2]):
            layer.weight[-1] *= 8
    model = copy.deepcopy(ref)
    for layer in (model[0], model[2]):  # one all-gather per layer, no re-gather in backward
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(4)).to(device)
    with record(ref) as ref_rec:
        ref(x).sum().backward()
    with record(model) as rec:
        model(x).sum().backward()
    # the all-gathered float8 weight serves the grad_input gemm too: that gemm casts no weight
    expected = {s: v for s, v in ref_rec.stats().items() if (s.gemm, s.operand) != ("grad_input", "weight")}
    assert_same(rec.stats(), expected, "FSDP2 float8 all-gather")
    checked.append("fsdp2 float8 all-gather")


def run(args):
    rank, world, device = init()
    mesh = init_device_mesh(device.type, (world,))
    checked = []
    direct_casts(mesh, device, checked)
    tp_like_linear(mesh, device, checked)
    fsdp(mesh, device, checked)
    fsdp_float8_all_gather(mesh, device, checked)
    write_result(args, {"checked": checked})


if __name__ == "__main__":
    main(run)
