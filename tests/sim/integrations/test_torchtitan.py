"""torchtitan 0.3.0's own tensor parallelism (``Module.parallelize`` from the model's
ShardingConfigs, sequence parallel on) over f8dist's converted llama3 debug model (two blocks),
tp 2 on simulated ranks (threads, [Note: simulating ranks in one process] in tests/sim/__init__.py),
on both of its backends, against one device: [Note: float8 casts under spmd_types] and [Note:
delayed buffers under torchtitan's parallelize] in f8dist/integrations/torchtitan.py.

Skipped with tests/integrations/test_torchtitan.py when torchtitan is not installed.
"""

import copy
import functools
import types

import pytest
import torch

from tests.integrations.test_torchtitan import _sdpa  # skips without torchtitan

import torchtitan.distributed.parallel_dims as parallel_dims_module  # noqa: E402
from torchtitan.config import ParallelismConfig  # noqa: E402
from torchtitan.distributed import ParallelDims, full_dtensor  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.distributed.spmd_types import annotate_input_spmd_types  # noqa: E402
from torchtitan.models import deepseek_v3, llama3  # noqa: E402

from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.tools.utils import set_default_dtype  # noqa: E402
from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts  # noqa: E402

import f8dist  # noqa: E402
import f8dist.integrations.torchtitan as tt  # noqa: E402
from f8dist.core.cast import cast_to_float8  # noqa: E402
from f8dist.core.numerics import sqnr  # noqa: E402
from f8dist.parallel.ep import dispatch as ep_dispatch  # noqa: E402
from f8dist.testing import count_collectives  # noqa: E402
from tests.sim.threads import run_threads  # noqa: E402

TP = 2
BATCH, SEQ, DIM, BLOCKS = 2, 32, 256, 2
EP, TOP_K = 2, 3  # deepseek_v3's debug model routes each token to 3 of its 8 experts
BACKENDS = ["spmd_types", "full_dtensor"]
# one device's float8 numbers up to the order of TP's sums: bf16 (no float8) runs the same model
# at about 146 dB from one device; a tensorwise cast of each rank's shard with its own amax (what
# spmd_types gave before the layer cast on DTensors) is about 55 dB away
FLOOR_DB = 100
# deepseek_v3's weight gradients under tp: see test_torchtitan_tp_deepseek_v3; a linear whose
# tp-partial gradient is cast as it is (wkv_a converted) is about 20 dB away
DEEPSEEK_GRAD_FLOOR_DB = 40


@pytest.fixture
def cpu_mesh(monkeypatch):
    """torchtitan builds its meshes on ``tools.utils.device_type`` ("cuda" on a machine without
    an accelerator): CPU meshes here; the backend is torchtitan's process-wide setting."""
    monkeypatch.setattr(parallel_dims_module, "device_type", "cpu")
    yield
    dist_utils.set_spmd_backend("spmd_types")


def _model_config(recipe, backend, model="llama3", keep=None):
    """The debug model's config of torchtitan's ``model`` ("llama3", "deepseek_v3"), two blocks
    (deepseek_v3: a dense one, then a MoE one, its routed experts in high precision), its linears
    but ``lm_head`` (and deepseek_v3's ``wkv_a``) converted (``recipe`` "bf16": none), sharded by
    torchtitan for tp 2 with sequence parallelism."""
    registry = {"llama3": llama3.model_registry, "deepseek_v3": deepseek_v3.model_registry}[model]
    # deepseek_v3's wkv_a: replicated over tp, its gradient arrives tp-partial (docs/torchtitan.md)
    if keep is None:
        keep = ["lm_head"] + (["wkv_a"] if model == "deepseek_v3" else [])
    converters = [] if recipe == "bf16" else [
        tt.Float8LinearConverter.Config(recipe_name=recipe, filter_fqns=keep)]
    config = _sdpa(registry("debugmodel", converters=converters).model)
    config.layers = config.layers[:BLOCKS]
    parallelism = ParallelismConfig(tensor_parallel_degree=TP, enable_sequence_parallel=True,
                                    spmd_backend=backend)
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    return config


def _full(t, dim):
    """The whole tensor of a rank's ``t``: a DTensor's, a plain shard gathered on ``dim``, or
    (``dim`` None) the sum of a replicated weight's partial gradients (spmd_types leaves their tp
    sum to FSDP's reduction)."""
    if hasattr(t, "full_tensor"):
        return t.full_tensor()
    if dim is None:
        t = t.clone()
        torch.distributed.all_reduce(t)
        return t
    parts = [torch.empty_like(t) for _ in range(TP)]
    torch.distributed.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim)


def _weight_dim(linear):
    """The dim torchtitan's ShardingConfig shards ``linear``'s weight on over tp (None: whole)."""
    tp = linear._sharding_config.state_shardings["weight"].per_axis_spmd_types()[
        parallel_dims_module.MeshAxisName.TP]
    return getattr(tp, "dim", None)


def _same_amaxes(buffer, one_device):
    """Delayed buffers: equal, but for the rounding of gradients that come through TP's sums
    (summed in another order than on one device: a grad_output amax 1 ulp apart)."""
    return torch.allclose(buffer, one_device, rtol=1e-5, atol=0)


def run_tp(recipe, backend, dtype=torch.float32, model="llama3"):
    """Per rank: (logits SQNR, min weight-gradient SQNR over the linears but ``lm_head``, the
    delayed buffers that differ from one device's after the sync, the forward's all-gathers as
    ``CollectiveStats``) against one device, the model built in ``dtype``."""
    torch.manual_seed(0)
    with torch.device("cpu"), set_default_dtype(dtype):
        reference = _model_config(recipe, backend, model).build()
    with torch.no_grad():
        reference.init_weights(buffer_device=None)
    models = [copy.deepcopy(reference) for _ in range(TP)]
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 2048, (BATCH, SEQ), generator=gen)
    grad_logits = torch.randn(BATCH, SEQ, 2048, generator=gen, dtype=dtype)
    logits = reference(tokens)
    logits.backward(grad_logits)
    f8dist.sync_float8_amax_and_scale_history(reference)
    dist_utils.set_spmd_backend(backend)

    def rank_main(rank):
        model = models[rank]
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=TP, pp=1, ep=1, world_size=TP,
                            spmd_backend=backend)
        model.parallelize(dims)
        with dist_utils.get_spmd_context(parallel_dims=dims)():
            annotate = (annotate_input_spmd_types if backend == "spmd_types"
                        else full_dtensor.parallelize_inputs)
            inputs, _, _ = annotate(dims, tokens.clone(), tokens.clone(), {})
            with count_collectives() as forward:
                out = model(inputs)
            grad = (grad_logits.chunk(TP, -1)[rank] if backend == "spmd_types"
                    else distribute_tensor(grad_logits, out.device_mesh, out.placements))
            out.backward(grad)
        f8dist.sync_float8_amax_and_scale_history(model)
        grads, other_buffers = [], []
        for name, linear in model.named_modules():
            if not isinstance(linear, (Linear, tt.Float8Linear)) or name == "lm_head":
                continue
            one = reference.get_submodule(name)
            dim = _weight_dim(linear)
            grads.append(sqnr(one.weight.grad, _full(linear.weight.grad, dim)))
            other_buffers += [f"{name}.{n}: {b.tolist()} != {one.get_buffer(n).tolist()}"
                              for n, b in linear.named_buffers()
                              if not _same_amaxes(b, one.get_buffer(n))]
        return sqnr(logits, _full(out, -1)), min(grads), other_buffers, forward["all_gather"]

    return run_threads(TP, rank_main)


def _gathers(recipe, dtype):
    """One rank's forward all-gathers (calls, bytes): per block, attention's and the FFN's input
    (float8: 1 byte per element, and rowwise's fp32 scale per token in a gather of its own), then
    the final norm's output before ``lm_head`` (``dtype``)."""
    tokens = BATCH * SEQ // TP  # in one rank's sequence shard
    if recipe == "bf16":
        per_input = (1, tokens * DIM * dtype.itemsize)
    elif recipe == "rowwise":
        per_input = (2, tokens * DIM + tokens * 4)
    else:
        per_input = (1, tokens * DIM)
    inputs = BLOCKS * 2
    return inputs * per_input[0] + 1, inputs * per_input[1] + tokens * DIM * dtype.itemsize


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_torchtitan_tp_gives_one_device_float8_numbers(cpu_mesh, recipe, backend):
    for logits_db, grad_db, other_buffers, gathers in run_tp(recipe, backend):
        assert logits_db > FLOOR_DB, (recipe, backend, logits_db)
        assert grad_db > FLOOR_DB, (recipe, backend, grad_db)
        assert not other_buffers, other_buffers[:4]
        assert (gathers.calls, gathers.input_bytes) == _gathers(recipe, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_torchtitan_tp_deepseek_v3(cpu_mesh, backend):
    """Its dense block's FFN input is all-gathered in float8; its MLA attention's and the MoE
    block's input in high precision (f8dist converts neither module: docs/torchtitan.md). Its
    logits are one device's. Its weight gradients are checked against a lower floor: without
    float8, torchtitan's tp already puts the MoE router's gradient further from one device than
    the rest (docs/torchtitan.md), and the float8 gradient casts below it round that difference
    up."""
    tokens = BATCH * SEQ // TP
    float8, high = tokens * DIM, tokens * DIM * torch.float32.itemsize
    for logits_db, grad_db, _, gathers in run_tp("tensorwise", backend, model="deepseek_v3"):
        assert logits_db > FLOOR_DB and grad_db > DEEPSEEK_GRAD_FLOOR_DB, (logits_db, grad_db)
        assert (gathers.calls, gathers.input_bytes) == (5, float8 + 4 * high)


@pytest.mark.parametrize("backend", BACKENDS)
def test_torchtitan_tp_refuses_a_float8_weight_it_replicates_over_tp(cpu_mesh, backend):
    # deepseek_v3's wkv_a: its gradient arrives tp-partial; a float8 cast of partial sums is not
    # one device's numbers, so parallelize refuses it naming the filter_fqns entry
    with torch.device("cpu"):
        models = [_model_config("tensorwise", backend, "deepseek_v3", keep=["lm_head"]).build()
                  for _ in range(TP)]
    dist_utils.set_spmd_backend(backend)

    def rank_main(rank):
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=TP, pp=1, ep=1, world_size=TP,
                            spmd_backend=backend)
        with pytest.raises(ValueError, match=r"wkv_a.*tp-partial.*filter_fqns"):
            models[rank].parallelize(dims)
        return True

    assert all(run_threads(TP, rank_main))


@pytest.mark.parametrize("backend", BACKENDS)
def test_torchtitan_tp_keeps_high_precision_models_as_they_are(cpu_mesh, backend):
    for logits_db, grad_db, _, gathers in run_tp("bf16", backend):
        assert logits_db > FLOOR_DB and grad_db > FLOOR_DB
        assert (gathers.calls, gathers.input_bytes) == _gathers("bf16", torch.float32)


class _RowCast(torch.autograd.Function):
    """One device's [Note: float8 combine and backward]: rows cast and dequantized per token with
    ``spec`` in forward (None: as they are), their gradient with ``grad_spec`` in backward."""

    @staticmethod
    def forward(ctx, x, spec, grad_spec):
        ctx.grad_spec = grad_spec
        return x if spec is None else cast_to_float8(x, spec).to_original_precision()

    @staticmethod
    def backward(ctx, grad):
        return cast_to_float8(grad, ctx.grad_spec).to_original_precision(), None, None


def _float8_combine_and_backward(model):
    """Cast ``model``'s experts' outputs, and their outputs' and inputs' gradients, where an EP
    run with ``float8_combine`` and ``float8_backward`` casts them."""
    for experts in model.modules():
        if isinstance(experts, GroupedExperts):
            experts.register_forward_pre_hook(lambda m, args: (
                _RowCast.apply(args[0], None, ep_dispatch.GRAD_SPEC), *args[1:]))
            experts.register_forward_hook(lambda m, args, out: _RowCast.apply(
                out, ep_dispatch.COMBINE_SPEC, ep_dispatch.GRAD_SPEC))


def run_ep(recipe, backend, dtype=torch.float32, float8_combine_and_backward=False):
    """deepseek_v3's debug model (two blocks), its routed experts converted (``recipe`` "bf16":
    none), on ep 2 (dp_shard 2, each rank its own batch) with torchtitan's own expert
    parallelism (with ``float8_combine_and_backward``: those all-to-alls in float8, one device
    casting the same rows). Per rank: (whether its logits are one device's bit for bit, the min
    SQNR of its experts' weight gradients against one device's slice of them, the forward's and
    the backward's all-to-alls as ``CollectiveStats``), the model built in ``dtype``."""
    both = float8_combine_and_backward
    converters = [] if recipe == "bf16" else [tt.Float8GroupedExpertsConverter.Config(
        recipe_name=recipe, float8_combine=both, float8_backward=both)]
    config = _sdpa(deepseek_v3.model_registry("debugmodel", converters=converters).model)
    config.layers = config.layers[:BLOCKS]
    parallelism = ParallelismConfig(data_parallel_shard_degree=EP, expert_parallel_degree=EP,
                                    spmd_backend=backend)
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    torch.manual_seed(0)
    with torch.device("cpu"), set_default_dtype(dtype):
        reference = config.build()
    with torch.no_grad():
        reference.init_weights(buffer_device=None)
    models = [copy.deepcopy(reference) for _ in range(EP)]
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 2048, (EP * BATCH, SEQ), generator=gen)
    grad_logits = torch.randn(EP * BATCH, SEQ, 2048, generator=gen, dtype=dtype)
    if both:
        _float8_combine_and_backward(reference)
    logits = reference(tokens)
    logits.backward(grad_logits)
    dist_utils.set_spmd_backend(backend)

    def rank_main(rank):
        model, mine = models[rank], slice(rank * BATCH, (rank + 1) * BATCH)
        dims = ParallelDims(dp_replicate=1, dp_shard=EP, cp=1, tp=1, pp=1, ep=EP, world_size=EP,
                            spmd_backend=backend)
        model.parallelize(dims)
        with dist_utils.get_spmd_context(parallel_dims=dims)():
            annotate = (annotate_input_spmd_types if backend == "spmd_types"
                        else full_dtensor.parallelize_inputs)
            inputs, _, _ = annotate(dims, tokens[mine].clone(), tokens[mine].clone(), {})
            with count_collectives() as forward:
                out = model(inputs)
            grad = grad_logits[mine]
            if isinstance(out, DTensor):
                grad = DTensor.from_local(grad, out.device_mesh, out.placements)
            with count_collectives() as backward:
                out.backward(grad)
        local = out.to_local() if isinstance(out, DTensor) else out
        grads = []
        for name, experts in model.named_modules():
            if not isinstance(experts, GroupedExperts):
                continue
            one = reference.get_submodule(name)
            for pname, param in experts.named_parameters():
                grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                one_grad = one.get_parameter(pname).grad.chunk(EP)[rank]
                grads.append(sqnr(one_grad, grad))
        return (torch.equal(local, logits[mine]), min(grads), forward["all_to_all"],
                backward["all_to_all"])

    return run_threads(EP, rank_main)


@functools.lru_cache
def _run_ep_bf16(backend):
    """run_ep("bf16", backend), once per backend: the high-precision bytes both EP tests compare
    with."""
    return run_ep("bf16", backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_torchtitan_ep_dispatches_float8_tokens(cpu_mesh, backend):
    """Float8AllToAllTokenDispatcher: rowwise experts take their tokens cast before torchtitan's
    dispatch all-to-all, one device's bytes: bit-identical logits and expert weight gradients
    (each rank's slice of them); the dispatch moves D + 4
    bytes per routed token (bytes, then its fp32 scale: two all-to-alls) where it moved 4 D."""
    tokens = BATCH * SEQ * TOP_K  # routed tokens each rank sends
    high = _run_ep_bf16(backend)
    for (same, grad_db, gathers, _), (_, _, high_gathers, _) in zip(run_ep("rowwise", backend),
                                                                    high):
        assert same and grad_db == float("inf"), grad_db  # one device's, bit for bit
        assert gathers.calls == high_gathers.calls + 1
        assert gathers.input_bytes == high_gathers.input_bytes - tokens * (4 * DIM - DIM - 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_torchtitan_ep_combines_and_backpropagates_in_float8(cpu_mesh, backend):
    """float8_combine and float8_backward: the combine and both backward all-to-alls carry e4m3
    rows per token too, one device's numbers where one device casts the same rows (the experts'
    outputs, their outputs' and inputs' gradients): bit-identical logits and expert weight
    gradients; each of the three moves D + 4 bytes per routed token where it moved 4 D (the
    ranks together: each sends back as many rows as it received)."""
    routed = EP * BATCH * SEQ * TOP_K  # routed tokens, all ranks
    saved = routed * (4 * DIM - DIM - 4)
    high = _run_ep_bf16(backend)
    ranks = run_ep("rowwise", backend, float8_combine_and_backward=True)
    for same, grad_db, _, _ in ranks:
        assert same and grad_db == float("inf"), grad_db  # one device's, bit for bit
    for k, casts in ((2, 2), (3, 2)):  # forward (dispatch, combine), backward (the two)
        calls = sum(r[k].calls - h[k].calls for r, h in zip(ranks, high))
        moved = sum(h[k].input_bytes - r[k].input_bytes for r, h in zip(ranks, high))
        assert (calls, moved) == (EP * casts, casts * saved)


def main():
    """The table of docs/torchtitan.md: llama3, each backend and recipe, tp 2, one rank's figures
    (the ranks' agree): against one device in fp32 and in bf16, and the bf16 model's forward
    all-gathers."""
    parallel_dims_module.device_type = "cpu"
    print("| backend | recipe | fp32: logits / min weight-grad SQNR (dB) | bf16: logits / min "
          "weight-grad SQNR (dB) | forward all-gathers (bf16) | their bytes per rank |")
    print("|---|---|---|---|---|---|")
    for backend in BACKENDS:
        for recipe in ["bf16", "tensorwise", "rowwise", "delayed"]:
            fp32 = run_tp(recipe, backend)[0]
            bf16 = run_tp(recipe, backend, torch.bfloat16)[0]
            gathers = bf16[3]
            assert (gathers.calls, gathers.input_bytes) == _gathers(recipe, torch.bfloat16)
            print(f"| {backend} | {recipe} | {fp32[0]:.1f} / {fp32[1]:.1f} | {bf16[0]:.1f} / "
                  f"{bf16[1]:.1f} | {gathers.calls} | {gathers.input_bytes:,} |")
    print()
    print("| backend | routed experts | logits one device's (fp32 / bf16) | min experts' "
          "weight-grad SQNR, fp32 (dB) | forward all-to-alls (bf16) | their bytes, rank 0 |")
    print("|---|---|---|---|---|---|")
    for backend in BACKENDS:
        for recipe in ["bf16", "rowwise"]:
            fp32, bf16 = run_ep(recipe, backend)[0], run_ep(recipe, backend, torch.bfloat16)[0]
            print(f"| {backend} | {recipe} | {fp32[0]} / {bf16[0]} | {fp32[1]:.1f} | "
                  f"{bf16[2].calls} | {bf16[2].input_bytes:,} |")


if __name__ == "__main__":
    main()
