"""EP x FSDP2 (f8dist/models/moe_parallel.py, [Note: EP x FSDP2]) on a (dp_shard, ep) mesh
against one device running the whole batch: a float8 (rowwise) MoE transformer, each rank
training on its own sequence. Checked here: the logits of each rank's sequence and every
parameter's gradient (mean over the batch, as one device's loss) within float32 summation order
(SQNR floors: the experts' gradients are bf16), and that the expert weights are sharded over both mesh dims."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from f8dist import Float8LinearConfig, convert_to_float8_training
from f8dist.models.llama import ModelArgs
from f8dist.models.moe import MoETransformer, MoEArgs
from f8dist.models.moe_parallel import fully_shard_moe, parallelize_moe
from tests.distributed.common import init, main, sqnr, write_result


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    ce = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    return logits, ce + model.aux_loss()


def run(args):
    rank, world, device = init()
    ep = 2
    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("dp_shard", "ep"))
    ref = MoETransformer(ModelArgs(dim=64, n_layers=1, n_heads=4, max_seq_len=16),
                         MoEArgs(num_experts=4, top_k=2, aux_loss_coef=0.0))
    ref.init_weights(seed=0)
    convert_to_float8_training(ref, config=Float8LinearConfig.from_recipe_name("rowwise"),
                               module_filter_fn=lambda mod, fqn: fqn != "output")
    model = copy.deepcopy(ref)
    parallelize_moe(model, mesh["ep"])
    fully_shard_moe(model, mesh)
    w1 = model.layers["0"].moe.experts.w1
    assert isinstance(w1, DTensor) and w1.to_local().shape == (2, w1.shape[1] // 2, 64), w1

    tokens = torch.randint(0, 256, (world, 17), generator=torch.Generator().manual_seed(0))
    ref_logits, ref_loss = _loss(ref, tokens)
    ref_loss.backward()
    logits, loss = _loss(model, tokens[rank:rank + 1])
    loss.backward()

    floors = {"logits": sqnr(ref_logits[rank:rank + 1], logits)}
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        floors[name] = sqnr(grads[name].grad, g)
    worst = min(floors.values())
    # the experts' weight gradients leave the grouped gemm in bf16 ([Note: grouped gemm
    # constraints] in f8dist/core/gemm.py): the ranks' bf16 partial sums, summed in float32,
    # against one device's bf16 sum; every other gradient is a float32 sum in another order
    assert all(v > (45 if ".experts." in k else 100) for k, v in floors.items()), floors
    # what a DCP checkpoint holds: plain tensors (DTensor shards of them), no float8 subclass
    state = get_model_state_dict(model)
    kinds = {type(v.to_local() if isinstance(v, DTensor) else v).__name__ for v in state.values()}
    write_result(args, {"world": world, "min_sqnr_db": worst, "sqnr_db": floors,
                        "state_dict_local_types": sorted(kinds)})


if __name__ == "__main__":
    main(run)
