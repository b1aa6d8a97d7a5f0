"""Delayed scaling on one device: buffers, recording, sync, init, compile, checkpoints."""

import copy

import pytest
import torch
import torch.nn as nn

from f8dist import (
    CastConfig,
    Float8LinearConfig,
    ScalingType,
    convert_to_float8_training,
    strip_delayed_scaling_state,
    sync_float8_amax_and_scale_history,
)
from f8dist import cast as f8cast
from f8dist.config import E4M3, E5M2
from f8dist.numerics import sqnr
from f8dist.scaling import amax_to_scale

DELAYED = Float8LinearConfig.from_recipe_name("delayed")
BUFFERS = ("fp8_amax_{}", "fp8_amax_history_{}", "fp8_scale_{}")
OPERANDS = ("input", "weight", "grad_output")


def plain_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))


def float8_model(config=DELAYED, seed=0):
    return convert_to_float8_training(plain_model(seed), config=config)


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 32, generator=g), torch.randn(16, 16, generator=g)) for _ in range(n)]


def train_step(model, opt, x, target, sync=sync_float8_amax_and_scale_history):
    opt.zero_grad()
    y = model(x)
    nn.functional.mse_loss(y, target).backward()
    if sync is not None:
        sync(model)
    opt.step()
    return y


def test_buffers_in_state_dict():
    model = float8_model()
    sd = model.state_dict()
    for layer in ("0", "2"):
        for op in OPERANDS:
            amax, history, scale = (f"{layer}." + b.format(op) for b in BUFFERS)
            assert sd[amax].shape == () and sd[scale].shape == ()
            assert sd[history].shape == (DELAYED.delayed_scaling_config.history_len,)
    # dynamic recipes keep nn.Linear's keys only
    assert set(float8_model(Float8LinearConfig()).state_dict()) == set(plain_model().state_dict())


def test_recorded_amax_and_used_scale():
    """The amax recorded is the amax of the tensor cast; the cast uses the buffer's scale."""
    model = float8_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, t in batches(2):
        train_step(model, opt, x, t)
    lin = model[0]
    x, _ = batches(1, seed=7)[0]
    used = {}

    def observer(site, hp, fp8):
        if site.fqn == "0":
            used[(site.gemm, site.operand)] = fp8._scale.clone()

    f8cast.cast_observers.append(observer)
    try:
        w_before = lin.weight.detach().clone()
        y = model(x)
        grad = torch.randn_like(y)
        y.backward(grad)
    finally:
        f8cast.cast_observers.remove(observer)
    assert torch.equal(lin.fp8_amax_input, x.abs().max())
    assert torch.equal(lin.fp8_amax_weight, w_before.abs().max())
    assert torch.equal(model[2].fp8_amax_grad_output, grad.abs().max())
    for (gemm, op), scale in used.items():
        assert torch.equal(scale, getattr(lin, f"fp8_scale_{op}")), (gemm, op)
    assert {op for _, op in used} == set(OPERANDS)

    hist_before = lin.fp8_amax_history_input.clone()
    sync_float8_amax_and_scale_history(model)
    hist = lin.fp8_amax_history_input
    assert torch.equal(hist[0], x.abs().max()) and torch.equal(hist[1:], hist_before[:-1])
    assert torch.equal(lin.fp8_scale_input, amax_to_scale(hist.max(), E4M3))
    go_hist = model[2].fp8_amax_history_grad_output
    assert torch.equal(model[2].fp8_scale_grad_output, amax_to_scale(go_hist.max(), E5M2))


def test_training_sqnr_vs_fp32():
    model, ref = float8_model(), plain_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step, (x, t) in enumerate(batches(6)):
        y = train_step(model, opt, x, t)
        y_ref = train_step(ref, opt_ref, x, t, sync=None)
        if step >= 2:  # after warm-up: histories hold real amaxes
            assert sqnr(y_ref, y) > 20, (step, sqnr(y_ref, y))
    assert sqnr(ref[0].weight, model[0].weight) > 35


def test_amax_init():
    x, t = batches(1)[0]
    model = float8_model()
    model[0](x)
    assert torch.equal(model[0].fp8_amax_history_input, x.abs().max().expand(16))
    assert torch.equal(model[0].fp8_scale_input, amax_to_scale(x.abs().max(), E4M3))

    off = float8_model(DELAYED.replace(enable_amax_init=False))
    off[0](x)
    assert torch.equal(off[0].fp8_scale_input, torch.tensor(1.0))
    assert not off[0].fp8_amax_history_input.any()
    assert torch.equal(off[0].fp8_amax_input, x.abs().max())  # recorded for the sync


def test_first_sync_refills_history_from_init():
    model = float8_model()
    x, t = batches(1)[0]
    nn.functional.mse_loss(model(x), t).backward()
    sync_float8_amax_and_scale_history(model)
    for op in OPERANDS:
        h = getattr(model[2], f"fp8_amax_history_{op}")
        assert torch.equal(h, getattr(model[2], f"fp8_amax_{op}").expand_as(h)), op


def test_forward_without_sync_raises():
    model = float8_model()
    x, _ = batches(1)[0]
    model(x)
    with pytest.raises(RuntimeError, match="sync_float8_amax_and_scale_history"):
        model(x)
    with torch.no_grad():
        model(x)  # evaluation needs no sync
    sync_float8_amax_and_scale_history(model)
    model(x)

    free = float8_model(DELAYED.replace(enable_pre_and_post_forward=False))
    free(x)
    free(x)


def test_compile_matches_eager():
    model = float8_model()
    compiled_model = copy.deepcopy(model)
    fwd = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    sync = torch.compile(sync_float8_amax_and_scale_history, fullgraph=True, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(compiled_model.parameters(), lr=0.1)
    for x, t in batches(3):
        y = train_step(model, opt, x, t)
        y_c = train_step(fwd, opt_c, x, t, sync=sync)
        assert torch.equal(y, y_c)
    for (k, v), (k_c, v_c) in zip(model.state_dict().items(), compiled_model.state_dict().items()):
        assert k == k_c and torch.equal(v, v_c), k


def test_checkpoint_resume_is_identical():
    data = batches(4)
    model = float8_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, t in data[:3]:
        train_step(model, opt, x, t)
    model_sd, opt_sd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())

    resumed = float8_model(seed=123)
    resumed.load_state_dict(model_sd)
    opt_r = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    opt_r.load_state_dict(opt_sd)
    x, t = data[3]
    y, y_r = train_step(model, opt, x, t), train_step(resumed, opt_r, x, t)
    assert torch.equal(y, y_r)
    for (k, v), v_r in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(v, v_r), k


def test_plain_and_float8_checkpoints_interchange():
    x, t = batches(1)[0]
    plain_sd = plain_model(seed=5).state_dict()
    model = float8_model()
    nn.functional.mse_loss(model(x), t).backward()
    sync_float8_amax_and_scale_history(model)
    model.load_state_dict(plain_sd)  # strict: missing delayed buffers are not errors
    assert torch.equal(model[0].weight, plain_sd["0.weight"])
    # the old weights' histories are dropped; the first forward initializes from the new ones
    assert not model[0].is_amax_initialized
    assert not model[0].fp8_amax_history_weight.any()
    assert torch.equal(model[0].fp8_scale_weight, torch.tensor(1.0))
    partial = {k: v for k, v in model.state_dict().items() if "history_input" not in k}
    with pytest.raises(RuntimeError, match="fp8_amax_history_input"):
        float8_model().load_state_dict(partial)

    nn.functional.mse_loss(model(x), t).backward()
    sync_float8_amax_and_scale_history(model)
    f8_sd = model.state_dict()
    plain = plain_model(seed=9)
    with pytest.raises(RuntimeError, match="fp8_amax_history_input"):
        plain.load_state_dict(f8_sd)
    plain.load_state_dict(strip_delayed_scaling_state(f8_sd))
    assert torch.equal(plain[2].weight, model[2].weight)
    result = plain_model(seed=9).load_state_dict(f8_sd, strict=False)
    assert len(result.unexpected_keys) == 2 * 3 * 3 and not result.missing_keys


def test_config_errors():
    mixed = DELAYED.replace(
        cast_config_grad_output_for_grad_weight=CastConfig(
            scaling_type=ScalingType.DELAYED, target_dtype=E4M3
        )
    )
    with pytest.raises(ValueError, match="same target_dtype"):
        float8_model(mixed)


def test_sync_without_delayed_layers_is_a_noop():
    model = float8_model(Float8LinearConfig())
    before = copy.deepcopy(model.state_dict())
    sync_float8_amax_and_scale_history(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
