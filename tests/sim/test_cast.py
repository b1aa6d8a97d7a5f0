"""``cast_to_float8`` of DTensors on a 2 x 2 x 4 mesh of 16 simulated ranks (LocalTensorMode,
[Note: simulating ranks in one process] in tests/sim/__init__.py) against one device: every
rank's float8 values and scales are those of one device's cast of the whole tensor, and the amax
is all-reduced over exactly the mesh axes that shard it ([Note: amax] in f8dist/core/placement.py):
a sequence-parallel activation over tp, a K-sharded per-token cast over tp, a block cast over
none. (16 ranks, not 64: in torch 2.13 DTensor computes every simulated rank's mesh coordinate
per op, about 10 s a DTensor op on 64 ranks.)"""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from f8dist import Float8LinearConfig
from f8dist.core.cast import cast_to_float8
from f8dist.config import Gemm, Operand
from f8dist.testing import count_collectives
from tests.sim.local import local_world, per_rank, shard

MESH = (2, 2, 4)  # dp_replicate x dp_shard x tp
WORLD = 16
NAMES = ("dp_replicate", "dp_shard", "tp")

CASES = [  # (recipe, placements of a [B, S, D] activation, axes its amax is reduced over)
    ("tensorwise", [Replicate(), Replicate(), Shard(1)], ["tp"]),  # SP: sequence-sharded
    ("rowwise", [Replicate(), Replicate(), Shard(2)], ["tp"]),  # per-token amax over K shards
    ("mxfp8", [Replicate(), Replicate(), Shard(2)], []),  # 128 / 4 = 32: whole 1x32 blocks
]


@pytest.mark.parametrize("recipe, placements, axes", CASES)
def test_cast_of_a_dtensor_on_16_ranks_is_one_devices(recipe, placements, axes):
    spec = Float8LinearConfig.from_recipe_name(recipe).cast_spec(Gemm.OUTPUT, Operand.INPUT)
    x = torch.randn(2, 16, 128, generator=torch.Generator().manual_seed(0))  # [B, S, D]
    x[1, 5, 7] = 40.0  # one outlier: its tp shard alone holds the amax
    ref = cast_to_float8(x, spec)
    ref_values = ref.to_original_precision()
    with local_world(WORLD) as mode:
        mesh = init_device_mesh("cpu", MESH, mesh_dim_names=NAMES)
        d = shard(x, mesh, placements, mode)
        with count_collectives() as counts:
            fp8 = cast_to_float8(d, spec)
        local = fp8.to_local()
        # every rank's float8 values, gathered in high precision, are one device's cast
        values = DTensor.from_local(local.to_original_precision(), mesh, placements).full_tensor()
        for rank, v in per_rank(values, WORLD).items():
            assert torch.equal(v, ref_values), rank
        if not spec.axiswise and not spec.blockwise:  # one scale: the whole tensor's
            for rank, s in per_rank(local._scale, WORLD).items():
                assert torch.equal(s, ref._scale), rank
        reduces = counts["all_reduce"]
        assert reduces.calls == len(axes)
        for axis in axes:
            assert reduces.calls_over(mesh[axis], "max") == 1
