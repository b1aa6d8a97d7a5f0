"""torchrun program: per-op selective activation checkpointing (f8dist/policy/sac.py) of an
expert-parallel float8 MoE transformer under EP x FSDP2 ([Note: SAC around a nested FSDP2 unit]),
against the same model without checkpointing: loss and every gradient bit for bit, and the
all-to-alls of a training step (forward + backward) the same in number and bytes, since SAC
saves their outputs; full checkpointing, which replays the dispatch in backward, is counted
beside them."""

import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from f8dist import Float8LinearConfig, convert_to_float8_training, float8_sac_context_fn
from f8dist.models.llama import ModelArgs
from f8dist.models.moe import MoEArgs, MoETransformer
from f8dist.models.moe_parallel import fully_shard_moe, parallelize_moe
from f8dist.testing import count_collectives
from tests.distributed.common import assert_equal, init, main, write_result


def _model(mesh, ac: str):
    model = MoETransformer(ModelArgs(dim=64, n_layers=2, n_heads=4, max_seq_len=16),
                           MoEArgs(num_experts=4, top_k=2))
    model.init_weights(seed=0)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                               module_filter_fn=lambda mod, fqn: fqn != "output")
    parallelize_moe(model, mesh["ep"])
    for name, block in list(model.layers.items()):
        if ac != "none":
            context = {"context_fn": float8_sac_context_fn} if ac == "sac" else {}
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False, **context)
    return fully_shard_moe(model, mesh)


def run(args):
    rank, world, device = init()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "ep"))
    tokens = torch.randint(0, 256, (world, 17), generator=torch.Generator().manual_seed(0))
    mine = tokens[rank:rank + 1]
    runs = {}
    for ac in ("none", "sac", "full"):
        model = _model(mesh, ac)
        with count_collectives() as counts:
            logits = model(mine[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), mine[:, 1:].flatten())
            (loss + model.aux_loss()).backward()
        grads = {n.replace("_checkpoint_wrapped_module.", ""):
                 p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                 for n, p in model.named_parameters()}
        runs[ac] = (loss.detach(), grads, counts["all_to_all"])
    for ac in ("sac", "full"):
        assert_equal(f"{ac} loss", runs["none"][0], runs[ac][0])
        for name, g in runs["none"][1].items():
            assert_equal(f"{ac} {name}", g, runs[ac][1][name])
    a2a = {ac: {"calls": c.calls, "bytes": c.input_bytes} for ac, (_, _, c) in runs.items()}
    write_result(args, {"world": world, "all_to_all": a2a, "params": len(runs["none"][1])})


if __name__ == "__main__":
    main(run)
