"""The LLaMA model under float8 context parallelism (f8dist/models/llama_cp.py, [Note: the LLaMA
model under context parallelism]) on 2 and 4 simulated ranks against one device whose attention
quantizes K and V the same way (``quantize_kv`` hooks): logits bit for bit (every op but attention
is per token, attention's outputs are one device's), parameter gradients summed over the cp ranks
at >= 120 dB in fp32 (each rank sums its tokens' contributions: summation order only)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh

from f8dist import Float8LinearConfig, convert_to_float8_training, float8_sac_context_fn
from f8dist.core.numerics import sqnr
from f8dist.models import ModelArgs, Transformer, parallelize_llama, parallelize_llama_cp
from f8dist.parallel.cp import quantize_kv
from f8dist.testing import count_collectives
from tests.sim.threads import run_threads

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=32)
B, S = 2, 32


def _quantize_kv_hook(module, args, kwargs):
    q, k, v = args
    return (q, quantize_kv(k), quantize_kv(v)), kwargs


def _loss(logits, targets, total):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / total


def _one_device(model):
    """(tokens, targets, the model's copy with ``quantize_kv`` hooks trained one step, its
    logits)."""
    g = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, ARGS.vocab_size, (B, S), generator=g) for _ in range(2))
    ref = copy.deepcopy(model)
    for block in ref.layers.values():
        block.attention.sdpa.register_forward_pre_hook(_quantize_kv_hook, with_kwargs=True)
    logits = ref(tokens)
    _loss(logits, targets, B * S).backward()
    return tokens, targets, ref, logits


@pytest.mark.parametrize("world,recipe", [(2, None), (4, None), (2, "rowwise")])
def test_llama_context_parallel_matches_one_device(world, recipe):
    """``rowwise``: float8 linears cast per token in forward, so the logits are one device's too;
    their grad_weight casts scale over the rank's tokens ([Note: the LLaMA model under context
    parallelism]), so gradients are compared in high precision only."""
    model = Transformer(ARGS)
    model.init_weights()
    if recipe is not None:
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                   module_filter_fn=lambda mod, fqn: fqn != "output")
    tokens, targets, ref, logits = _one_device(model)

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        mine = parallelize_llama_cp(copy.deepcopy(model), mesh)
        shard = slice(rank * S // world, (rank + 1) * S // world)
        with count_collectives() as counts:
            out = mine(tokens[:, shard])
            _loss(out, targets[:, shard], B * S).backward()
        assert counts.expect("all_gather").calls == 4 * ARGS.n_layers  # K, V: bytes, scales
        return out.detach(), {n: p.grad for n, p in mine.named_parameters()}

    results = run_threads(world, rank_main)
    assert torch.equal(torch.cat([r[0] for r in results], dim=1), logits)
    if recipe is None:
        for name, p in ref.named_parameters():
            summed = sum(r[1][name] for r in results)
            assert sqnr(p.grad, summed) >= 120, (name, sqnr(p.grad, summed))


def test_llama_context_parallel_needs_the_whole_sequence_in_max_seq_len():
    def rank_main(rank):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        model = parallelize_llama_cp(Transformer(ARGS), mesh)
        model(torch.zeros(1, ARGS.max_seq_len, dtype=torch.long))

    with pytest.raises(ValueError, match="needs ModelArgs.max_seq_len >= 64, got 32"):
        run_threads(2, rank_main)


def test_llama_context_parallel_with_tensor_parallel_matches_one_device():
    """cp 2 x tp 2 on 4 ranks ([Note: context parallelism with tensor parallelism]): tp shards
    the heads, cp the sequence, each tp rank gathering its heads' K and V in float8 over cp.
    Logits and gradients against one device at >= 120 dB in fp32: tp's row-sharded wo and w2
    sum partial products, so the summation order differs (not bit for bit)."""
    cp, tp = 2, 2
    model = Transformer(ARGS)
    model.init_weights()
    tokens, targets, ref, logits = _one_device(model)

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (cp, tp), mesh_dim_names=("cp", "tp"))
        mine = parallelize_llama(copy.deepcopy(model), mesh["tp"], float8=False)
        parallelize_llama_cp(mine, mesh["cp"])
        r = mesh["cp"].get_local_rank()
        shard = slice(r * S // cp, (r + 1) * S // cp)
        with count_collectives() as counts:
            out = mine(tokens[:, shard])  # [B, S / cp, vocab], replicated over tp
            _loss(out, targets[:, shard], B * S).backward()
        grads = {n: p.grad.full_tensor() for n, p in mine.named_parameters()}
        ranks = tuple(tuple(mesh[dim].mesh.tolist()) for dim in ("cp", "tp"))
        return out.detach(), grads, counts, ranks

    results = run_threads(cp * tp, rank_main)
    out = torch.cat([r[0] for r in results[::tp]], dim=1)
    assert sqnr(logits, out) >= 120, sqnr(logits, out)
    for name, p in ref.named_parameters():
        summed = sum(r[1][name] for r in results[::tp])  # over cp; tp's full_tensor is whole
        assert sqnr(p.grad, summed) >= 120, (name, sqnr(p.grad, summed))
    # bytes by mesh dim, per rank: over cp, each layer's K and V of the rank's Hkv / tp heads,
    # e4m3 bytes and an fp32 scale per token and head ([Note: the wire]: both cross as uint8),
    # dK and dV reduce-scattered in fp32; over tp the high-precision model's fp32 activations
    head_dim, kv_heads = ARGS.dim // ARGS.n_heads, ARGS.n_kv_heads // tp
    kv = 2 * B * kv_heads * S * head_dim  # K and V elements of the whole sequence, per layer
    for _, _, counts, (cp_ranks, tp_ranks) in results:
        gather, scatter = counts.expect("all_gather"), counts.expect("reduce_scatter")
        assert set(gather.wires) == {(cp_ranks, "uint8"), (tp_ranks, "float32")}
        calls, _, got = gather.wires[(cp_ranks, "uint8")]
        assert (calls, got) == (4 * ARGS.n_layers, ARGS.n_layers * kv * (head_dim + 4) // head_dim)
        assert set(scatter.wires) == {(cp_ranks, "float32"), (tp_ranks, "float32")}
        assert scatter.wires[(cp_ranks, "float32")][1] == ARGS.n_layers * kv * 4


@pytest.mark.parametrize("ac", ["full", "sac"])
def test_llama_context_parallel_under_activation_checkpointing(ac):
    """Blocks checkpointed as train.py's --ac does: the recomputed attention gathers K and V
    again (full: every gather twice; f8dist's SAC policy recomputes them too), the same bytes in
    the same order, so gradients equal those without checkpointing bit for bit."""
    world = 2
    model = Transformer(ARGS)
    model.init_weights()
    g = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, ARGS.vocab_size, (B, S), generator=g) for _ in range(2))

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        shard = slice(rank * S // world, (rank + 1) * S // world)
        grads, gathers = [], []
        for wrap in (False, True):
            mine = parallelize_llama_cp(copy.deepcopy(model), mesh)
            for name, block in list(mine.layers.items()):
                if wrap:
                    context = {} if ac == "full" else {"context_fn": float8_sac_context_fn}
                    mine.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False,
                                                           **context)
            with count_collectives() as counts:
                _loss(mine(tokens[:, shard]), targets[:, shard], B * S).backward()
            grads.append({n.replace("._checkpoint_wrapped_module", ""): p.grad
                          for n, p in mine.named_parameters()})
            gathers.append(counts.expect("all_gather").calls)
        return grads, gathers

    for (plain, checkpointed), gathers in run_threads(world, rank_main):
        assert gathers == [4 * ARGS.n_layers, 8 * ARGS.n_layers], gathers
        assert plain.keys() == checkpointed.keys()
        for name, grad in plain.items():
            assert torch.equal(checkpointed[name], grad), name
