import copy
import logging

import pytest
import torch
import torch.nn as nn

from f8dist import Float8Linear, Float8LinearConfig, convert_to_float8_training
from f8dist.core.numerics import sqnr


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)) for _ in range(2)
        )
        self.odd = nn.Linear(64, 24)
        self.output = nn.Linear(64, 32)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.output(x) + self.odd(x).sum(-1, keepdim=True)


def _float8_fqns(model):
    return sorted(m.fqn for m in model.modules() if isinstance(m, Float8Linear))


def test_swaps_in_place_with_fqns_and_shared_parameters():
    model = Net()
    w = model.blocks[0][0].weight
    out = convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != "output")
    assert out is model
    assert _float8_fqns(model) == ["blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2"]
    assert model.blocks[0][0].weight is w  # no copy
    assert type(model.output) is nn.Linear


def test_unaligned_linears_are_skipped_with_a_note(caplog):
    model = Net()
    with caplog.at_level(logging.WARNING, logger="f8dist.nn.convert"):
        convert_to_float8_training(model)
    assert type(model.odd) is nn.Linear
    assert "odd (64 -> 24: out_features=24 (multiple of 16))" in caplog.text
    assert "pad_inner_dim" in caplog.text
    assert "output" in _float8_fqns(model)


def test_the_note_says_which_rule_each_kept_layer_breaks(caplog):
    """A block recipe keeps a linear whose dims are multiples of 16 but not of its blocks: the
    note names the block, not the alignment; a grouped layer's note says the same."""
    from f8dist.nn.grouped import GroupedExperts

    model = nn.ModuleDict({"a": nn.Linear(48, 80), "b": nn.Linear(40, 64),
                           "experts": GroupedExperts(48, 64, 2)})
    with caplog.at_level(logging.WARNING, logger="f8dist.nn.convert"):
        convert_to_float8_training(model, config="mxfp8")
    assert all(type(model[n]) is not Float8Linear for n in ("a", "b"))
    text = caplog.text
    assert "a (48 -> 80: in_features=48 (block 32), out_features=80 (block 32))" in text
    assert "b (40 -> 64: in_features=40 (multiple of 16))" in text
    assert "experts (experts 48 <-> 64: dim=48 (block 32))" in text
    assert "not multiples of 16" not in text


def test_forcing_an_unaligned_linear_raises_a_clear_error():
    with pytest.raises(ValueError, match=r"odd \(64 -> 24\).*N=24"):
        convert_to_float8_training(Net(), skip_incompatible=False)
    model = convert_to_float8_training(Net(), config=Float8LinearConfig(pad_inner_dim=True))
    assert isinstance(model.odd, Float8Linear)


def test_a_bare_linear_is_returned_converted():
    lin = convert_to_float8_training(nn.Linear(32, 32))
    assert isinstance(lin, Float8Linear) and lin.fqn == ""


def test_converting_again_is_a_no_op_with_the_same_config_and_an_error_with_another():
    model = convert_to_float8_training(Net())
    first = model.blocks[0][0]
    convert_to_float8_training(model)
    assert model.blocks[0][0] is first
    with pytest.raises(ValueError, match=r"blocks\.0\.0: already a Float8Linear.*round_scales"):
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"))
    assert model.blocks[0][0] is first and model.blocks[0][0].config == Float8LinearConfig()


def test_a_linears_child_modules_are_kept_and_converted():
    for root in (True, False):
        lin = nn.Linear(32, 32)
        lin.add_module("adapter", nn.Sequential(nn.Linear(32, 16)))
        model = lin if root else nn.Sequential(lin)
        out = convert_to_float8_training(model)
        converted = out if root else out[0]
        assert isinstance(converted, Float8Linear)
        assert isinstance(converted.adapter[0], Float8Linear) and converted.adapter[0].fqn == (
            "adapter.0" if root else "0.adapter.0")
        assert converted.state_dict().keys() == lin.state_dict().keys()


def test_a_raising_filter_leaves_the_model_unchanged():
    model = Net()
    before = [type(m) for m in model.modules()]

    def flaky(mod, fqn):
        if fqn == "output":
            raise RuntimeError("filter failed")
        return True

    with pytest.raises(RuntimeError, match="filter failed"):
        convert_to_float8_training(model, module_filter_fn=flaky)
    assert [type(m) for m in model.modules()] == before  # all or nothing
    with pytest.raises(ValueError, match="odd"):  # an incompatible layer late in the model, too
        convert_to_float8_training(model, skip_incompatible=False)
    assert [type(m) for m in model.modules()] == before


def test_checkpoints_move_between_plain_and_float8_models():
    torch.manual_seed(0)
    plain = Net()
    f8 = convert_to_float8_training(copy.deepcopy(plain))
    assert plain.state_dict().keys() == f8.state_dict().keys()

    # float8 -> plain: identical tensors
    f8_sd = {k: v.clone() + 1 for k, v in f8.state_dict().items()}
    f8.load_state_dict(f8_sd)
    fresh = Net()
    fresh.load_state_dict(f8.state_dict())
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, f8_sd[k])
    # plain -> float8: identical tensors, and the model computes with them
    back = convert_to_float8_training(Net())
    back.load_state_dict(fresh.state_dict())
    for k, v in back.state_dict().items():
        assert torch.equal(v, f8_sd[k])
    x = torch.randn(16, 64)
    assert sqnr(fresh(x), back(x)) > 20


def test_training_a_converted_model_reduces_the_loss():
    torch.manual_seed(0)
    model = convert_to_float8_training(Net(), config=Float8LinearConfig.from_recipe_name("rowwise"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, target = torch.randn(64, 64), torch.randn(64, 32)
    losses = []
    for _ in range(20):
        loss = nn.functional.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


# -- issue 23: tied weights, shared modules, subclasses, misuse ------------------------------------

AG = Float8LinearConfig(enable_fsdp_float8_all_gather=True)


@pytest.mark.parametrize("config", [Float8LinearConfig(), AG], ids=["plain", "fp8_all_gather"])
def test_linears_that_share_a_weight_keep_one_parameter(config):
    # item 2: with the float8 all-gather each linear got its own wrapper Parameter: two trained apart
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    model[2].weight = model[0].weight
    convert_to_float8_training(model, config=config)
    assert model[0].weight is model[2].weight
    assert len(list(model.parameters())) == 3  # one weight, two biases
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(16, 32)).sum().backward()
    opt.step()
    assert torch.equal(model[0].weight, model[2].weight)


def test_a_weight_tied_to_an_unconverted_module_raises_naming_both():
    # item 2: an embedding tied to the output linear; FSDP2 would all-gather it in float8 for both
    model = nn.ModuleDict({"emb": nn.Embedding(64, 32), "lm_head": nn.Linear(32, 64, bias=False)})
    model.lm_head.weight = model.emb.weight
    with pytest.raises(ValueError, match=r"lm_head is tied to emb\.weight.*module_filter_fn"):
        convert_to_float8_training(model, config=AG)
    assert type(model.lm_head) is nn.Linear  # all or nothing
    convert_to_float8_training(model)  # without the float8 all-gather the tie is kept
    assert model.lm_head.weight is model.emb.weight


def test_load_state_dict_assign_keeps_the_float8_all_gather_weight():
    # item 2: assign=True after meta init replaced the wrapper by the checkpoint's plain tensor
    from f8dist.parallel.fsdp import Float8AllGatherWeight

    ref = nn.Sequential(nn.Linear(32, 32))
    with torch.device("meta"):
        model = convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)), config=AG)
    model.load_state_dict(ref.state_dict(), assign=True)
    assert isinstance(model[0].weight, nn.Parameter)
    assert isinstance(model[0].weight, Float8AllGatherWeight)
    assert torch.equal(model[0].weight._tensor, ref[0].weight)
    sd = model.state_dict()
    assert type(sd["0.weight"]) is torch.Tensor and len(model[0]._state_dict_hooks) == 1


@pytest.mark.parametrize("how", ["sequential", "two_names"])
def test_a_module_at_two_places_is_converted_at_both(how):
    # item 3: named_children skips duplicates: the second place stayed high precision
    lin = nn.Linear(32, 32)
    if how == "sequential":
        model = nn.Sequential(lin, nn.ReLU(), lin)
    else:
        model = nn.Module()
        model.a, model.b = lin, lin
    convert_to_float8_training(model)
    places = [model[0], model[2]] if how == "sequential" else [model.a, model.b]
    assert isinstance(places[0], Float8Linear) and places[0] is places[1]
    assert places[0].fqn == ("0" if how == "sequential" else "a")
    assert places[0].weight is lin.weight


def test_linear_subclasses_convert_unless_they_override_forward(caplog):
    # item 4: subclasses were silently left high precision
    class Plain(nn.Linear):
        pass

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(Plain(32, 32), Scaled(32, 32), nn.MultiheadAttention(32, 2))
    with caplog.at_level(logging.WARNING, logger="f8dist.nn.convert"):
        convert_to_float8_training(model)
    assert isinstance(model[0], Float8Linear) and isinstance(model[2].out_proj, Float8Linear)
    assert type(model[1]) is Scaled
    assert "1 (test_linear_subclasses_convert_unless_they_override_forward.<locals>.Scaled)" in caplog.text


def test_a_recipe_name_as_config_is_accepted_and_anything_else_says_what_to_pass():
    # item 8: a string crashed deep in the conversion
    model = convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)), config="rowwise")
    assert model[0].config == Float8LinearConfig.from_recipe_name("rowwise")
    with pytest.raises(ValueError, match="known recipes"):
        convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)), config="rowwize")
    with pytest.raises(TypeError, match="from_recipe_name"):
        convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)), config={"emulate": True})


def test_converting_after_fully_shard_says_to_convert_first():
    # item 8: it failed deep in the stack; one process on a fake 2-rank group shards for real
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = fully_shard(nn.Sequential(nn.Linear(32, 32)))
        with pytest.raises(ValueError, match="0 already has a DTensor weight.*convert the model first"):
            convert_to_float8_training(model)
    finally:
        dist.destroy_process_group()


def _init(model):
    """torchtitan's ``init_weights``: its own init, no ``reset_parameters``."""
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.05)
            nn.init.normal_(m.bias, std=0.05)


@pytest.mark.parametrize("recipe", ["rowwise", "delayed", "mxfp8_square_weights"])
def test_meta_build_then_to_empty_matches_a_model_built_on_the_device(recipe):
    # torchtitan's flow: build on meta, convert, (a shape-only forward), to_empty, init, train.
    # A forward on meta raised ("unknown device type for autocast": autocast has no meta backend)
    config = Float8LinearConfig.from_recipe_name(recipe)
    with torch.device("meta"):
        model = convert_to_float8_training(Net(), config=config)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast on, not for meta tensors
            shape_only = model(torch.randn(8, 64))
    with torch.device("meta"):
        expected = Net()(torch.randn(8, 64))  # what nn.Linear gives on meta: float32, no values
    assert (shape_only.device, shape_only.shape, shape_only.dtype) == (
        expected.device, expected.shape, expected.dtype)
    shape_only.sum().backward()  # a meta backward runs too
    model.zero_grad()  # meta gradients: to_empty would keep them as garbage
    model.to_empty(device="cpu")
    direct = convert_to_float8_training(Net(), config=config)
    results = []
    for m in (model, direct):
        _init(m)
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        out.float().square().sum().backward()
        results.append([out, x.grad] + [p.grad for p in m.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)
