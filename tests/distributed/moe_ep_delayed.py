"""Delayed scaling of the experts under expert parallelism against one device, on every rank of
the launch: an MoE layer in bf16 whose experts (and nothing else) are float8 with the "delayed"
recipe, each rank routing its own uneven slice of each step's batch. Checked for 3 steps, each
followed by ``sync_float8_amax_and_scale_history``: outputs, input and expert-weight gradients,
and every amax history and scale, bit for bit those of one device running the whole batch
([Note: delayed experts] in f8dist/nn/grouped.py: the first step's amaxes reduced over the EP axis
that shards the weights and the tokens, the sync's over all ranks)."""

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh

from f8dist import Float8LinearConfig, convert_to_float8_training, sync_float8_amax_and_scale_history
from f8dist.models.moe import MoE, MoEArgs
from f8dist.models.moe_parallel import parallelize_moe
from tests.distributed.common import assert_equal, init, main, write_result

DIM, HIDDEN, STEPS = 64, 32, 3


def run(args):
    rank, world, device = init()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    ref = MoE(DIM, HIDDEN, MoEArgs(num_experts=2 * world, top_k=2))
    ref.init_weights(0.02, torch.Generator().manual_seed(0))
    ref.to(torch.bfloat16)
    convert_to_float8_training(ref, config=Float8LinearConfig.from_recipe_name("delayed"),
                               module_filter_fn=lambda mod, fqn: fqn == "experts")
    ep = parallelize_moe(copy.deepcopy(ref), mesh)
    sizes = [7 - 5 * (r % 2) for r in range(world)]  # uneven: 7, 2, ... tokens
    start = sum(sizes[:rank])
    mine = slice(start, start + sizes[rank])
    local = slice(rank * 2, rank * 2 + 2)
    g = torch.Generator().manual_seed(1)
    checked = 0
    for step in range(STEPS):
        x = (torch.randn(1, sum(sizes), DIM, generator=g) * 4 ** step).to(torch.bfloat16)
        grad = torch.randn(1, sum(sizes), DIM, generator=g).to(torch.bfloat16)
        outs = []
        for layer, part in ((ref, slice(None)), (ep, mine)):
            xi = x[:, part].clone().requires_grad_()
            out = layer(xi)
            out.backward(grad[:, part])
            outs.append((out, xi.grad))
            sync_float8_amax_and_scale_history(layer)
        (out, gx), (o, gxe) = outs
        assert_equal(f"step {step} output", out[:, mine], o)
        assert_equal(f"step {step} grad_input", gx[:, mine], gxe)
        for w in ("w1", "w2", "w3"):
            assert_equal(f"step {step} {w}.grad", getattr(ref.experts, w).grad[local],
                         getattr(ep.experts, w).grad.to_local())
        for (name, a), (_, b) in zip(ref.experts.named_buffers(), ep.experts.named_buffers()):
            assert_equal(f"step {step} {name}", a, b)
            checked += 1
        ref.zero_grad(), ep.zero_grad()
    write_result(args, {"world": world, "buffers_checked": checked, "steps": STEPS})


if __name__ == "__main__":
    main(run)
