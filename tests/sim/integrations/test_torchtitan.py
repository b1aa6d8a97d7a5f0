"""torchtitan 0.3.0's own tensor parallelism (``Module.parallelize`` from the model's
ShardingConfigs, sequence parallel on) over f8dist's converted llama3 debug model (two blocks),
tp 2 on simulated ranks (threads, [Note: simulating ranks in one process] in tests/sim/__init__.py),
on both of its backends, against one device: [Note: float8 casts under spmd_types] and [Note:
delayed buffers under torchtitan's parallelize] in f8dist/integrations/torchtitan.py.

Skipped with tests/integrations/test_torchtitan.py when torchtitan is not installed.
"""

import copy
import types

import pytest
import torch

from tests.integrations.test_torchtitan import _converter, _sdpa  # skips without torchtitan

import torchtitan.distributed.parallel_dims as parallel_dims_module  # noqa: E402
from torchtitan.config import ParallelismConfig  # noqa: E402
from torchtitan.distributed import ParallelDims, full_dtensor  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.distributed.spmd_types import annotate_input_spmd_types  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402

import f8dist  # noqa: E402
import f8dist.integrations.torchtitan as tt  # noqa: E402
from f8dist.numerics import sqnr  # noqa: E402
from tests.sim.threads import run_threads  # noqa: E402

TP = 2
BACKENDS = ["spmd_types", "full_dtensor"]
# one device's float8 numbers up to the order of TP's sums: bf16 (no float8) runs the same model
# at about 146 dB from one device; a tensorwise cast of each rank's shard with its own amax (what
# spmd_types gave before the layer cast on DTensors) is about 55 dB away
FLOOR_DB = 100


@pytest.fixture
def cpu_mesh(monkeypatch):
    """torchtitan builds its meshes on ``tools.utils.device_type`` ("cuda" on a machine without
    an accelerator): CPU meshes here; the backend is torchtitan's process-wide setting."""
    monkeypatch.setattr(parallel_dims_module, "device_type", "cpu")
    yield
    dist_utils.set_spmd_backend("spmd_types")


def _model_config(recipe, backend):
    config = _sdpa(model_registry("debugmodel", converters=[_converter(recipe)]).model)
    config.layers = config.layers[:2]
    parallelism = ParallelismConfig(tensor_parallel_degree=TP, enable_sequence_parallel=True,
                                    spmd_backend=backend)
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    return config


def _full(t, dim):
    """The whole tensor of a rank's ``t``: a DTensor's, or a plain shard gathered on ``dim``."""
    if hasattr(t, "full_tensor"):
        return t.full_tensor()
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


def run_tp(recipe, backend):
    """Per rank: (logits SQNR, min weight-gradient SQNR over the float8 linears, the delayed
    buffers that differ from one device's after the sync) against one device."""
    torch.manual_seed(0)
    reference = _model_config(recipe, backend).build()
    with torch.no_grad():
        reference.init_weights(buffer_device=None)
    models = [copy.deepcopy(reference) for _ in range(TP)]
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 2048, (2, 32), generator=gen)
    grad_logits = torch.randn(2, 32, 2048, generator=gen)
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
            out = model(inputs)
            grad = (grad_logits.chunk(TP, -1)[rank] if backend == "spmd_types"
                    else torch.distributed.tensor.distribute_tensor(
                        grad_logits, out.device_mesh, out.placements))
            out.backward(grad)
        f8dist.sync_float8_amax_and_scale_history(model)
        grads, other_buffers = [], []
        for name, linear in model.named_modules():
            if not isinstance(linear, tt.Float8Linear):
                continue
            one = reference.get_submodule(name)
            dim = _weight_dim(linear)
            grads.append(sqnr(one.weight.grad, linear.weight.grad if dim is None
                              else _full(linear.weight.grad, dim)))
            other_buffers += [f"{name}.{n}: {b.tolist()} != {one.get_buffer(n).tolist()}"
                              for n, b in linear.named_buffers()
                              if not _same_amaxes(b, one.get_buffer(n))]
        return sqnr(logits, _full(out, -1)), min(grads), other_buffers

    return run_threads(TP, rank_main)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_torchtitan_tp_gives_one_device_float8_numbers(cpu_mesh, recipe, backend):
    for logits_db, grad_db, other_buffers in run_tp(recipe, backend):
        assert logits_db > FLOOR_DB, (recipe, backend, logits_db)
        assert grad_db > FLOOR_DB, (recipe, backend, grad_db)
        assert not other_buffers, other_buffers[:4]
