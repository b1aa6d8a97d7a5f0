"""torchrun program: FSDP2 float8 gradient reduce-scatter (f8dist/parallel/fsdp/reduce_scatter.py) against
FSDP2's own reduction of the same gradients.

Scenarios (comma-separated ``--scenarios``), each rank on its own data:

* ``grads``: one backward under each reduction setting (mean, force-sum, divide factor 1 and 4,
  bf16 reduce dtype): every sharded gradient against FSDP2's own reduction (SQNR), the counted
  collectives (one uint8 all-to-all per FSDP unit, no reduce-scatter) and the sum/mean ratio;
* ``bytes``: backward bytes put into the collectives: float8 all-to-all vs FSDP2's bf16 and fp32
  reduce-scatters;
* ``train``: short AdamW runs of a float8 model (float8 all-gather too): float8 vs bf16 vs fp32
  gradient reduction, losses per step;
* ``train_script``: scripts/train.py with and without ``--float8-reduce-scatter``;
* ``disagree``: ranks passing different configs fail at enable time, on every rank.

The model is fsdp_float8's Net: on 3 ranks its shards are uneven (fc1: 43/43/42 rows) and one is
empty (head: 2/2/0 rows).
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from f8dist import Float8LinearConfig, convert_to_float8_training
from f8dist.testing import count_collectives
from f8dist.parallel.fsdp import Float8ReduceScatterConfig, enable_float8_reduce_scatter
from tests.distributed.common import main, run_scenarios, scenario_args, sqnr
from tests.distributed.fsdp_float8 import HEAD, VOCAB, Net

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts")

# name -> (MixedPrecisionPolicy kwargs, FSDPModule setter calls). A divide factor makes FSDP2 pass
# PREMUL_SUM(1 / factor) to the reduce-scatter, which gloo's own cannot run: the reference then
# reduces with SUM and lets FSDP2 divide afterwards (force-sum), the same arithmetic.
SETTINGS = {
    "mean": ({}, {}),
    "force_sum": ({}, {"set_force_sum_reduction_for_comms": True}),
    "divide_by_1": ({}, {"set_gradient_divide_factor": 1.0}),
    "divide_by_4": ({}, {"set_gradient_divide_factor": 4.0}),
    "bf16_reduce": ({"reduce_dtype": torch.bfloat16}, {}),
}
FORCE_SUM = {"set_force_sum_reduction_for_comms": True}
UNITS = 3  # fc1, fc2, root


def shard(model, mp=None, setters=None):
    kw = {} if mp is None else {"mp_policy": MixedPrecisionPolicy(**mp)}
    for unit in (model.fc1, model.fc2, model):
        fully_shard(unit, **kw)
    for unit in (model.fc1, model.fc2, model):
        for name, value in (setters or {}).items():
            getattr(unit, name)(value)
    return model


def batch(device, rank, step, rows=4):
    """(tokens, targets), different on every rank: the target is token % HEAD, but a random class
    for 30 % of the tokens, so the loss settles at the labels' entropy, not at 0."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (rows, 8), generator=g)  # [B, S]
    noisy = torch.rand(rows, 8, generator=g) < 0.3
    targets = torch.where(noisy, torch.randint(0, HEAD, (rows, 8), generator=g), tokens % HEAD)
    return tokens.to(device), targets.to(device)


def loss_fn(model, data):
    tokens, targets = data
    logits = model(tokens)  # [B, S, HEAD]
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def full_grads(model):
    return [p.grad.full_tensor() for p in model.parameters()]


def grads(device, rank, out):
    torch.manual_seed(0)
    base = Net().to(device)
    x = batch(device, rank, 0)
    result = {}
    for name, (mp, setters) in SETTINGS.items():
        ref_setters = {**setters, **FORCE_SUM} if "divide" in name else setters
        ref = shard(copy.deepcopy(base), mp, ref_setters)
        f8 = shard(copy.deepcopy(base), mp, setters)
        if enable_float8_reduce_scatter(f8) != UNITS:
            raise AssertionError("expected the comm on 3 FSDP units")
        loss_fn(ref, x).backward()
        with count_collectives() as counts:
            loss_fn(f8, x).backward()
        a2a = counts.expect("all_to_all")
        if counts["reduce_scatter"].calls or a2a.calls != UNITS:
            raise AssertionError(f"{name}: expected {UNITS} all-to-alls, no reduce-scatter: {counts}")
        ref_grads, f8_grads = full_grads(ref), full_grads(f8)
        for (pname, _), g_ref, g in zip(base.named_parameters(), ref_grads, f8_grads):
            if g.dtype != g_ref.dtype or g.shape != g_ref.shape:
                raise AssertionError(f"{name} {pname}: {g.dtype}{tuple(g.shape)} vs "
                                     f"{g_ref.dtype}{tuple(g_ref.shape)}")
        per_param = {pname: sqnr(g_ref, g)
                     for (pname, _), g_ref, g in zip(base.named_parameters(), ref_grads, f8_grads)}
        per_param["all"] = sqnr(torch.cat([g.flatten() for g in ref_grads]),
                                torch.cat([g.flatten() for g in f8_grads]))
        result[name] = {"sqnr_db": per_param, "grads": f8_grads}
    # sum vs mean: the same float8 payloads, the fp32 sum scaled differently
    world = dist.get_world_size()
    ratios = {}
    for name in ("force_sum", "divide_by_1", "divide_by_4"):
        expected = {"force_sum": 1.0, "divide_by_1": world, "divide_by_4": world / 4}[name]
        worst = 0.0
        for g_mean, g in zip(result["mean"]["grads"], result[name]["grads"]):
            worst = max(worst, ((g - g_mean * expected).abs().max() /
                                g_mean.abs().max().clamp(min=1e-30) / expected).item())
        ratios[name] = worst
    out["grads_sqnr_db"] = {name: r["sqnr_db"] for name, r in result.items()}
    out["sum_vs_mean_max_rel_err"] = ratios
    rows = [None] * world
    dist.all_gather_object(rows, [f8.fc1.weight.to_local().shape[0], f8.head.weight.to_local().shape[0]])
    out["shard_rows_fc1_head"] = rows


def backward_bytes(device, rank, reduce_dtype, float8):
    torch.manual_seed(0)
    model = shard(Net().to(device), {"reduce_dtype": reduce_dtype})
    if float8:
        enable_float8_reduce_scatter(model)
    loss_fn(model, batch(device, rank, 0)).backward()  # FSDP2's lazy init, uncounted
    with count_collectives() as counts:
        loss_fn(model, batch(device, rank, 1)).backward()
    return counts.as_dict()


def bytes_ratio(device, rank, out):
    fp32 = backward_bytes(device, rank, torch.float32, False)
    bf16 = backward_bytes(device, rank, torch.bfloat16, False)
    f8 = backward_bytes(device, rank, torch.float32, True)
    out["bytes"] = {"fp32": fp32, "bf16": bf16, "float8": f8}


def train_runs(device, rank, out, steps=20):
    """float8 linears with float8 all-gather (the full float8 wire), three gradient reductions."""
    curves = {}
    for name in ("fp32", "bf16", "float8"):
        torch.manual_seed(0)
        model = convert_to_float8_training(
            Net().to(device), config=Float8LinearConfig(enable_fsdp_float8_all_gather=True,
                                                        pad_inner_dim=True))
        reduce_dtype = torch.bfloat16 if name == "bf16" else torch.float32
        shard(model, {"reduce_dtype": reduce_dtype})
        if name == "float8":
            enable_float8_reduce_scatter(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(steps):
            loss = loss_fn(model, batch(device, rank, step, rows=8))
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / dist.get_world_size())
        curves[name] = losses
    out["train"] = curves


def train_script(out):
    sys.path.insert(0, os.path.abspath(SCRIPTS))
    import train

    flags = ["--steps", "12", "--dim", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "32",
             "--batch-size", "6", "--warmup-steps", "3", "--log-every", "100", "--float8",
             "tensorwise", "--float8-all-gather"]
    plain = train.train(train.parse_args(flags))
    with count_collectives() as counts:
        f8 = train.train(train.parse_args([*flags, "--float8-reduce-scatter"]))
    out["train_script"] = {"plain": plain["losses"], "float8_reduce_scatter": f8["losses"],
                           "collectives": counts.as_dict()}


def disagree(device, rank, out):
    model = shard(Net().to(device))
    config = Float8ReduceScatterConfig(block_size=128 if rank == 0 else 256)
    try:
        enable_float8_reduce_scatter(model, config=config)
    except RuntimeError as e:  # f8dist.core.agreement names the difference
        out["disagree_error"] = str(e)
    else:
        raise AssertionError("ranks with different configs were not caught")


def run(args):
    def table(rank, world, device, out):
        return {
            "disagree": lambda: disagree(device, rank, out),
            "grads": lambda: grads(device, rank, out),
            "bytes": lambda: bytes_ratio(device, rank, out),
            "train": lambda: train_runs(device, rank, out),
            "train_script": lambda: train_script(out),
        }

    run_scenarios(args, table)


if __name__ == "__main__":
    main(run, scenario_args)
