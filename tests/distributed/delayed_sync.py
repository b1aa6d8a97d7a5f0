"""torchrun program: delayed scaling on 2 ranks against one device.

Two scenarios in one process group, each against the same float8 model run unsharded on one
device (every rank runs that reference too):

* ``fsdp``: FSDP2 (float8 all-gather of the delayed weights unless ``--no-fp8-all-gather``),
  different data per rank; the reference sees the global batch.
* ``fsdp_amax_init``: FSDP2 float8 all-gather with the first-step init: the weight histories
  come from the whole weights, in the pre-all-gather cast, as on one device.
* ``tp``: PyTorch's ColwiseParallel / RowwiseParallel on Float8Linear, same data on every rank;
  the row-wise layer's input and the column-wise layer's grad_output are activations sharded over
  the ranks, recorded per rank and made global by the sync.

Checked after every sync: the histories, scales and amaxes equal the reference's (bit-identical
on the first step, before any weight update; rtol 1e-5 later, where only summation order
differs), the sync ran exactly one collective, an all-reduce, and the forward + backward ran no
all-reduce (no amax collective). At the end the weights are >= 60 dB against the reference.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from f8dist import Float8LinearConfig, agreement, convert_to_float8_training, sync_float8_amax_and_scale_history
from f8dist.testing import count_collectives
from tests.distributed.common import assert_equal, init, main, sqnr, write_result

STEPS = 5
LR = 0.1
SYNC = sync_float8_amax_and_scale_history  # --compile-sync swaps in the compiled one


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _check_buffers(step, model, ref, worst):
    for (k, v), v_ref in zip(model.state_dict().items(), ref.state_dict().values()):
        if "fp8_" not in k:
            continue
        v = _local(v)  # parallelize_module makes buffers Replicate DTensors
        if step == 0:
            assert_equal(f"step {step} {k}", v_ref, v)
        else:
            torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=0, msg=f"step {step} {k}")
        rel = ((v - v_ref).abs() / v_ref.abs().clamp(min=1e-30)).max().item()
        worst[0] = max(worst[0], rel)


def _train(model, ref, batch_fn, loss_fn, lr, activation_all_reduce_bytes=0):
    """STEPS steps of model and ref; returns per-step collective counts and the figures.

    ``activation_all_reduce_bytes``: what the parallelism itself all-reduces per step (TP's
    row-wise output); anything beyond it after the first step would be an amax collective.
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR)
    per_step, worst, sync = [], [0.0], None
    for step in range(STEPS):
        x, t, x_local, t_local = batch_fn(step)
        opt_ref.zero_grad()
        nn.functional.mse_loss(ref(x), t).backward()
        sync_float8_amax_and_scale_history(ref)
        opt_ref.step()

        opt.zero_grad()
        with count_collectives() as fwd_bwd:
            loss_fn(model(x_local), t_local).backward()
        if SYNC is sync_float8_amax_and_scale_history:
            with count_collectives() as sync:
                SYNC(model)
            assert sync.total_calls == 1 and sync.expect("all_reduce").calls == 1, sync
        else:  # a TorchDispatchMode (the counter) stops torch.compile: not counted
            SYNC(model)
        opt.step()

        if step > 0:  # step 0 with amax init reduces DTensor amaxes once (see delayed.py)
            assert fwd_bwd["all_reduce"].input_bytes == activation_all_reduce_bytes, fwd_bwd
        per_step.append({"fwd_bwd": fwd_bwd.as_dict(), "sync": sync.as_dict() if sync else None})
        _check_buffers(step, model, ref, worst)
    dbs = {
        k: sqnr(v_ref, _full(v))
        for (k, v), v_ref in zip(model.state_dict().items(), ref.state_dict().values())
        if k.endswith(".weight")
    }
    assert min(dbs.values()) >= 60, dbs
    return {"collectives_per_step": per_step, "buffers_max_rel_diff": worst[0], "weight_sqnr_db": dbs}


def _models(config, sizes, seed=0):
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
    plain = nn.Sequential(*layers)
    ref = convert_to_float8_training(copy.deepcopy(plain), config=config)
    return convert_to_float8_training(plain, config=config), ref


def run_fsdp(rank, world, fp8_all_gather):
    # the weight is cast before the all-gather, before a forward could initialize its history
    config = Float8LinearConfig.from_recipe_name("delayed").replace(
        enable_amax_init=False, enable_fsdp_float8_all_gather=fp8_all_gather
    )
    model, ref = _models(config, (32, 64, 32, 16))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    agreement.check_once(model)  # the one-time rank check, outside the counted steps
    g = torch.Generator().manual_seed(1)

    def batch(step):
        x, t = torch.randn(16 * world, 32, generator=g), torch.randn(16 * world, 16, generator=g)
        return x, t, x.chunk(world)[rank], t.chunk(world)[rank]  # global batch, this rank's part

    # Each rank backprops its share of the global-batch loss (sum / global count): its
    # grad_output is its slice of one device's grad_output. FSDP averages gradients over ranks
    # (gloo has no PREMUL_SUM for a divide factor of 1); lr * world restores one device's update,
    # exactly for a power-of-2 world.
    def loss(y, t):
        return nn.functional.mse_loss(y, t, reduction="sum") / (t.numel() * world)

    return _train(model, ref, batch, loss, LR * world)


def run_fsdp_amax_init(rank, world):
    """FSDP2 float8 all-gather with the first-step init ([Note: first step] in f8dist/delayed.py):
    the pre-all-gather cast fills each weight history from the whole weight (one all-reduce per
    weight, first step only), bit-identical to one device's init from the unsharded weight."""
    config = Float8LinearConfig.from_recipe_name("delayed").replace(enable_fsdp_float8_all_gather=True)
    model, ref = _models(config, (32, 64, 32, 16))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    n_weights = 3
    g = torch.Generator().manual_seed(3)
    opt = torch.optim.SGD(model.parameters(), lr=LR * world)
    weight_buffers = ("fp8_amax_history_weight", "fp8_scale_weight")
    forward_all_reduces = []
    for step in range(3):
        x = torch.randn(16 * world, 32, generator=g)
        with count_collectives() as fwd:
            y = model(x.chunk(world)[rank])
        forward_all_reduces.append(fwd["all_reduce"].calls)
        if step == 0:
            ref(x)  # one device: the first forward initializes from the unsharded weight
            for i in (0, 2, 4):
                for name in weight_buffers:
                    v, v_ref = getattr(model[i], name), getattr(ref[i], name)
                    assert v_ref.ne(0).all() and v_ref.ne(1).all(), (name, v_ref)
                    assert_equal(f"first forward, layer {i} {name}", v_ref, v)
            # one all-reduce of 4 bytes per weight, nothing else
            assert fwd["all_reduce"].calls == n_weights, fwd
            assert fwd["all_reduce"].input_bytes == 4 * n_weights, fwd
        y.square().mean().backward()
        sync_float8_amax_and_scale_history(model)
        opt.step()
        opt.zero_grad()
    assert forward_all_reduces == [n_weights, 0, 0], forward_all_reduces
    return {"forward_all_reduces": forward_all_reduces}


def run_tp(world):
    config = Float8LinearConfig.from_recipe_name("delayed")  # with the first-step init
    model, ref = _models(config, (32, 64, 32))
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    g = torch.Generator().manual_seed(2)

    def batch(step):
        x, t = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
        return x, t, x, t

    out_bytes = 16 * 32 * 4  # the row-wise layer's [16, 32] float32 partial sums
    return _train(model, ref, batch, nn.functional.mse_loss, LR, out_bytes)


def run(args):
    global SYNC
    rank, world, _ = init()
    if args.compile_sync:
        SYNC = torch.compile(sync_float8_amax_and_scale_history, fullgraph=True, backend="aot_eager")
    result = {"world": world}
    if "fsdp" in args.scenarios:
        result["fsdp"] = run_fsdp(rank, world, not args.no_fp8_all_gather)
    if "fsdp_amax_init" in args.scenarios:
        result["fsdp_amax_init"] = run_fsdp_amax_init(rank, world)
    if "tp" in args.scenarios:
        result["tp"] = run_tp(world)
    write_result(args, result)


def _args(parser):
    parser.add_argument("--scenarios", nargs="+", default=["fsdp", "fsdp_amax_init", "tp"])
    parser.add_argument("--no-fp8-all-gather", action="store_true")
    parser.add_argument("--compile-sync", action="store_true")


if __name__ == "__main__":
    main(run, _args)
