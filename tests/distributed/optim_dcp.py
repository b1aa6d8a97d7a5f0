"""torchrun program (3 ranks): f8dist.optim.AdamW's 8-bit states under FSDP2 and TP, and their
torch.distributed.checkpoint round trips, against one device and against torch.optim.AdamW.

1. ``fsdp2``, ranks 0 and 1: FSDP2 training with 8-bit states, same data on both ranks, is one
   device's bit for bit (every shard is whole blocks); ``optimizer.step()`` runs no
   collective. Saved with DCP at step 3, then 2 more steps.
2. ``resume``, ranks 0 and 1: a fresh model and optimizer load step 3 and take the same 2 steps:
   bit for bit the run that never stopped (decoded states re-encode to the same codes).
3. ``reshard``, 3 ranks: the 2-rank checkpoint loads into FSDP2 on 3 ranks (one rank holds an
   empty shard of one parameter, another parameter splits unevenly), into TP on 3 ranks
   (colwise, rowwise), and into torch.optim.AdamW (fp32 states). torch's AdamW gets the saved
   moments exactly; ours gets them encoded on its new shards: each local moment equals
   encode-then-decode of the same shard of torch's, bit for bit. A step on TP runs no collective.
4. ``from_torch``: torch.optim.AdamW (FSDP2, 3 ranks) steps and saves; ours loads it into TP.
"""

import copy

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel, RowwiseParallel, parallelize_module,
)

from f8dist.optim import AdamW
from f8dist.optim.states import blocks, decode, encode, unblock
from f8dist.testing import count_collectives
from tests.distributed.common import assert_equal, init, main, write_result

DIM, HIDDEN, HEADS, EXTRA = 64, 192, 4, 256
MOMENTS = ("exp_avg", "exp_avg_sq")


class Net(nn.Module):
    """On 2 ranks every FSDP2 shard is whole blocks of 64; on 3 ranks ``head`` splits 2/2/0
    rows (an empty shard) and ``extra`` 86/86/84 elements (partial blocks)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)
        self.head = nn.Linear(DIM, HEADS, bias=False)
        self.extra = nn.Parameter(torch.randn(EXTRA) * 0.1)
        self.register_buffer("mix", torch.arange(EXTRA) / EXTRA, persistent=False)

    def forward(self, x):
        h = self.down(torch.relu(self.up(x)))  # [B, DIM]
        return self.head(h).sum() + h.mean() * (self.extra ** 2 * self.mix).sum()


def make_model(device):
    torch.manual_seed(0)
    return Net().to(device)


def run_steps(model, optimizer, first, count, device, counts=None):
    for step in range(first, first + count):
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(step)).to(device)
        optimizer.zero_grad()
        (model(x) ** 2).backward()
        if counts is None:
            optimizer.step()
        else:
            with count_collectives() as c:
                optimizer.step()
            counts.append(c.as_dict())


def fsdp(model, mesh):
    for name in ("up", "down", "head"):
        fully_shard(getattr(model, name), mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_force_sum_reduction_for_comms(True)  # sum, then divide: one device's arithmetic
    return model


def tp(model, mesh):
    return parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def save(model, optimizer, path, group):
    state = {"model": get_model_state_dict(model),
             "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=path, process_group=group)


def load(model, optimizer, path, group=None):
    state = {"model": get_model_state_dict(model),
             "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])


def moments(model, optimizer):
    """{fqn: {moment: full tensor}} of the optimizer's state dict (DCP's keys)."""
    sd = get_optimizer_state_dict(model, optimizer)["state"]
    return {fqn: {m: full(s[m]) for m in MOMENTS} for fqn, s in sd.items()}


def expected_after_load(model, optimizer, saved):
    """Each parameter's moments as ours must hold them: the saved full moment, sharded like the
    parameter, encoded on this rank's shard and decoded."""
    params = dict(model.named_parameters())
    for fqn, entry in get_optimizer_state_dict(model, optimizer)["state"].items():
        p = params[fqn]
        for m in MOMENTS:
            local_saved = saved[fqn][m]
            if hasattr(p, "device_mesh"):  # a plain parameter (TP's head) holds all of it
                local_saved = distribute_tensor(local_saved, p.device_mesh, p.placements).to_local()
            fmt = optimizer.param_groups[0][f"{m}_format"]
            block = optimizer.param_groups[0]["block_size"]
            want = unblock(decode(encode(local_saved, fmt, block)), local_saved.numel())
            got = entry[m].to_local() if hasattr(entry[m], "to_local") else entry[m]
            assert_equal(f"{fqn}.{m}", want.view(local_saved.shape), got)


def run(args):
    rank, world, device = init()
    assert world == 3, "optim_dcp runs on 3 ranks"
    out = {}
    ckpt, ckpt_torch = f"{args.ckpt_dir}/eight_bit", f"{args.ckpt_dir}/torch"
    pair = DeviceMesh(device.type, [0, 1])  # every rank makes it; ranks 0 and 1 use it
    pair_group = pair.get_group() if rank < 2 else None
    mesh = DeviceMesh(device.type, list(range(world)))

    # 1. FSDP2 on 2 ranks against one device; no collective in a step; save at step 3
    if rank < 2:
        ref = make_model(device)
        ref_opt = AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        model = fsdp(copy.deepcopy(ref), pair)
        optimizer = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        counts = []
        run_steps(ref, ref_opt, 0, 3, device)
        run_steps(model, optimizer, 0, 3, device, counts)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_equal(f"fsdp2 {name}", q.detach(), full(p).detach())
        out["fsdp2_step_collectives"] = counts
        out["fsdp2_moments_at_save"] = {k: {m: v.tolist() for m, v in d.items()}
                                        for k, d in moments(model, optimizer).items()}
        save(model, optimizer, ckpt, pair_group)
        run_steps(model, optimizer, 3, 2, device)
        straight = [full(p).detach().clone() for p in model.parameters()]

        # 2. resume on the same 2 ranks: bit for bit the run that never stopped
        resumed = fsdp(make_model(device), pair)
        resumed_opt = AdamW(resumed.parameters(), lr=5.0)
        load(resumed, resumed_opt, ckpt, pair_group)
        run_steps(resumed, resumed_opt, 3, 2, device)
        for (name, p), q in zip(resumed.named_parameters(), straight):
            assert_equal(f"resumed {name}", q, full(p).detach())
    dist.barrier()

    # 3. reshard the 2-rank checkpoint: torch's AdamW (FSDP2, 3 ranks) gets it exactly
    torch_model = fsdp(make_model(device), mesh)
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-2, weight_decay=0.1)
    load(torch_model, torch_opt, ckpt)
    saved = moments(torch_model, torch_opt)
    out["reshard_saved_moments"] = {k: {m: v.tolist() for m, v in d.items()}
                                    for k, d in saved.items()}
    out["head_shard_rows"] = [torch_model.head.weight.to_local().shape[0]]
    out["extra_shard_numel"] = [torch_model.extra.to_local().numel()]

    # ... and ours on FSDP2 (3 ranks) and on TP (3 ranks) gets it encoded on its own shards
    for layout, wrap in (("fsdp2", fsdp), ("tp", tp)):
        model = wrap(make_model(device), mesh)
        optimizer = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        load(model, optimizer, ckpt)
        expected_after_load(model, optimizer, saved)
        if layout == "tp":
            counts = []
            run_steps(model, optimizer, 3, 1, device, counts)
            out["tp_step_collectives"] = counts

    # 4. torch's AdamW steps and saves; ours loads it into TP
    run_steps(torch_model, torch_opt, 3, 1, device)
    save(torch_model, torch_opt, ckpt_torch, None)
    after = moments(torch_model, torch_opt)
    model = tp(make_model(device), mesh)
    optimizer = AdamW(model.parameters(), lr=1e-2)
    load(model, optimizer, ckpt_torch)
    expected_after_load(model, optimizer, after)
    out["world"] = world
    write_result(args, out)


if __name__ == "__main__":
    main(run, extra_args=lambda p: p.add_argument("--ckpt-dir", required=True))
