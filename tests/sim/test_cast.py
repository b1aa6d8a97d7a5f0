"""``cast_to_float8`` of DTensors on a 2 x 2 x 4 mesh of 16 simulated ranks (LocalTensorMode,
[Note: simulating ranks in one process] in tests/sim/__init__.py) against one device: every
rank's float8 values and scales are those of one device's cast of the whole tensor, and the amax
is all-reduced over exactly the mesh axes that shard it ([Note: amax] in f8dist/core/placement.py):
a sequence-parallel activation over tp, a K-sharded per-token cast over tp, a block cast over
none. NVFP4 on a dp 2 x tp 4 mesh of 8: one device's bytes, block scales and tensor scale, sliced.
(16 ranks, not 64: in torch 2.13 DTensor computes every simulated rank's mesh coordinate
per op, about 10 s a DTensor op on 64 ranks.)"""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from f8dist import Float8LinearConfig
from f8dist.core.cast import cast_to_float8, stochastic_rounding
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


# [B, S, D] activations and gradients in 1x16 blocks, the [N, K] weight in 16x16 ones, on a
# dp 2 x tp 4 mesh: every shard holds whole 16-blocks (S 16 / 4, D 128 / 4, N 64 / 2, K 128 / 4)
NVFP4_CASES = [  # (gemm, operand, shape, placements over (dp, tp), axes its amax is reduced over)
    (Gemm.OUTPUT, Operand.INPUT, (2, 16, 128), [Replicate(), Shard(1)], ["tp"]),  # SP: tokens
    (Gemm.OUTPUT, Operand.INPUT, (2, 16, 128), [Replicate(), Shard(2)], ["tp"]),  # features
    (Gemm.OUTPUT, Operand.INPUT, (2, 16, 128), [Replicate(), Replicate()], []),
    (Gemm.GRAD_INPUT, Operand.GRAD_OUTPUT, (2, 16, 128), [Shard(0), Shard(2)], ["dp", "tp"]),
    (Gemm.OUTPUT, Operand.WEIGHT, (64, 128), [Shard(0), Shard(1)], ["dp", "tp"]),  # FSDP x TP
    (Gemm.OUTPUT, Operand.WEIGHT, (64, 128), [Replicate(), Shard(0)], ["tp"]),  # colwise
]


@pytest.mark.parametrize("gemm, operand, shape, placements, axes", NVFP4_CASES)
def test_nvfp4_cast_of_a_dtensor_is_one_devices_sliced(gemm, operand, shape, placements, axes):
    """NVFP4 ([Note: NVFP4] in f8dist/config/cells.py): every rank holds exactly the e2m1 bytes
    and e4m3 block scales of one device's cast sliced to its shard (block scales are local), and
    one device's float32 tensor scale: the logical amax, all-reduced once over exactly the axes
    that shard the tensor (several at once in ONE collective), nothing when nothing does."""
    spec = Float8LinearConfig.from_recipe_name("nvfp4").cast_spec(gemm, operand)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    x[(1,) * (len(shape) - 1) + (7,)] = 40.0  # one outlier: one shard alone holds the amax
    stochastic_rounding.reset()  # gradients: the same draw as the ranks' below
    ref = cast_to_float8(x, spec)
    stochastic_rounding.reset()
    with local_world(8) as mode:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        with count_collectives() as counts:
            fp8 = cast_to_float8(shard(x, mesh, placements, mode), spec)
        local = fp8.to_local()
        # one device's cast, sliced as the shards are (its block grid cut where its blocks are)
        data = shard(ref._data.view(torch.uint8), mesh, placements, mode).to_local()
        scales = shard(ref._scale.view(torch.uint8), mesh, placements, mode).to_local()
        got = per_rank(local._data.view(torch.uint8), 8), per_rank(local._scale.view(torch.uint8), 8)
        for rank in range(8):
            assert torch.equal(got[0][rank], per_rank(data, 8)[rank]), rank
            assert torch.equal(got[1][rank], per_rank(scales, 8)[rank]), rank
            assert torch.equal(per_rank(local._tensor_scale, 8)[rank], ref._tensor_scale), rank
        reduces = counts["all_reduce"]
        assert (reduces.calls, counts.total_calls) == (min(len(axes), 1), reduces.calls)
        if axes:
            ranks = mesh[tuple(axes)]._flatten() if len(axes) > 1 else mesh[axes[0]]
            assert reduces.calls_over(ranks, "max") == 1


SR_CASES = [  # (ranks, mesh, placements of a [B, S, D] gradient); uneven shards: test_placement.py
    (2, (2,), [Shard(0)]),
    (4, (4,), [Shard(1)]),
    (2, (2,), [Shard(2)]),
    (4, (2, 2), [Shard(1), Shard(2)]),
    (4, (2, 2), [Shard(1), Shard(1)]),  # one dim cut twice
    (4, (2, 2), [Shard(0), Replicate()]),
]


@pytest.mark.parametrize("world, mesh_shape, placements", SR_CASES)
def test_stochastic_nvfp4_cast_of_a_dtensor_is_one_devices_sliced(world, mesh_shape, placements):
    """[Note: stochastic rounding] in f8dist/core/scaling.py: each element draws by its position
    in the logical tensor ([Note: global positions] in f8dist/core/placement.py), so every rank's
    e2m1 bytes are one device's stochastically rounded cast, sliced, bit for bit."""
    spec = Float8LinearConfig.from_recipe_name("nvfp4").cast_spec(Gemm.GRAD_INPUT,
                                                                   Operand.GRAD_OUTPUT)
    assert spec.stochastic_rounding  # NVIDIA's recipe rounds gradients stochastically
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(0))  # [B, S, D]
    stochastic_rounding.reset(3)
    ref = cast_to_float8(x, spec)
    stochastic_rounding.reset(3)  # every rank derives the same key ([Note: the stochastic ...])
    with local_world(world) as mode:
        mesh = init_device_mesh("cpu", mesh_shape)
        local = cast_to_float8(shard(x, mesh, placements, mode), spec).to_local()
        data = per_rank(shard(ref._data.view(torch.uint8), mesh, placements, mode).to_local(), world)
        got = per_rank(local._data.view(torch.uint8), world)
        for rank in range(world):
            assert torch.equal(got[rank], data[rank]), rank
    stochastic_rounding.reset(3)
    assert torch.equal(cast_to_float8(x, spec)._data.view(torch.uint8), ref._data.view(torch.uint8))
    assert not torch.equal(cast_to_float8(x, spec)._data.view(torch.uint8),  # the next draw
                           ref._data.view(torch.uint8))


@pytest.mark.parametrize("operand", [Operand.INPUT, Operand.GRAD_OUTPUT])
def test_random_hadamard_cast_of_token_shards_is_one_devices_sliced(operand):
    """[Note: random Hadamard transform] in f8dist/core/scaling.py: a sequence shard holding
    whole 16-token blocks transforms and casts them as one device does; one that splits them is
    refused, naming the split."""
    spec = Float8LinearConfig.from_recipe_name("nvfp4").cast_spec(Gemm.GRAD_WEIGHT, operand)
    assert spec.random_hadamard
    x = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(0))  # [B, S, C]
    stochastic_rounding.reset()
    ref = cast_to_float8(x, spec)
    stochastic_rounding.reset()
    with local_world(2) as mode:
        mesh = init_device_mesh("cpu", (2,))
        local = cast_to_float8(shard(x, mesh, [Shard(1)], mode), spec).to_local()
        data = per_rank(shard(ref._data.view(torch.uint8), mesh, [Shard(1)], mode).to_local(), 2)
        got = per_rank(local._data.view(torch.uint8), 2)
        for rank in range(2):
            assert torch.equal(got[rank], data[rank]), rank
        with pytest.raises(NotImplementedError, match="into 24 per rank, which splits its 16-wide"):
            cast_to_float8(shard(x[:, :48], mesh, [Shard(1)], mode), spec)
