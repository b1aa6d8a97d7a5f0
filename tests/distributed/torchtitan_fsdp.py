"""torchtitan's llama3 debug model with f8dist's converter under torchtitan's own FSDP apply
function, on every rank: a few AdamW steps per variant (bf16, each recipe, tensorwise with float8
all-gather and precompute), with the losses and the collectives of each step.

Run by tests/integrations/test_torchtitan.py (torchtitan installed); run by hand, rank 0 prints
the table of docs/torchtitan.md::

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone \
        --nproc_per_node=2 tests/distributed/torchtitan_fsdp.py

It follows the Trainer's build sequence (which needs CUDA): model_registry with the converter, build
on meta, parallelize (apply_fsdp_to_decoder, with the Trainer's bf16 MixedPrecisionPolicy),
to_empty, init_weights, OptimizersContainer, the ModelSpec's post_optimizer_build_fn. FlexAttention
has no CPU backward, so its configs are swapped for SDPA; gloo has no PREMUL_SUM, so FSDP2 reduces
gradients with SUM (torchtitan's divide factor is 1, so nothing changes).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from f8dist.testing import count_collectives
from f8dist.models.data import ByteBatches
from tests.distributed.common import init, main, write_result

STEPS = 4
SEQ_LEN = 32
BATCH = 2  # per rank

VARIANTS = {
    "bf16": None,
    "tensorwise": dict(recipe_name="tensorwise"),
    "rowwise": dict(recipe_name="rowwise"),
    "rowwise_with_gw_hp": dict(recipe_name="rowwise_with_gw_hp"),
    "delayed": dict(recipe_name="delayed"),
    "tensorwise_fp8_all_gather": dict(
        recipe_name="tensorwise", enable_fsdp_float8_all_gather=True,
        precompute_float8_dynamic_scale_for_fsdp=True,
    ),
}


def build(variant: str, mesh):
    """The Trainer's sequence, from model_registry to the post-optimizer-build hooks."""
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    from f8dist.integrations.torchtitan import Float8LinearConverter, with_float8_hooks

    float8 = VARIANTS[variant]
    converters = [] if float8 is None else [
        Float8LinearConverter.Config(filter_fqns=["lm_head"], **float8)]
    spec = with_float8_hooks(model_registry("debugmodel", converters=converters))
    for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    with torch.device("meta"):
        model = spec.model.build()
    model.verify_module_protocol()
    apply_fsdp_to_decoder(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                          pp_enabled=False)
    for module in model.modules():  # gloo has no PREMUL_SUM: reduce with SUM (the factor is 1)
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizers = default_adamw(lr=8e-4).build(model_parts=[model])
    spec.post_optimizer_build_fn(optimizers, [model], None)
    return model, optimizers


def gathered_bytes(model, world: int) -> dict:
    """What one forward all-gathers, from the parameters alone: every parameter's padded shard
    times the world size, in bf16 (2 bytes), or 1 byte for float8 all-gather weights."""
    from f8dist.parallel.fsdp import Float8AllGatherWeight

    total = 0
    for p in model.parameters():
        assert isinstance(p, DTensor)
        rows = math.ceil(p.shape[0] / world) * world
        elements = rows * (p.numel() // p.shape[0])
        total += elements * (1 if isinstance(p._local_tensor, Float8AllGatherWeight) else 2)
    return total


def _per_step(counts: list, kind: str) -> str:
    """One collective kind over the steps: "calls (bytes B)", runs of equal steps merged."""
    cells = []
    for c in counts:
        s = c.get(kind)
        cells.append("0" if s is None else f"{s['calls']} ({s['output_bytes']:,} B)")
    runs = []  # [first step, last step, cell]
    for i, cell in enumerate(cells, 1):
        if runs and runs[-1][2] == cell:
            runs[-1][1] = i
        else:
            runs.append([i, i, cell])
    if len(runs) == 1:
        return runs[0][2]
    return "; ".join(f"step {a}: {c}" if a == b else f"steps {a}-{b}: {c}" for a, b, c in runs)


def table(out: dict) -> str:
    """The markdown table of docs/torchtitan.md: losses per step (the global mean cross-entropy
    per token before each optimizer step), their distance to bf16's, and the collectives."""
    ref = out["bf16"]["losses"]
    steps = " | ".join(f"step {i}" for i in range(1, len(ref) + 1))
    lines = [f"| variant | {steps} | max abs diff vs bf16 | max rel diff vs bf16 | forward "
             "all-gather bytes per step (per rank) | forward all-reduces | optimizer-step "
             "all-reduces |",
             "|---" * (len(ref) + 6) + "|"]
    for variant in VARIANTS:
        r = out[variant]
        losses = " | ".join(f"{x:.4f}" for x in r["losses"])
        diff = [abs(x - y) for x, y in zip(r["losses"], ref)]
        abs_diff, rel_diff = ("-", "-") if variant == "bf16" else (
            f"{max(diff):.4f}", f"{100 * max(d / y for d, y in zip(diff, ref)):.2f}%")
        gathered = sorted({f.get("all_gather", {}).get("output_bytes", 0) for f in r["forward"]})
        lines.append(f"| {variant} | {losses} | {abs_diff} | {rel_diff} | "
                     f"{' / '.join(f'{b:,}' for b in gathered)} | "
                     f"{_per_step(r['forward'], 'all_reduce')} | "
                     f"{_per_step(r['optimizer_step'], 'all_reduce')} |")
    return "\n".join(lines)


def run(args):
    rank, world, device = init()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    out = {"world": world}
    for variant in VARIANTS:
        model, optimizers = build(variant, mesh)
        batches = ByteBatches(seq_len=SEQ_LEN, batch_size=BATCH * world, seed=0, dp_rank=rank,
                              dp_size=world)
        losses, fwd, step = [], [], []
        for _ in range(STEPS):
            inputs, targets = next(batches)
            with count_collectives() as counts:
                logits = model(inputs)  # [B, S, vocab]
            fwd.append(counts.as_dict())
            # torchtitan's normalization: sum over the rank's tokens / global token count
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                   reduction="sum") / (targets.numel() * world)
            loss.backward()
            with count_collectives() as counts:
                optimizers.step()
            step.append(counts.as_dict())
            optimizers.zero_grad()
            global_loss = loss.detach().clone()
            torch.distributed.all_reduce(global_loss)
            losses.append(global_loss.item())
        out[variant] = {"losses": losses, "forward": fwd, "optimizer_step": step,
                        "expected_forward_all_gather_bytes": gathered_bytes(model, world)}
    write_result(args, out, table=table)


if __name__ == "__main__":
    main(run)
