"""Float8 parallel styles: construction-time checks and repr (sharding runs in tests/distributed)."""

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from f8dist.tp import Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def test_styles_are_pytorchs_styles_with_its_keywords():
    col = Float8ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=False)
    row = Float8RowwiseParallel(output_layouts=Shard(1))
    assert isinstance(col, ColwiseParallel) and isinstance(row, RowwiseParallel)
    assert col.input_layouts == (Shard(1),) and col.output_layouts == (Replicate(),)
    assert row.input_layouts == (Shard(-1),) and row.output_layouts == (Shard(1),)
    assert repr(col).startswith("Float8ColwiseParallel(input_layouts=(Shard(dim=1),)")


def test_prepare_input_repr_and_keywords():
    style = PrepareFloat8ModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), fwd_config_submodule_fqn="w1"
    )
    assert isinstance(style, PrepareModuleInput)
    assert "fwd_config_submodule_fqn='w1'" in repr(style)


@pytest.mark.parametrize(
    "make",
    [
        lambda: Float8ColwiseParallel(input_layouts=Partial()),
        lambda: Float8RowwiseParallel(input_layouts=Partial()),
        lambda: PrepareFloat8ModuleInput(input_layouts=(Partial(),), desired_input_layouts=(Replicate(),)),
    ],
)
def test_partial_inputs_cannot_be_cast(make):
    with pytest.raises(ValueError, match="amax of partial sums"):
        make()


def test_dtype_and_submodule_config_are_exclusive():
    with pytest.raises(ValueError, match="not both"):
        PrepareFloat8ModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
            float8_dtype=torch.float8_e4m3fn, fwd_config_submodule_fqn="w1",
        )


@pytest.mark.parametrize("style", [Float8ColwiseParallel, Float8RowwiseParallel])
def test_block_scaled_layers_say_tensor_parallel_is_unsupported(style):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from f8dist import Float8Linear, Float8LinearConfig

    with torch.device("cpu"):
        lin = Float8Linear.from_float(torch.nn.Linear(64, 64),
                                      Float8LinearConfig.from_recipe_name("mxfp8"), fqn="w1")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(NotImplementedError, match="on w1: tensor and sequence parallel with "
                                                      "block scales .* not supported yet"):
            parallelize_module(lin, init_device_mesh("cpu", (2,)), style())
    finally:
        dist.destroy_process_group()
