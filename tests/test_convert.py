import copy
import logging

import pytest
import torch
import torch.nn as nn

from f8dist import Float8Linear, Float8LinearConfig, convert_to_float8_training
from f8dist.numerics import sqnr


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
    with caplog.at_level(logging.WARNING, logger="f8dist.convert"):
        convert_to_float8_training(model)
    assert type(model.odd) is nn.Linear
    assert "odd (64 -> 24)" in caplog.text and "pad_inner_dim" in caplog.text
    assert "output" in _float8_fqns(model)


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
