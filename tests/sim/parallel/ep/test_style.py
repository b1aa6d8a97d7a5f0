"""Float8ExpertParallel (f8dist/parallel/ep/style.py) applied directly with ``parallelize_module`` on 2
simulated ranks ([Note: simulating ranks in one process] in tests/sim/__init__.py): an MoE's
experts (also under activation checkpointing) and a bare experts module, each rank with its own
uneven tokens, equal one device bit for bit; float8 dispatch sends ``dim + 4`` bytes per rowwise
token where bf16 sends ``2 * dim``; the float8 combine and backward equal one device casting the
same rows, and every all-to-all's bytes are exact; the style's repr, its errors, and that the
hooks are the only expert-parallel code path (the MoE model holds no EP state and imports none)."""

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.checkpoint import checkpoint

from f8dist import Float8LinearConfig, convert_to_float8_training
from f8dist.core import agreement
from f8dist.core.cast import cast_to_float8, stochastic_rounding
from f8dist.parallel.ep.dispatch import COMBINE_SPEC, GRAD_SPEC
from f8dist.parallel.ep import Float8ExpertParallel
from f8dist.models.moe import MoE, MoEArgs
from f8dist.testing import count_collectives
from tests.sim.parallel.ep.test_dispatch import DIM, HIDDEN, PER_RANK, SIZES, _moe, _step_matches_one_device
from tests.sim.threads import run_threads
from tests.test_imports import import_graph

WORLD = 2


def test_repr():
    assert repr(Float8ExpertParallel()) == "Float8ExpertParallel(float8_dispatch=True)"
    assert (repr(Float8ExpertParallel(float8_dispatch=False))
            == "Float8ExpertParallel(float8_dispatch=False)")
    assert (repr(Float8ExpertParallel(float8_combine=True, float8_backward=True))
            == "Float8ExpertParallel(float8_dispatch=True, float8_combine=True, "
               "float8_backward=True)")


def test_the_style_is_the_only_expert_parallel_code_path():
    moe = MoE(DIM, HIDDEN, MoEArgs(num_experts=4, top_k=2))
    assert not hasattr(moe, "ep_group") and not hasattr(moe, "float8_dispatch")
    ep_modules = [m for m in import_graph()["f8dist.models.moe"] if m.startswith("f8dist.parallel.ep")]
    assert ep_modules == []


def _batch(total, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, total, DIM, generator=g).to(torch.bfloat16),
            torch.randn(1, total, DIM, generator=g).to(torch.bfloat16))


@pytest.mark.parametrize("recipe,recompute", [(None, False), ("rowwise", False),
                                              ("rowwise", True), ("mxfp8", False),
                                              ("nvfp4", False)])
def test_style_on_an_moe_matches_one_device(recipe, recompute):
    """``parallelize_module(moe.experts, mesh, Float8ExpertParallel())``, the MoE's code unchanged;
    ``recompute``: the MoE under (non-reentrant) activation checkpointing, whose recompute re-runs
    the style's hooks."""
    ref = _moe(recipe, WORLD)
    layers = [copy.deepcopy(ref) for _ in range(WORLD)]
    sizes = SIZES[:WORLD]
    x, grad = _batch(sum(sizes))
    x_ref = x.clone().requires_grad_()
    stochastic_rounding.reset()  # as each rank starts ([Note: a run starts as processes do])
    out = ref(x_ref)
    out.backward(grad)

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
        moe = layers[rank]
        parallelize_module(moe.experts, mesh, Float8ExpertParallel())
        assert all(isinstance(p, DTensor) and p.placements == (Shard(0),)
                   for p in moe.experts.parameters())
        settings = agreement.settings(moe)
        assert settings["experts", "tp_style"] == "Float8ExpertParallel(float8_dispatch=True)"
        if recompute:
            forward = moe.forward
            moe.forward = lambda xi: checkpoint(forward, xi, use_reentrant=False)
        _step_matches_one_device(moe, ref, rank, sizes, x, grad, out, x_ref)

    run_threads(WORLD, rank_main)


def _rank_matches(experts, ref, rank, o, xi, out, all_tokens, order, weights):
    """Rank ``rank``'s output, input gradient and expert weight gradients equal one device's
    (``ref``'s ``out`` and gradients, its tokens in ``order``: (rank, row) per row)."""
    mine = [k for k, (r, _) in enumerate(order) if r == rank]
    assert torch.equal(o, out[mine]) and torch.equal(xi.grad, all_tokens.grad[mine])
    per_rank = getattr(ref, weights[0]).shape[0] // WORLD
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    for w in weights:
        assert torch.equal(getattr(experts, w).grad.to_local(), getattr(ref, w).grad[local]), \
            (rank, w)


@pytest.mark.parametrize("recipe", ["rowwise", "nvfp4"])
def test_style_on_bare_experts_matches_one_device(recipe):
    """The experts module alone, called as one device calls it: ``experts(tokens, offsets)``
    with this rank's tokens sorted by expert and its offsets over all experts. "nvfp4": its
    gradients rounded stochastically, each rank drawing one device's numbers for its experts'
    groups ([Note: positions in token groups] in f8dist/core/scaling.py)."""
    ref = _moe(recipe, WORLD).experts
    e = PER_RANK * WORLD
    g = torch.Generator().manual_seed(3)
    # each rank's tokens per expert (some zero), sorted by expert
    counts = [torch.randint(0, 3, (e,), generator=g) for _ in range(WORLD)]
    tokens = [torch.randn(int(c.sum()), DIM, generator=g).to(torch.bfloat16) for c in counts]
    # one device: each expert's group holds rank 0's tokens, then rank 1's
    order = [(r, i) for j in range(e) for r in range(WORLD)
             for i in range(int(counts[r][:j].sum()), int(counts[r][:j + 1].sum()))]
    all_tokens = torch.stack([tokens[r][i] for r, i in order]).requires_grad_()
    stochastic_rounding.reset()  # as each rank starts ([Note: a run starts as processes do])
    out = ref(all_tokens, torch.cumsum(sum(counts), 0).to(torch.int32))
    out.sum().backward()
    layers = [copy.deepcopy(ref) for _ in range(WORLD)]

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
        experts = parallelize_module(layers[rank], mesh, Float8ExpertParallel())
        xi = tokens[rank].clone().requires_grad_()
        o = experts(xi, torch.cumsum(counts[rank], 0).to(torch.int32))
        o.sum().backward()
        _rank_matches(experts, ref, rank, o, xi, out, all_tokens, order, ("w1", "w2", "w3"))

    run_threads(WORLD, rank_main)


def test_float8_dispatch_sends_float8_bytes():
    """Rowwise experts: the dispatch sends ``dim`` float8 bytes and a float32 scale per token
    with ``float8_dispatch=True``, ``2 * dim`` bf16 bytes without; the outputs are the same."""
    ref = _moe("rowwise", WORLD)
    sizes = SIZES[:WORLD]
    x, _ = _batch(sum(sizes))

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
        mine = x[:, sum(sizes[:rank]):sum(sizes[:rank + 1])]
        result = {}
        for fd in (True, False):
            moe = copy.deepcopy(ref)
            parallelize_module(moe.experts, mesh, Float8ExpertParallel(float8_dispatch=fd))
            with torch.no_grad(), count_collectives() as counts:
                result[fd] = (moe(mine), counts["all_to_all"].input_bytes)
        (out8, bytes8), (out16, bytes16) = result[True], result[False]
        assert torch.equal(out8, out16)
        assignments = mine.shape[1] * ref.args.top_k  # every one sent (to a rank, maybe this)
        assert bytes16 - bytes8 == assignments * (2 * DIM - (DIM + 4)), (bytes16, bytes8)

    run_threads(WORLD, rank_main)


def test_nvfp4_dispatch_sends_4_bit_tokens():
    """NVFP4 experts: the dispatch sends ``dim / 2`` e2m1 bytes and ``dim / 16`` e4m3 block
    scales per token (the tensor scale, one device's, stays home: [Note: float8 dispatch]), where
    bf16 sends ``2 * dim`` and MXFP8 ``dim + dim / 32``; without float8 dispatch each gemm casts
    the bf16 tokens it receives to the same bytes ([Note: NVFP4 experts])."""
    sizes = SIZES[:WORLD]
    x, _ = _batch(sum(sizes))
    refs = {recipe: _moe(recipe, WORLD) for recipe in (None, "mxfp8", "nvfp4")}

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
        mine = x[:, sum(sizes[:rank]):sum(sizes[:rank + 1])]
        out, sent = {}, {}
        for recipe, fd in ((None, True), ("mxfp8", True), ("nvfp4", True), ("nvfp4", False)):
            moe = copy.deepcopy(refs[recipe])
            parallelize_module(moe.experts, mesh, Float8ExpertParallel(float8_dispatch=fd))
            with torch.no_grad(), count_collectives() as counts:
                out[recipe, fd], sent[recipe, fd] = moe(mine), counts["all_to_all"].input_bytes
        assert torch.equal(out["nvfp4", True], out["nvfp4", False])
        assignments = mine.shape[1] * refs[None].args.top_k  # every one sent (to a rank, maybe this)
        nvfp4 = DIM // 2 + DIM // 16
        assert sent[None, True] - sent["nvfp4", True] == assignments * (2 * DIM - nvfp4)
        assert sent["mxfp8", True] - sent["nvfp4", True] == assignments * (DIM + DIM // 32 - nvfp4)
        return sent

    run_threads(WORLD, rank_main)


class _OnWire(torch.autograd.Function):
    """One device's float8 combine and backward: rows cast with ``spec`` and dequantized (as
    they are where None), their gradient likewise with ``grad_spec``."""

    @staticmethod
    def forward(ctx, x, spec, grad_spec):
        ctx.grad_spec = grad_spec
        return x.clone() if spec is None else cast_to_float8(x, spec).to_original_precision()

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.grad_spec
        if spec is not None:
            grad = cast_to_float8(grad, spec).to_original_precision()
        return grad, None, None


def _quantize_as_the_wire(experts, combine, backward):
    """Hooks on one device's ``experts``: their outputs and the gradients of their outputs and
    inputs cast and dequantized where the float8 combine and backward cast them."""
    grad_spec = GRAD_SPEC if backward else None
    experts.register_forward_pre_hook(
        lambda mod, args: (_OnWire.apply(args[0], None, grad_spec), *args[1:]))
    experts.register_forward_hook(
        lambda mod, args, out: _OnWire.apply(out, COMBINE_SPEC if combine else None, grad_spec))


@pytest.mark.parametrize("recipe,combine,backward", [(None, True, True), ("rowwise", True, False),
                                                     ("rowwise", False, True),
                                                     ("mxfp8", True, True)])
def test_float8_combine_and_backward_match_one_device_with_the_same_casts(recipe, combine,
                                                                         backward):
    """[Note: float8 combine and backward]: outputs, input and expert gradients bit for bit
    those of one device casting and dequantizing the same rows (``_quantize_as_the_wire``), and
    not those of one device without the casts."""
    plain = _moe(recipe, WORLD)
    ref = copy.deepcopy(plain)
    _quantize_as_the_wire(ref.experts, combine, backward)
    layers = [copy.deepcopy(plain) for _ in range(WORLD)]
    sizes = SIZES[:WORLD]
    x, grad = _batch(sum(sizes))
    results = []
    for model in (ref, plain):
        x_ref = x.clone().requires_grad_()
        out = model(x_ref)
        out.backward(grad)
        results.append((out, x_ref))
    (out, x_ref), (plain_out, plain_x) = results
    assert not torch.equal(x_ref.grad if backward else out, plain_x.grad if backward else plain_out)

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
        moe = layers[rank]
        parallelize_module(moe.experts, mesh, Float8ExpertParallel(
            float8_combine=combine, float8_backward=backward))
        _step_matches_one_device(moe, ref, rank, sizes, x, grad, out, x_ref)

    run_threads(WORLD, rank_main)


def test_float8_combine_and_backward_bytes():
    """Every all-to-all's bytes, exactly: the token counts (8 bytes per expert), then per row
    ``dim + 4`` bytes in float8 (a float32 scale per token), ``2 * dim`` in bf16; the dispatch
    and the combine's backward move this rank's assignments, the combine and the dispatch's
    backward the rows its experts received."""
    ref = _moe("rowwise", WORLD)
    sizes = SIZES[:WORLD]
    x, grad = _batch(sum(sizes))
    e, k = ref.args.num_experts, ref.args.top_k
    routed = torch.bincount(ref.router(x[0])[1].reshape(-1), minlength=e)  # [E]

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
        mine = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
        sent = sizes[rank] * k  # this rank's assignments
        received = int(routed.view(WORLD, -1)[rank].sum())  # rows for this rank's experts
        f8, bf16 = DIM + 4, 2 * DIM
        for options, (dispatched, combined, back) in {
            (False, False, False): (bf16, bf16, bf16),
            (True, False, False): (f8, bf16, bf16),
            (True, True, False): (f8, f8, bf16),
            (True, True, True): (f8, f8, f8),
            (False, False, True): (bf16, bf16, f8),
        }.items():
            moe = copy.deepcopy(ref)
            parallelize_module(moe.experts, mesh, Float8ExpertParallel(
                float8_dispatch=options[0], float8_combine=options[1],
                float8_backward=options[2]))
            xi = x[:, mine].clone().requires_grad_()
            with count_collectives() as forward:
                o = moe(xi)
            with count_collectives() as backward:
                o.backward(grad[:, mine])
            assert (forward["all_to_all"].input_bytes
                    == 8 * e + sent * dispatched + received * combined), options
            assert backward["all_to_all"].input_bytes == (sent + received) * back, options

    run_threads(WORLD, rank_main)


def test_style_errors_name_the_rule():
    def rank_main(rank):
        mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "ep"))
        experts = MoE(DIM, HIDDEN, MoEArgs(num_experts=3, top_k=2)).experts
        with pytest.raises(ValueError, match="1-D EP mesh"):
            parallelize_module(experts, mesh, Float8ExpertParallel())
        with pytest.raises(ValueError, match=r"needs num_experts \(3\) to be a multiple"):
            parallelize_module(experts, mesh["ep"], Float8ExpertParallel())
        experts = MoE(DIM, HIDDEN, MoEArgs(num_experts=4, top_k=2)).experts
        parallelize_module(experts, mesh["ep"], Float8ExpertParallel())
        with pytest.raises(ValueError, match="already are DTensors"):
            parallelize_module(experts, mesh["ep"], Float8ExpertParallel())

    run_threads(WORLD, rank_main)


def test_parallelize_moe_applies_the_style_and_keeps_its_errors():
    """``parallelize_moe``: the style on every MoE's experts (its hooks, nothing on the MoE);
    its own errors; ``moe_tp_plan`` refuses expert-parallel experts (no 3-D mesh)."""
    from f8dist.models.llama import ModelArgs, Transformer
    from f8dist.models.moe import MoETransformer
    from f8dist.models.moe_parallel import moe_tp_plan, parallelize_moe

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "ep"))
        args = ModelArgs(dim=DIM, n_layers=2, n_heads=2, max_seq_len=8)
        with pytest.raises(ValueError, match="1-D EP mesh"):
            parallelize_moe(MoETransformer(args, MoEArgs(num_experts=4)), mesh)
        with pytest.raises(ValueError, match="has no MoE layer"):
            parallelize_moe(Transformer(args), mesh["ep"])
        with pytest.raises(ValueError, match=r"needs num_experts \(3\) to be a multiple"):
            parallelize_moe(MoETransformer(args, MoEArgs(num_experts=3)), mesh["ep"])
        model = parallelize_moe(MoETransformer(args, MoEArgs(num_experts=4)), mesh["ep"],
                                float8_dispatch=False)
        styles = {k: v for k, v in agreement.settings(model).items() if k[1] == "tp_style"}
        assert styles == {(f"layers.{i}.moe.experts", "tp_style"):
                          "Float8ExpertParallel(float8_dispatch=False)" for i in range(2)}
        with pytest.raises(NotImplementedError, match="expert parallel"):
            moe_tp_plan("layers.0.", model.layers["0"], float8=True)

    run_threads(WORLD, rank_main)


def _torchtitan_experts():
    """The converted experts of torchtitan's deepseek_v3 debug model (its first MoE layer's
    config, built alone; ``forward(x, num_tokens_per_expert)``), weights from a seed."""
    pytest.importorskip("torchtitan")
    from torchtitan.models.common.moe import GroupedExperts as TorchtitanExperts
    from torchtitan.models.deepseek_v3 import model_registry

    import f8dist.integrations.torchtitan as tt

    spec = model_registry("debugmodel", converters=[
        tt.Float8GroupedExpertsConverter.Config(recipe_name="rowwise")])
    (fqn, config, _, _), *_ = spec.model.traverse(TorchtitanExperts.Config)
    experts = config.build()
    assert isinstance(experts, tt.Float8GroupedExperts) and experts.fqn == fqn
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return experts


@pytest.mark.parametrize("float8_dispatch", [True, False])
def test_style_on_torchtitan_experts_matches_one_device(float8_dispatch):
    """torchtitan's experts (f8dist's converter; their second input is token counts) take the
    same style: on 2 ranks, each rank's outputs, input and weight gradients one device's."""
    ref = _torchtitan_experts()
    e, dim = ref.w1_EFD.shape[0], ref.w1_EFD.shape[2]
    g = torch.Generator().manual_seed(3)
    counts = [torch.randint(0, 3, (e,), generator=g) for _ in range(WORLD)]
    counts[1][1] = counts[0][1] = 0  # an expert without any token
    tokens = [torch.randn(int(c.sum()), dim, generator=g).to(torch.bfloat16) for c in counts]
    order = [(r, i) for j in range(e) for r in range(WORLD)
             for i in range(int(counts[r][:j].sum()), int(counts[r][:j + 1].sum()))]
    all_tokens = torch.stack([tokens[r][i] for r, i in order]).requires_grad_()
    out = ref(all_tokens, sum(counts))
    out.square().sum().backward()
    layers = [copy.deepcopy(ref) for _ in range(WORLD)]

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
        experts = parallelize_module(layers[rank], mesh, Float8ExpertParallel(
            float8_dispatch=float8_dispatch))
        xi = tokens[rank].clone().requires_grad_()
        o = experts(xi, counts[rank])
        o.square().sum().backward()
        _rank_matches(experts, ref, rank, o, xi, out, all_tokens, order,
                      ("w1_EFD", "w2_EDF", "w3_EFD"))

    run_threads(WORLD, rank_main)

