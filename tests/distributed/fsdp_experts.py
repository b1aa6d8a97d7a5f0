"""torchrun program: FSDP2 float8 all-gather of expert weights ([Note: float8 all-gather of expert
weights] in f8dist/core/weight.py) against one device and against the high-precision all-gather.

Scenarios (``--scenario``):

* ``fsdp`` (2 ranks): an MoE layer whose experts FSDP2 shards on the experts dim, the same batch
  on every rank: outputs and every gradient bit-identical to one device;
* ``ep_fsdp`` (4 ranks, a 2 x 2 (dp_shard, ep) mesh, [Note: EP x FSDP2]): an MoE transformer
  whose experts FSDP2 shards on dim 1, each EP rank its own sequence (the same in both dp_shard
  groups): logits and the experts' gradients bit-identical to one device running the EP group's
  batch, every output and gradient bit-identical to the same model all-gathered in high precision.

Both count the bytes of the experts' own all-gather (``unshard()`` of their FSDP2 unit), float8
against bf16 (``MixedPrecisionPolicy(param_dtype=bf16)``), and the amax all-reduce.
``--recipe`` (``ep_fsdp``): the experts' recipe, with dims whose dim-1 shards hold whole blocks.
"""

import copy

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from f8dist import Float8LinearConfig, convert_to_float8_training
from f8dist.parallel.fsdp import Float8AllGatherWeight
from f8dist.models.llama import ModelArgs
from f8dist.models.moe import MoE, MoEArgs, MoETransformer
from f8dist.models.moe_parallel import fully_shard_moe, parallelize_moe
from f8dist.testing import count_collectives
from tests.distributed.common import assert_equal, init, main, sqnr, write_result

DIM, HIDDEN, EXPERTS = 64, 32, 4
# recipe -> (dim, hidden) of the ep_fsdp scenario: dp_shard's shards of dim 1 hold whole blocks
DIMS = {"tensorwise": (DIM, HIDDEN), "delayed": (DIM, HIDDEN), "mxfp8_square_weights": (64, 64),
        "blockwise": (256, 256)}


def _config(float8_all_gather: bool, recipe: str = "tensorwise") -> Float8LinearConfig:
    return Float8LinearConfig.from_recipe_name(recipe).replace(
        enable_fsdp_float8_all_gather=float8_all_gather)


def _grads(model):
    return {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            for n, p in model.named_parameters()}


def _all_gather_bytes(experts) -> dict:
    """Bytes of the experts' FSDP2 all-gather (and its amax all-reduce) on this rank."""
    with count_collectives() as counts:
        experts.unshard()
    experts.reshard()
    return {"all_gather": counts.expect("all_gather").output_bytes,
            "all_reduce": counts["all_reduce"].output_bytes}


def _bytes(shard_experts, recipe: str = "tensorwise") -> dict:
    """float8 vs bf16 all-gather bytes of the experts' unit, sharded by ``shard_experts``."""
    out = {}
    for name, fp8, mp in (("float8", True, MixedPrecisionPolicy()),
                          ("bf16", False, MixedPrecisionPolicy(param_dtype=torch.bfloat16))):
        moe = MoE(*DIMS[recipe], MoEArgs(num_experts=EXPERTS, top_k=2, shared_expert=False))
        moe.init_weights(0.02, torch.Generator().manual_seed(0))
        convert_to_float8_training(moe, config=_config(fp8, recipe))
        out[name] = _all_gather_bytes(shard_experts(moe, mp))
    return out


def fsdp(world: int) -> dict:
    ref = MoE(DIM, HIDDEN, MoEArgs(num_experts=EXPERTS, top_k=2))
    ref.init_weights(0.02, torch.Generator().manual_seed(0))
    convert_to_float8_training(ref, config=_config(True))
    assert isinstance(ref.experts.w1, Float8AllGatherWeight), type(ref.experts.w1)
    model = copy.deepcopy(ref)
    fully_shard(model.experts)  # Shard(0): the experts dim
    fully_shard(model)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, DIM, generator=g)  # the same batch on every rank
    grad = torch.randn(2, 9, DIM, generator=g)
    outs = []
    for m in (ref, model):
        xi = x.clone().requires_grad_()
        out = m(xi)
        out.backward(grad)
        outs.append((out, xi.grad))
    assert_equal("output", outs[0][0], outs[1][0])
    assert_equal("grad_input", outs[0][1], outs[1][1])
    ref_grads = _grads(ref)
    for name, g in _grads(model).items():
        assert_equal(name, ref_grads[name], g)

    def shard(moe, mp):
        fully_shard(moe.experts, mp_policy=mp)
        return moe.experts
    return {"world": world, "bytes": _bytes(shard), "checked": sorted(ref_grads)}


def _transformer(float8_all_gather: bool, recipe: str) -> MoETransformer:
    dim, hidden = DIMS[recipe]
    model = MoETransformer(ModelArgs(dim=dim, n_layers=1, n_heads=4, max_seq_len=16),
                           MoEArgs(num_experts=EXPERTS, top_k=2, aux_loss_coef=0.0,
                                   hidden_dim=hidden))
    model.init_weights(seed=0)
    # only the experts in float8: a tensorwise activation scale of a data-parallel linear follows
    # each rank's batch (a per-expert token group's sees the expert's whole group, as on one device)
    convert_to_float8_training(model, config=_config(float8_all_gather, recipe),
                               module_filter_fn=lambda mod, fqn: "experts" in fqn)
    return model


def _loss(model, tokens):
    logits = model(tokens[:, :-1])  # [B, 16, vocab]: the mean over 16 tokens scales exactly
    return logits, F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def ep_fsdp(world: int, recipe: str) -> dict:
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "ep"))
    ep = mesh["ep"].get_local_rank()
    ref = _transformer(True, recipe)
    runs = {}
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    for fp8 in (True, False):
        model = fully_shard_moe(parallelize_moe(_transformer(fp8, recipe), mesh["ep"]), mesh)
        w1 = model.layers["0"].moe.experts.w1
        assert w1.to_local().shape == (EXPERTS // 2, w1.shape[1] // 2, w1.shape[2]), w1.shape
        logits, loss = _loss(model, tokens[ep:ep + 1])  # each EP rank its own sequence
        loss.backward()
        runs[fp8] = (logits, _grads(model))
    ref_logits, ref_loss = _loss(ref, tokens)  # the EP group's batch on one device
    ref_loss.backward()
    assert_equal("logits vs one device", ref_logits[ep:ep + 1], runs[True][0])
    assert_equal("logits vs high-precision all-gather", runs[False][0], runs[True][0])
    ref_grads, floors = _grads(ref), {}
    for name, g in runs[True][1].items():
        assert_equal(f"{name} vs high-precision all-gather", runs[False][1][name], g)
        if ".experts." in name:  # each expert's tokens, in one device's order
            assert_equal(f"{name} vs one device", ref_grads[name], g)
        else:  # summed over the ranks in another order
            floors[name] = sqnr(ref_grads[name], g)
    assert min(floors.values()) > 100, floors

    def shard(moe, mp):  # the experts' unit of fully_shard_moe: Shard(1) over dp_shard
        parallelize_moe(moe, mesh["ep"])
        fully_shard(moe.experts, mesh=mesh["dp_shard"], shard_placement_fn=lambda p: Shard(1),
                    mp_policy=mp)
        return moe.experts
    return {"world": world, "bytes": _bytes(shard, recipe),
            "min_sqnr_db_other": min(floors.values())}


def run(args):
    rank, world, device = init()
    if args.scenario == "fsdp":
        write_result(args, fsdp(world))
    else:
        write_result(args, ep_fsdp(world, args.recipe))


def _args(parser):
    parser.add_argument("--scenario", choices=("fsdp", "ep_fsdp"), required=True)
    parser.add_argument("--recipe", choices=tuple(DIMS), default="tensorwise")


if __name__ == "__main__":
    main(run, _args)
