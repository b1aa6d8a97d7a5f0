"""torchrun program: delayed scaling on 2 ranks against one device.

Scenarios in one process group, each against the same float8 model run unsharded on one device
(every rank runs that reference too):

* ``fsdp``: FSDP2 with the default config (first-step amax init), float8 all-gather of the
  delayed weights off and on, different data per rank; the reference sees the global batch, on
  the first step as the ranks' micro-batches accumulated (each casts from its own amax).
* ``fsdp_eval``: FSDP2 float8 all-gather with an evaluation forward after every step, every
  linear in the root unit (which FSDP2 leaves unsharded after a forward without backward), with
  and without ``reshard_after_forward``: the evaluation moves no training state.
* ``fsdp_init_off``: the same with ``enable_amax_init=False`` and float8 all-gather (scale 1.0 on
  the first step, decided against the amax of the whole weight and the global batch).
* ``tp``: PyTorch's ColwiseParallel / RowwiseParallel on Float8Linear, same data on every rank;
  the row-wise layer's input and the column-wise layer's grad_output are activations sharded over
  the ranks, recorded per rank and made global by the sync.
* ``mismatch``: rank 0 holds two delayed layers, rank 1 one (as pipeline stages would): the first
  step runs no collective, the first sync raises an error that names the fix; with
  ``set_amax_group`` (one group per rank) they train.

Checked after every sync: the histories, scales and amaxes equal the reference's (bit-identical
on the first step, before any weight update; rtol 1e-5 later, where only summation order
differs); the sync ran one all-reduce of 8 bytes per delayed operand (the amax and the
out-of-range flag), plus, on the first sync, the 16-byte check that the ranks hold the same layers;
forward + backward ran no all-reduce after the first step (no amax collective), and on the first
step only the 4-byte reductions of the amaxes of sharded tensors (the weights all-gathered in
float8, TP's sharded activations): none under FSDP2 without float8 all-gather. At the end the weights are >= the
floor against the reference (FSDP: 120 dB, only summation order differs; TP: 60 dB).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from f8dist import Float8LinearConfig, convert_to_float8_training, sync_float8_amax_and_scale_history
from f8dist.core import agreement
from f8dist.policy.delayed import set_amax_group
from f8dist.testing import count_collectives
from tests.distributed.common import assert_equal, init, main, sqnr, write_result

STEPS = 5
LR = 0.1
DELAYED = Float8LinearConfig.from_recipe_name("delayed")
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


def _evaluate(model, x):
    """An evaluation forward, as a training loop makes between steps."""
    model.eval()
    with torch.no_grad():
        model(x)
    model.train()


def _train(model, ref, batch_fn, loss_fn, lr, floor_db, activation_all_reduce_bytes=0,
           evaluate=False, micro_batches=1):
    """STEPS steps of model and ref; returns per-step collective counts and the figures.
    ``evaluate``: an evaluation forward of both after every step.

    ``activation_all_reduce_bytes``: what the parallelism itself all-reduces per step (TP's
    row-wise output); anything beyond it after the first step would be an amax collective.
    ``micro_batches``: on the first step the reference accumulates the global batch in that many
    parts, one per data-parallel rank ([Note: first step] in f8dist/delayed.py).
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR)
    n_operands = 3 * sum(1 for m in model.modules() if getattr(m, "delayed", None) is not None)
    per_step, worst, sync = [], [0.0], None
    for step in range(STEPS):
        x, t, x_local, t_local = batch_fn(step)
        opt_ref.zero_grad()
        for xc, tc in zip(x.chunk(micro_batches if step == 0 else 1), t.chunk(micro_batches if step == 0 else 1)):
            (nn.functional.mse_loss(ref(xc), tc, reduction="sum") / t.numel()).backward()
        sync_float8_amax_and_scale_history(ref)
        opt_ref.step()

        opt.zero_grad()
        with count_collectives() as fwd_bwd:
            loss_fn(model(x_local), t_local).backward()
        if SYNC is sync_float8_amax_and_scale_history:
            with count_collectives() as sync:
                SYNC(model)
            ar = sync.expect("all_reduce")
            check = (1, 16) if step == 0 else (0, 0)  # the layer check of the first sync
            assert (sync.total_calls, ar.calls, ar.input_bytes) == (
                1 + check[0], 1 + check[0], 8 * n_operands + check[1]), (step, sync)
        else:  # a TorchDispatchMode (the counter) stops torch.compile: not counted
            SYNC(model)
        opt.step()

        extra = fwd_bwd["all_reduce"].input_bytes - activation_all_reduce_bytes
        if step > 0:
            assert extra == 0, (step, fwd_bwd)
        else:  # the first-step amaxes of sharded tensors: 4 bytes each
            assert extra % 4 == 0, fwd_bwd
        per_step.append({"fwd_bwd": fwd_bwd.as_dict(), "sync": sync.as_dict() if sync else None})
        _check_buffers(step, model, ref, worst)
        if evaluate:  # after the check: state_dict() makes FSDP2 reshard
            _evaluate(ref, x)
            _evaluate(model, x_local)
    dbs = {
        k: sqnr(v_ref, _full(v))
        for (k, v), v_ref in zip(model.state_dict().items(), ref.state_dict().values())
        if k.endswith(".weight")
    }
    assert min(dbs.values()) >= floor_db, dbs
    return {"collectives_per_step": per_step, "buffers_max_rel_diff": worst[0], "weight_sqnr_db": dbs}


def _models(config, sizes, seed=0):
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
    plain = nn.Sequential(*layers)
    ref = convert_to_float8_training(copy.deepcopy(plain), config=config)
    return convert_to_float8_training(plain, config=config), ref


def run_fsdp(rank, world, config, evaluate=False, reshard_after_forward=True):
    """``evaluate``: an evaluation forward after every step, with every linear in the root unit,
    whose parameters FSDP2 keeps unsharded after it (issue 23 item 7)."""
    model, ref = _models(config, (32, 64, 32, 16))
    for layer in model:
        if isinstance(layer, nn.Linear) and not evaluate:
            fully_shard(layer)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
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

    return _train(model, ref, batch, loss, LR * world, floor_db=120, evaluate=evaluate,
                  micro_batches=world)


def run_tp(world):
    model, ref = _models(DELAYED, (32, 64, 32))  # with the first-step amax init
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    g = torch.Generator().manual_seed(2)

    def batch(step):
        x, t = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
        return x, t, x, t

    out_bytes = 16 * 32 * 4  # the row-wise layer's [16, 32] float32 partial sums
    return _train(model, ref, batch, nn.functional.mse_loss, LR, 60, out_bytes)


def run_mismatch(rank):
    """Ranks holding different delayed layers: clear errors, not a hang; a group per rank works."""
    def model_of(config):
        torch.manual_seed(0)
        sizes = (32, 64, 16) if rank == 0 else (32, 16)
        return _models(config, sizes)[0]

    def step(model):
        model(torch.randn(16, 32)).sum().backward()
        sync_float8_amax_and_scale_history(model)

    messages = {}
    model = model_of(DELAYED)
    with count_collectives() as first_step:
        model(torch.randn(16, 32)).sum().backward()
    messages["first_step_collectives"] = first_step.total_calls
    try:
        sync_float8_amax_and_scale_history(model)
    except RuntimeError as e:
        messages["first_sync"] = str(e)
    own_group, _ = dist.new_subgroups(group_size=1)
    model = model_of(DELAYED)
    set_amax_group(model, own_group)  # no rank waits for the other
    for _ in range(2):
        step(model)
    messages["trained_with_own_group"] = bool(model[0].delayed.synced)
    set_amax_group(model, None)  # back to all ranks: the sync's layer check fails
    try:
        step(model)
    except RuntimeError as e:
        messages["sync"] = str(e)
    return messages


def run(args):
    global SYNC
    rank, world, _ = init()
    if args.compile_sync:
        SYNC = torch.compile(sync_float8_amax_and_scale_history, fullgraph=True, backend="aot_eager")
    result = {"world": world}
    if "fsdp" in args.scenarios:
        result["fsdp"] = run_fsdp(rank, world, DELAYED)
        result["fsdp_fp8_all_gather"] = run_fsdp(
            rank, world, DELAYED.replace(enable_fsdp_float8_all_gather=True))
    if "fsdp_eval" in args.scenarios:
        ag = DELAYED.replace(enable_fsdp_float8_all_gather=True)
        for reshard in (True, False):
            result[f"fsdp_eval_reshard_{reshard}"] = run_fsdp(
                rank, world, ag, evaluate=True, reshard_after_forward=reshard)
    if "fsdp_init_off" in args.scenarios:
        result["fsdp_init_off"] = run_fsdp(rank, world, DELAYED.replace(
            enable_amax_init=False, enable_fsdp_float8_all_gather=True))
    if "tp" in args.scenarios:
        result["tp"] = run_tp(world)
    if "mismatch" in args.scenarios:
        result["mismatch"] = run_mismatch(rank)
    write_result(args, result)


def _args(parser):
    parser.add_argument("--scenarios", nargs="+", default=["fsdp", "fsdp_eval", "fsdp_init_off", "tp", "mismatch"])
    parser.add_argument("--compile-sync", action="store_true")


if __name__ == "__main__":
    main(run, _args)
