"""Expert parallelism (f8dist/models/moe_parallel.py) against one device, on every rank of the
launch: one MoE layer, bf16 or float8 (``--recipes``: the dynamic and block recipes; ``--case``:
more recipes and shapes in the same launch), each rank routing its own uneven slice of a batch in
which some experts get no token on some ranks.
Checked here: outputs, input and expert-weight gradients bit for bit equal to one device running
the whole batch, with float8 dispatch and without; the router's and the shared expert's gradients
(summed over the ranks, as data parallelism does) within float32 summation order. Reported: the
dispatch's bytes, float8 (rowwise, mxfp8, blockwise) vs bf16."""

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from f8dist import Float8LinearConfig, convert_to_float8_training
from f8dist.parallel.ep.dispatch import _all_to_all_tokens
from f8dist.core.cast import cast_to_float8
from f8dist.models.moe import MoE, MoEArgs
from f8dist.models.moe_parallel import parallelize_moe
from f8dist.testing import count_collectives
from tests.distributed.common import init, main, sqnr, write_result

def _reference(recipe, num_experts, dim, hidden):
    moe = MoE(dim, hidden, MoEArgs(num_experts=num_experts, top_k=2))
    moe.init_weights(0.02, torch.Generator().manual_seed(0))
    moe.to(torch.bfloat16)
    if recipe is not None:
        # a tensorwise scale of a replicated (data-parallel) layer follows each rank's batch, as
        # in any data-parallel run, and so do the float32 scales of "blockwise"'s grad_weight
        # blocks of 128 tokens (power-of-2 scales only shift exponents): the shared expert stays
        # bf16 there; the experts' scales see one expert's whole token group on its rank, as on
        # one device
        dp_differs = recipe in ("tensorwise", "blockwise")
        keep = (lambda mod, fqn: "shared" not in fqn) if dp_differs else None
        convert_to_float8_training(moe, config=Float8LinearConfig.from_recipe_name(recipe),
                                   module_filter_fn=keep)
    return moe


def _step(moe, x, grad):
    x = x.detach().clone().requires_grad_()
    out = moe(x)
    out.backward(grad)
    return out, x.grad


def compare(recipes: str, dim: int, hidden: int, mesh) -> dict:
    """Every recipe of ``recipes`` (comma-separated) on experts of ``dim`` x ``hidden``: raises
    unless expert parallelism gives one device's outputs and gradients bit for bit."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    sizes = [7 - 5 * (r % 2) for r in range(world)]  # uneven: 7, 2, 7, 2 tokens
    x = torch.randn(1, sum(sizes), dim, generator=g).to(torch.bfloat16)
    grad = torch.randn(1, sum(sizes), dim, generator=g).to(torch.bfloat16)
    start = sum(sizes[:rank])
    mine = slice(start, start + sizes[rank])
    num_experts = 4 * world
    results = {}
    for recipe in recipes.split(","):
        recipe = None if recipe == "bf16" else recipe
        ref = _reference(recipe, num_experts, dim, hidden)
        ep_layers = {fd: parallelize_moe(copy.deepcopy(ref), mesh, float8_dispatch=fd)
                     for fd in (True, False)}
        out, gx = _step(ref, x, grad)
        experts_local = slice(rank * 4, rank * 4 + 4)
        for fd, ep in ep_layers.items():
            counts_seen = []
            orig = ep._assignments
            ep._assignments = lambda e, orig=orig: (lambda r: (counts_seen.append(r[1]), r)[1])(orig(e))
            o, gxe = _step(ep, x[:, mine], grad[:, mine])
            name = f"{recipe}/float8_dispatch={fd}"
            assert torch.equal(o, out[:, mine]), (name, sqnr(out[:, mine], o))
            assert torch.equal(gxe, gx[:, mine]), (name, sqnr(gx[:, mine], gxe))
            for w in ("w1", "w2", "w3"):
                mine_grad = getattr(ep.experts, w).grad.to_local()
                ref_grad = getattr(ref.experts, w).grad[experts_local]
                assert torch.equal(mine_grad, ref_grad), (name, w, sqnr(ref_grad, mine_grad))
            for p_ep, p_ref in ((ep.router.gate, ref.router.gate),
                                (ep.shared_expert.w2.weight, ref.shared_expert.w2.weight)):
                summed = p_ep.grad.float().clone()
                dist.all_reduce(summed)
                assert sqnr(p_ref.grad.float(), summed) > 40, (name, sqnr(p_ref.grad, summed))
            counts = counts_seen[0].clone()
            local_empty = torch.tensor(int((counts == 0).any()))
            dist.all_reduce(local_empty)
            dist.all_reduce(counts)
            results["empty_groups_on_a_rank"] = bool(local_empty.item())
            results["experts_without_tokens"] = int((counts == 0).sum())
    return results


def run(args):
    rank, world, device = init()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    results = {"world": world, **compare(args.recipes, args.dim, args.hidden, mesh)}
    for case in args.case:  # more experts' shapes in the same launch
        name, _, spec = case.partition("=")
        recipes, dim, hidden = spec.split(":")
        results[name] = compare(recipes, int(dim), int(hidden), mesh)
    g = torch.Generator().manual_seed(2)
    # the dispatch's bytes: the same tokens (dim 256) in bf16 and as per-token float8 (rowwise,
    # and the block recipes' 1 x 32 e8m0 and 1 x 128 float32 scales)
    tokens = torch.randn(64, 256, generator=g).to(torch.bfloat16)  # LLaMA dims are larger still
    send = [64 // world] * world
    bytes_ = {}
    casts = {name: cast_to_float8(tokens, Float8LinearConfig.from_recipe_name(recipe)
                                  .grouped_cast_specs("e.w1")["output", "input"])
             for name, recipe in (("float8", "rowwise"), ("mxfp8", "mxfp8"),
                                  ("blockwise", "blockwise"))}
    for name, t in (("bf16", tokens), *casts.items()):
        with count_collectives() as counts:
            _all_to_all_tokens(t, send, send, mesh.get_group())
        bytes_[name] = counts["all_to_all"].input_bytes
    results["dispatch_bytes"] = bytes_
    write_result(args, results)


def _args(parser):
    parser.add_argument("--recipes", default="bf16,rowwise,tensorwise,rowwise_with_gw_hp,mxfp8")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--case", action="append", default=[],
                        help="NAME=RECIPES:DIM:HIDDEN, also compared; its figures under NAME")


if __name__ == "__main__":
    main(run, _args)
