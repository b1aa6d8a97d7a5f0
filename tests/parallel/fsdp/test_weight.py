"""One-device tests of Float8AllGatherWeight: the wrapper's op behaviour, its FSDP2 hooks (with a
precomputed scale, so no process group is needed) and its state_dict."""

import copy

import pytest
import torch
import torch.nn as nn

from f8dist import Float8Linear, Float8LinearConfig, Float8Tensor
from f8dist.core.cast import cast_to_float8
from f8dist.config import CastSpec
from f8dist.parallel.fsdp import Float8AllGatherWeight
from f8dist.core.scaling import amax_to_scale

E4M3 = torch.float8_e4m3fn
CONFIG = Float8LinearConfig(enable_fsdp_float8_all_gather=True)


class _Mesh:
    """Stands in for FSDP2's shard mesh: the hooks only ask for its size here."""

    def __init__(self, size):
        self._size = size
        self.ndim = 1

    def size(self, dim=None):
        return self._size


def _wrapped(rows=6, cols=16, seed=0):
    torch.manual_seed(seed)
    return Float8AllGatherWeight(torch.randn(rows, cols), CONFIG)


def test_view_ops_keep_the_wrapper_and_math_returns_plain():
    w = _wrapped()
    for t in (*torch.chunk(w, 3), w.narrow(0, 1, 2), w.view(-1), w.new_zeros(2, 16), w.detach()):
        assert type(t) is Float8AllGatherWeight
    assert type(w * 2) is torch.Tensor
    assert torch.equal(torch.chunk(w, 3)[1]._tensor, w._tensor[2:4])


def test_in_place_ops_update_the_wrapped_tensor_and_drop_a_precomputed_scale():
    w = _wrapped()
    before = w._tensor.clone()
    w._precomputed = (torch.tensor(1.0), w._tensor._version)
    out = w.add_(1.0)
    assert out is w
    assert torch.equal(w._tensor, before + 1)
    assert w._precomputed is None


def _pre_all_gather(shard, world, total_rows, scale):
    shard._precomputed = (scale, shard._tensor._version)
    return shard.fsdp_pre_all_gather(
        _Mesh(world), torch.Size([total_rows, shard.shape[1]]), (shard.shape[1], 1), None, None
    )


@pytest.mark.parametrize("rows", [2, 0])  # a short and an empty shard of a 6-row weight on 3 ranks
def test_pre_all_gather_casts_with_the_given_scale_and_pads(rows):
    full = torch.randn(6, 16)
    scale = amax_to_scale(full.abs().max(), E4M3)
    shard = Float8AllGatherWeight(full[:rows], CONFIG)
    # 7 rows -> padded to 3; on 3 ranks nothing rides along with the metadata
    (data,), (meta, local) = _pre_all_gather(shard, 3, 7, scale)
    assert data.dtype == torch.uint8 and data.shape == (3, 16)
    expected = cast_to_float8(full[:rows], CastSpec(dtype=E4M3), scale)._data.view(torch.uint8)
    assert torch.equal(data[:rows], expected)
    assert torch.equal(data[rows:], torch.zeros(3 - rows, 16, dtype=torch.uint8))
    # the scale stays home, in the metadata ([Note: the wire] in f8dist/core/tensor.py)
    assert torch.equal(meta.scale, scale) and meta.dtype == E4M3 and local == ()


def test_post_all_gather_gives_the_one_device_float8_weight_and_updates_in_place():
    full = torch.randn(4, 16)
    scale = amax_to_scale(full.abs().max(), E4M3)
    shards = [Float8AllGatherWeight(full[i * 2:(i + 1) * 2], CONFIG) for i in range(2)]
    inputs = [_pre_all_gather(s, 2, 4, scale) for s in shards]
    gathered = torch.cat([i[0][0] for i in inputs])  # what the all-gather produces [4, 16]
    fp8, inner = shards[0].fsdp_post_all_gather((gathered,), inputs[0][1], torch.bfloat16)
    one_device = cast_to_float8(full, CastSpec(dtype=E4M3))
    assert isinstance(fp8, Float8Tensor) and fp8.dtype == torch.bfloat16
    assert torch.equal(fp8._data.view(torch.uint8), one_device._data.view(torch.uint8))
    assert torch.equal(fp8._scale, one_device._scale)
    assert inner[0].untyped_storage().data_ptr() == fp8._data.untyped_storage().data_ptr()

    # second all-gather: FSDP2 refills the same buffer and passes out=; only the scale changes
    new_scale = scale / 2
    meta = inputs[0][1][0]._replace(scale=new_scale)
    assert shards[0].fsdp_post_all_gather((gathered,), (meta, ()), torch.bfloat16, out=fp8) is None
    assert torch.equal(fp8._scale, new_scale)


def test_float8_linear_with_fp8_all_gather_matches_without_and_keeps_plain_state_dict():
    torch.manual_seed(0)
    lin = nn.Linear(32, 16)
    plain_sd = {k: v.clone() for k, v in lin.state_dict().items()}
    ref = Float8Linear.from_float(nn.Linear(32, 16), Float8LinearConfig())
    ref.load_state_dict(plain_sd)
    f8 = Float8Linear.from_float(lin, CONFIG)
    assert type(f8.weight) is Float8AllGatherWeight
    x = torch.randn(16, 32, requires_grad=True)
    y, y_ref = f8(x), ref(x)
    assert torch.equal(y, y_ref)
    y.sum().backward()
    g = x.grad.clone()
    x.grad = None
    y_ref.sum().backward()
    assert torch.equal(g, x.grad)
    assert torch.equal(f8.weight.grad, ref.weight.grad)

    sd = f8.state_dict()
    assert list(sd) == ["weight", "bias"]
    assert all(type(v) is torch.Tensor for v in sd.values())
    back = nn.Linear(32, 16)
    back.load_state_dict(sd)  # into the plain model
    assert torch.equal(back.weight, plain_sd["weight"])
    with torch.no_grad():
        back.weight.mul_(3)
    f8.load_state_dict(back.state_dict())  # and back
    assert type(f8.weight) is Float8AllGatherWeight
    assert torch.equal(f8.weight._tensor, back.weight)


def test_float8_experts_with_fp8_all_gather_match_without_and_keep_plain_state_dict():
    """[Note: float8 all-gather of expert weights]: w1, w2, w3 wrapped, the same numbers, a
    GroupedExperts state dict of plain tensors, wrapped again after load_state_dict(assign=True)."""
    from f8dist.nn.grouped import Float8GroupedExperts, GroupedExperts

    experts = GroupedExperts(32, 16, 4)
    experts.init_weights(0.02, torch.Generator().manual_seed(0))
    tensorwise = Float8LinearConfig.from_recipe_name("tensorwise")
    ref = Float8GroupedExperts.from_float(copy.deepcopy(experts), tensorwise)
    f8 = Float8GroupedExperts.from_float(experts, tensorwise.replace(enable_fsdp_float8_all_gather=True))
    assert all(type(getattr(f8, w)) is Float8AllGatherWeight for w in ("w1", "w2", "w3"))
    x = torch.randn(10, 32)
    offsets = torch.tensor([3, 3, 7, 10], dtype=torch.int32)  # expert 1 gets no token
    y, y_ref = f8(x, offsets), ref(x, offsets)
    assert torch.equal(y, y_ref)
    y.sum().backward()
    y_ref.sum().backward()
    assert torch.equal(f8.w2.grad, ref.w2.grad)

    sd = f8.state_dict()
    assert sorted(sd) == ["w1", "w2", "w3"] and all(type(v) is torch.Tensor for v in sd.values())
    f8.load_state_dict({k: v * 2 for k, v in sd.items()}, assign=True)
    assert type(f8.w3) is Float8AllGatherWeight and torch.equal(f8.w3._tensor, sd["w3"] * 2)
