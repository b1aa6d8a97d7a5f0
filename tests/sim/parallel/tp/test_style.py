"""2-D FSDP2 x TP with sequence parallelism (f8dist/parallel/tp/style.py, the LLaMA plan of
f8dist/models/llama_tp.py) on a dp 2 x tp 4 mesh of 8 simulated ranks (threads, [Note:
simulating ranks in one process] in tests/sim/__init__.py), against one device: every dp rank's
logits, the embedding output's gradient and every weight gradient within the 2-D floor of
tests/sim/parallel/tp/test_llama.py (a 2 x 2 mesh of 4 ranks), and every amax all-reduce over
exactly the mesh axes that shard its tensor ([Note: amax] in f8dist/core/placement.py): tp for
sequence-parallel activations, dp and tp at once for a weight FSDP2 gathers in float8 (one per
weight), none for block scales (whose float8 weight gradients are one device's bit for bit);
on HSDP x TP, dp_shard and tp at once. A dp 1 x tp 2 mesh gathers in float8 on FSDP2's one-rank
group. (Rowwise's K-sharded amaxes over tp alone:
tests/sim/test_cast.py; rowwise 2-D against one device: tests/sim/parallel/tp/test_llama.py.)"""

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from f8dist import Float8Linear, Float8LinearConfig, convert_to_float8_training
from f8dist.models import parallelize_llama
from f8dist.parallel.fsdp import precompute_float8_dynamic_scale_for_fsdp
from f8dist.models.llama import ModelArgs, Transformer
from f8dist.core.numerics import sqnr
from f8dist.testing import count_collectives
from tests.sim.parallel.tp.test_llama import FLOOR_2D_DB
from tests.distributed.tp_llama import run_model, shard_2d
from tests.sim.threads import run_threads

DP, TP = 2, 4
BATCH, SEQ = 1, 16  # 4 tokens per sequence shard: mxfp8's 32-token blocks go in high precision
# dim 128, hidden 384: tp shards of 32 and 96, whole 1x32 blocks; one head per tp rank
ARGS = ModelArgs(dim=128, n_layers=1, n_heads=4, multiple_of=128, max_seq_len=SEQ)


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_2d(recipe, float8_all_gather=False, dp=DP, tp=TP):
    """Per rank of a ``dp`` x ``tp`` mesh: (SQNRs against one device, forward and backward
    collective counts, number of float8 linears, the global ranks of its tp group)."""
    config = Float8LinearConfig.from_recipe_name(recipe).replace(
        enable_fsdp_float8_all_gather=float8_all_gather)
    model = Transformer(ARGS)
    model.init_weights(seed=0)
    convert_to_float8_training(model, config=config)
    reference = copy.deepcopy(model)
    models = [copy.deepcopy(model) for _ in range(dp * tp)]
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, ARGS.vocab_size, (dp * BATCH, SEQ), generator=gen)
    grad_logits = torch.randn(dp * BATCH, SEQ, ARGS.vocab_size, generator=gen)
    refs = [run_model(reference, tokens[d * BATCH:(d + 1) * BATCH],
                      grad_logits[d * BATCH:(d + 1) * BATCH]) for d in range(dp)]
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}  # summed over dp batches

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        model = models[rank]
        parallelize_llama(model, mesh["tp"], float8=True, loss_parallel=True)
        shard_2d(model, mesh["dp"])
        d, t = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
        mine = slice(d * BATCH, (d + 1) * BATCH)
        grad_tp = distribute_tensor(grad_logits[mine], mesh["tp"], [Shard(-1)])
        logits, grad_h, fwd, bwd = run_model(model, tokens[mine], grad_tp)
        ref_logits, ref_grad_h = refs[d][0], refs[d][1]
        seq = slice(t * SEQ // tp, (t + 1) * SEQ // tp)  # this rank's sequence shard
        sqnrs = {"logits": sqnr(ref_logits.detach(), full(logits).detach()),
                 "grad_input": sqnr(ref_grad_h[:, seq], grad_h)}
        for name, p in model.named_parameters():  # FSDP2 averages over dp (a power of 2: exact)
            sqnrs[f"grad:{name}"] = sqnr(ref_grads[name], full(p.grad) * dp)
        n = sum(isinstance(m, Float8Linear) for m in model.modules())
        return sqnrs, fwd, bwd, n, tuple(sorted(mesh["tp"].mesh.flatten().tolist()))

    return run_threads(dp * tp, rank_main)


def _check(results, recipe, dp=DP, tp=TP):
    for sqnrs, *_ in results:
        low = {k: v for k, v in sqnrs.items() if v < FLOOR_2D_DB}
        assert not low, f"{recipe} (dp {dp} x tp {tp}): below {FLOOR_2D_DB} dB: {low}"


def _max_reduces(counts):
    """amax all-reduces per group: {ranks: calls}."""
    return {ranks: n for (ranks, op), n in counts["all_reduce"].groups.items() if op == "max"}


def test_2d_tensorwise_float8_all_gather_reduces_each_weight_amax_over_dp_and_tp():
    results = run_2d("tensorwise", float8_all_gather=True)
    _check(results, "tensorwise+float8_all_gather")
    for _, fwd, bwd, n, tp_ranks in results:
        reduces = _max_reduces(fwd)
        # each weight FSDP2 gathers in float8: ONE all-reduce over all 8 ranks (dp and tp at
        # once); the sequence-parallel activations' amaxes over this rank's tp ranks only
        assert reduces[tuple(range(DP * TP))] == n > 0, reduces
        assert set(reduces) == {tp_ranks, tuple(range(DP * TP))}, reduces
        # backward: FSDP2 gathers the block's 7 weights again (one more all-reduce each over all
        # 8 ranks; the root keeps the output linear's unsharded), the gradients' amaxes over tp
        assert _max_reduces(bwd)[tuple(range(DP * TP))] == n - 1, _max_reduces(bwd)
        assert set(_max_reduces(bwd)) == {tp_ranks, tuple(range(DP * TP))}, _max_reduces(bwd)


def test_2d_mxfp8_reduces_no_amax_and_gives_one_device_weight_gradients():
    results = run_2d("mxfp8")
    _check(results, "mxfp8")
    for sqnrs, fwd, bwd, n, _ in results:
        assert n == 8 and not _max_reduces(fwd) and not _max_reduces(bwd)
        # e8m0 scales and every cast made from high precision (the 4-token sequence shards split
        # the grad_weight gemm's 32-token blocks: the SP input crosses in high precision): every
        # float8 linear's weight gradient is one device's bit for bit, as on tp 2
        # (test_tp.py::test_tp_sp_mxfp8_weight_gradients_are_bit_identical)
        exact = [k for k, v in sqnrs.items() if v == float("inf")]
        assert len([k for k in exact if k.startswith("grad:") and "norm" not in k
                    and "tok_embeddings" not in k]) == n, sqnrs


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8_square_weights"])
def test_float8_all_gather_on_a_one_rank_dp_group_under_tp(recipe):
    """dp 1 x tp 2 (``train.py --tp 2`` on 2 ranks): FSDP2 runs no all-gather on its one-rank
    group ([Note: one-rank FSDP2 group] in f8dist/core/weight.py), a square-block weight's scales
    included."""
    results = run_2d(recipe, float8_all_gather=True, dp=1, tp=2)
    _check(results, f"{recipe}+float8_all_gather", dp=1, tp=2)
    assert [n for *_, n, _ in results] == [8, 8]  # float8 linears per rank


def test_hsdp_x_tp_reduces_each_weight_amax_once_over_dp_shard_and_tp():
    """HSDP x TP on a dp_replicate 2 x dp_shard 2 x tp 2 mesh, weights gathered in float8: one
    device's logits; each weight's amax is ONE all-reduce over its 4 dp_shard x tp ranks (not one
    per axis), the activations' over tp, and precompute takes one all-reduce for all weights."""
    config = Float8LinearConfig.from_recipe_name("tensorwise").replace(
        enable_fsdp_float8_all_gather=True)
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, max_seq_len=SEQ)
    model = Transformer(args)
    model.init_weights(seed=0)
    convert_to_float8_training(model, config=config)
    models = [copy.deepcopy(model) for _ in range(8)]
    tokens = torch.randint(0, args.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(1))
    expected = model(tokens).detach()

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        model = models[rank]
        parallelize_llama(model, mesh["tp"], float8=True)
        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp_replicate", "dp_shard"])
        fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])
        with count_collectives() as fwd:
            logits = model(tokens)
        assert torch.equal(full(logits), expected), rank
        with count_collectives() as pre:
            precompute_float8_dynamic_scale_for_fsdp(model)
        n = sum(isinstance(m, Float8Linear) for m in model.modules())
        shard_tp = tuple(sorted(mesh["dp_shard", "tp"].mesh.flatten().tolist()))
        tp = tuple(sorted(mesh["tp"].mesh.flatten().tolist()))
        return n, shard_tp, tp, _max_reduces(fwd), _max_reduces(pre)

    for n, shard_tp, tp, fwd, pre in run_threads(8, rank_main):
        assert len(shard_tp) == 4 and set(fwd) == {shard_tp, tp}, fwd
        assert fwd[shard_tp] == n == 8 and pre == {shard_tp: 1}, (fwd, pre)


@pytest.mark.parametrize("sp", [False, True])
def test_nvfp4_colwise_rowwise_pair_on_2_ranks_is_one_device(sp):
    """A Float8ColwiseParallel / Float8RowwiseParallel pair with the nvfp4 recipe on tp 2
    (threads): every tensor scale is the logical tensor's ([Note: amax] in
    f8dist/core/placement.py) and every block whole, so the weight gradients (no rank sums them
    over shards) are one device's bit for bit; the output and the input's gradient, sums of the
    two ranks' partial gemms, differ from one device's only in float32 summation order
    (>= 120 dB). With sequence parallelism the activation (forward) and the output's gradient
    (backward) are all-gathered in 4 bits with their 1x16 e4m3 block scales ([Note: two-level
    scales] in f8dist/core/tensor.py), each cast for its two gemms. Gradients round
    stochastically, each rank drawing one device's numbers for its shard ([Note: stochastic
    rounding] in f8dist/core/scaling.py), and the grad_weight gemm's operands take the random
    Hadamard transform of their 16-token blocks, whole in every sequence shard."""
    from torch.distributed.tensor.parallel import parallelize_module
    from f8dist.core.cast import stochastic_rounding
    from f8dist.parallel.tp import Float8ColwiseParallel, Float8RowwiseParallel

    config = Float8LinearConfig.from_recipe_name("nvfp4")
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False),
                                torch.nn.Linear(128, 64, bias=False))  # 16-blocks whole on tp 2
    convert_to_float8_training(model, config=config)
    x = torch.randn(2, 32, 64, generator=gen)  # [B, S, D]: 16 tokens a sequence shard
    grad_out = torch.randn(2, 32, 64, generator=gen)
    ref_x = x.clone().requires_grad_()
    reference = copy.deepcopy(model)
    stochastic_rounding.reset()  # as each rank starts ([Note: a run starts as processes do])
    ref_out = reference(ref_x)
    ref_out.backward(grad_out)
    models = [copy.deepcopy(model) for _ in range(2)]
    seq = (lambda t, rank: t.chunk(2, 1)[rank]) if sp else (lambda t, rank: t)
    sp_layouts = ({"input_layouts": Shard(1)}, {"output_layouts": Shard(1)}) if sp else ({}, {})

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (2,))
        m = parallelize_module(models[rank], mesh, {"0": Float8ColwiseParallel(**sp_layouts[0]),
                                                     "1": Float8RowwiseParallel(**sp_layouts[1])})
        h = seq(x, rank).clone().requires_grad_()
        with count_collectives() as fwd:
            out = m(h)
        with count_collectives() as bwd:
            out.backward(seq(grad_out, rank))
        return full(out), h.grad, [full(p.grad) for p in m.parameters()], fwd, bwd

    for rank, (out, grad_x, grads, fwd, bwd) in enumerate(run_threads(2, rank_main)):
        assert sqnr(seq(ref_out, rank), out) >= 120 and sqnr(seq(ref_x.grad, rank), grad_x) >= 120
        for ref, grad in zip([p.grad for p in reference.parameters()], grads):
            assert torch.equal(grad, ref)
        if sp:  # [2, 32, 64] gathered twice (two casts): half a byte an element, a byte per 16
            for counts in (fwd, bwd):
                assert counts["all_gather"].output_bytes == 2 * x.numel() * (1 / 2 + 1 / 16)
