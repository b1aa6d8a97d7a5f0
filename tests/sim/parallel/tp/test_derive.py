"""``sp_grad_weight="derive"`` ([Note: the grad_weight operand of a gathered tensor] in
f8dist/config/cells.py) on 2 simulated ranks: a sequence-parallel colwise -> rowwise pair sends one
float8 cast of the input (forward) and of the gradient (backward), and matches one device that
derives the grad_weight gemm's operands the same way."""

import copy

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from f8dist import Float8LinearConfig, convert_to_float8_training
from f8dist.core.cast import stochastic_rounding
from f8dist.core.numerics import sqnr
from f8dist.parallel.tp import Float8ColwiseParallel, Float8RowwiseParallel
from f8dist.testing import count_collectives
from tests.sim.parallel.tp.test_llama import FLOOR_DB
from tests.sim.threads import run_threads

TP, BATCH, SEQ, DIM = 2, 1, 64, 64  # 32-token sequence shards: whole 32x1 token blocks (mxfp8)


def run(mode, recipe="mxfp8"):
    """Per rank: (SQNRs against one device, all-gather bytes on the wire by dtype)."""
    config = Float8LinearConfig.from_recipe_name(recipe).replace(sp_grad_weight=mode)
    stochastic_rounding.reset()  # as each rank starts ([Note: a run starts as processes do])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False))
    convert_to_float8_training(model, config=config)
    reference = copy.deepcopy(model)
    x = torch.randn(BATCH, SEQ, DIM, requires_grad=True)  # [B, S, D]
    grad = torch.randn(BATCH, SEQ, DIM)  # [B, S, D]
    reference(x).backward(grad)
    models = [copy.deepcopy(model) for _ in range(TP)]

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (TP,))
        m = parallelize_module(models[rank], mesh, {
            "0": Float8ColwiseParallel(input_layouts=Shard(1)),
            "1": Float8RowwiseParallel(output_layouts=Shard(1))})
        x_shard = distribute_tensor(x.detach(), mesh, [Shard(1)]).to_local().requires_grad_()
        seq = slice(rank * SEQ // TP, (rank + 1) * SEQ // TP)
        with count_collectives() as counts:
            out = m(x_shard)  # [B, S / tp, D]
            out.backward(grad[:, seq])
        sqnrs = {"out": sqnr(reference(x)[:, seq].detach(), out.detach()),
                 "grad_input": sqnr(x.grad[:, seq], x_shard.grad)}
        for (name, p), ref in zip(m.named_parameters(), reference.parameters()):
            sqnrs[f"grad:{name}"] = sqnr(ref.grad, p.grad.full_tensor())
        wires = {dtype: w[2] for (_, dtype), w in counts["all_gather"].wires.items()}
        return sqnrs, wires

    return run_threads(TP, rank_main)


def test_derive_sends_one_cast_and_matches_one_device():
    # the forward input and the backward gradient cross once each, as e4m3 row blocks with an e8m0
    # byte per 32: (1 + 1 / 32) bytes per element against bf16's 2 (forward_gather sends 2 casts)
    gathered = 2 * BATCH * SEQ * DIM  # elements: the input forward, the gradient backward
    for sqnrs, wires in run("derive"):
        assert wires == {"uint8": gathered * (1 + 1 / 32)}, wires
        # one device derives the grad_weight gemm's token blocks from the same row blocks: the
        # weight gradients are its bits; the rest differs in the order of fp32 sums across ranks
        assert sqnrs["grad:0.weight"] == sqnrs["grad:1.weight"] == float("inf"), sqnrs
        assert min(sqnrs.values()) >= FLOOR_DB, sqnrs


def test_nvfp4_derive_sends_one_4_bit_cast_and_matches_one_device():
    # NVFP4: one cast of each, packed e2m1 (half a byte an element) with an e4m3 scale byte per
    # 1x16 row block (forward_gather sends 2 casts); the derived 16-token blocks take the recipe's
    # Hadamard transform and (grad_output) stochastic rounding with one device's draws
    gathered = 2 * BATCH * SEQ * DIM
    for sqnrs, wires in run("derive", "nvfp4"):
        assert wires == {"uint8": gathered * (1 / 2 + 1 / 16)}, wires
        assert sqnrs["grad:0.weight"] == sqnrs["grad:1.weight"] == float("inf"), sqnrs
        assert min(sqnrs.values()) >= 120, sqnrs
