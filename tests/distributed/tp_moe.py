"""torchrun program: tensor (+ sequence) parallel attention in the float8 MoE transformer
([Note: MoE under tensor parallelism] in f8dist/models/moe_parallel.py) against one device running
the same float8 model: the logits, the load-balancing loss and every parameter's gradient, by
SQNR floors in fp32 (the attention's row-sharded wo sums over the tp ranks in another order; the
MoE runs the whole sequence on every TP rank). With ``--dp 2`` FSDP2 shards the blocks over dp on
top (2-D), each dp rank its own sequence; the reference accumulates the dp ranks' losses."""

import copy

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from f8dist import Float8LinearConfig, convert_to_float8_training
from f8dist.models import parallelize_llama
from f8dist.models.llama import ModelArgs
from f8dist.models.moe import MoEArgs, MoETransformer
from f8dist.models.moe_parallel import moe_tp_plan
from f8dist.testing import count_collectives
from tests.distributed.common import init, main, sqnr, write_result


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    ce = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    return logits, ce, model.aux_loss()


def run(args):
    rank, world, device = init()
    dp = args.dp
    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    ref = MoETransformer(ModelArgs(dim=64, n_layers=2, n_heads=4, max_seq_len=16),
                         MoEArgs(num_experts=4, top_k=2))
    ref.init_weights(seed=0)
    convert_to_float8_training(ref, config=Float8LinearConfig.from_recipe_name(args.recipe),
                               module_filter_fn=lambda mod, fqn: fqn != "output")
    model = copy.deepcopy(ref)
    parallelize_llama(model, mesh["tp"], float8=True, ffn_plan=moe_tp_plan)
    if dp > 1:
        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    tokens = torch.randint(0, 256, (dp, 17), generator=torch.Generator().manual_seed(0))
    d = mesh["dp"].get_local_rank()
    with count_collectives() as counts:
        logits, ce, aux = _loss(model, tokens[d:d + 1])
    (ce + aux).backward()  # FSDP2 averages the gradients over dp
    # one device: the mean over the dp ranks' losses, each rank's sequence a batch of its own
    # (the load-balancing loss is a statistic of its batch)
    for i in range(dp):
        ref_logits, ref_ce, ref_aux = _loss(ref, tokens[i:i + 1])
        ((ref_ce + ref_aux) / dp).backward()
        if i == d:
            floors = {"logits": sqnr(ref_logits, logits), "aux_loss": sqnr(ref_aux, aux)}
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        if dp > 1 and not isinstance(p.grad, DTensor):
            raise AssertionError(f"{name}: FSDP2 left a plain gradient")
        floors[name] = sqnr(grads[name].grad, g)
    write_result(args, {"world": world, "dp": dp, "sqnr_db": floors,
                        "all_gather_calls": counts["all_gather"].calls})


def _args(parser):
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--recipe", default="tensorwise")


if __name__ == "__main__":
    main(run, _args)
