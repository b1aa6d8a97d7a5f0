"""Float8 parallel styles: construction-time checks and repr (sharding runs in tests/distributed)."""

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from f8dist.parallel.tp import Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


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


@pytest.mark.parametrize("recipe, style, shape, block", [
    ("mxfp8", Float8RowwiseParallel, (96, 64), 32),  # in_features 96: 48 per rank
    ("mxfp8", Float8ColwiseParallel, (64, 96), 32),  # out_features 96 (grad_input's N blocks)
    ("blockwise", Float8ColwiseParallel, (128, 128), 128),  # 64 rows of a 128x128 block
])
def test_shards_that_split_blocks_name_the_fix(recipe, style, shape, block):
    """[Note: block scales on tensor-parallel shards]: a TP shard that splits a block raises at
    parallelize time, naming the layer and the fix; block-aligned shards are accepted."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from f8dist import Float8Linear, Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        bad = Float8Linear.from_float(torch.nn.Linear(*shape, bias=False), config, fqn="w1")
        with pytest.raises(ValueError, match=rf"{style.__name__} on w1 .* over 2 ranks.*"
                                             rf"splits its {block}-wide blocks.*tensor-parallel "
                                             r"degree.*module_filter_fn"):
            parallelize_module(bad, mesh, style())
        good = Float8Linear.from_float(torch.nn.Linear(2 * block, 2 * block, bias=False), config)
        parallelize_module(good, mesh, style())
    finally:
        dist.destroy_process_group()
