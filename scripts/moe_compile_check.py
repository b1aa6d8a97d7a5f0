"""torch.compile of an expert-parallel float8 MoE layer against eager, bit for bit.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 scripts/moe_compile_check.py

Prints, per rank and step (each rank an uneven token count, changing between steps), whether
the compiled layer's output, input gradient and expert-weight gradient equal eager's bits, and
the graph breaks dynamo took ([Note: expert parallelism] in f8dist/parallel/ep/dispatch.py: the routing's
bincount, the host read of the all-to-all's split sizes and repeat_interleave have
data-dependent output shapes, so ``fullgraph=True`` cannot hold). Inductor keeps bf16 roundings
(``emulate_precision_casts``) so that the comparison is of bits. Not part of the test suite: it
compiles for minutes on a 2-core CPU.
"""

from __future__ import annotations

import os
import sys

import torch
import torch._dynamo
import torch._inductor.config as inductor_config
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from f8dist import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from f8dist.models.moe import MoE, MoEArgs  # noqa: E402
from f8dist.models.moe_parallel import parallelize_moe  # noqa: E402


def build(mesh, recipe: str) -> MoE:
    moe = MoE(64, 32, MoEArgs(num_experts=2 * mesh.size(), top_k=2))
    moe.init_weights(0.02, torch.Generator().manual_seed(0))
    moe.to(torch.bfloat16)
    convert_to_float8_training(moe, config=Float8LinearConfig.from_recipe_name(recipe))
    return parallelize_moe(moe, mesh)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",))
    inductor_config.emulate_precision_casts = True
    eager, compiled = build(mesh, "rowwise"), build(mesh, "rowwise")
    compiled.compile()
    g = torch.Generator().manual_seed(1 + rank)
    all_equal = True
    for step in range(2):
        x = torch.randn(1, 7 - 5 * (rank % 2) + step, 64, generator=g).to(torch.bfloat16)
        results = []
        for layer in (eager, compiled):
            xi = x.clone().requires_grad_()
            out = layer(xi)
            out.float().square().sum().backward()
            results.append((out, xi.grad, layer.experts.w1.grad.to_local().clone()))
            layer.zero_grad()
        equal = [torch.equal(a, b) for a, b in zip(*results)]
        all_equal &= all(equal)
        print(f"rank {rank} step {step}: output, grad_input, grad_w1 equal: {equal}", flush=True)
    breaks = torch._dynamo.utils.counters["graph_break"]
    if rank == 0:
        print("graph breaks:", *sorted({k.splitlines()[1].strip() for k in breaks}), sep="\n  ",
              flush=True)
    dist.destroy_process_group()
    sys.exit(0 if all_equal else 1)


if __name__ == "__main__":
    main()
