"""Delayed scaling on one device: buffers, recording, sync, first step, the training setups of a
real run (activation checkpointing, gradient accumulation, evaluation), bad batches, range jumps,
dtype casts, compile, checkpoints."""

import copy
import functools
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from f8dist import (
    CastConfig,
    Float8LinearConfig,
    ScalingType,
    convert_to_float8_training,
    float8_sac_context_fn,
    strip_delayed_scaling_state,
    sync_float8_amax_and_scale_history,
)
from f8dist.core import cast as f8cast
from f8dist.config import E4M3, E5M2, DelayedScalingConfig, Operand
from f8dist.debug import Float8StatsLogger
from f8dist.policy.delayed import delayed_scaling_counters, shared_scale
from f8dist.core.numerics import sqnr
from tests.floors import exact_gemm_db
from f8dist.core.scaling import amax_to_scale

# the tests of re-scaling run with it on; COUNTED is the recipe's default (tested below)
COUNTED = Float8LinearConfig.from_recipe_name("delayed")
DELAYED = COUNTED.replace(delayed_scaling_config=DelayedScalingConfig(rescale_out_of_range=True))
BUFFERS = ("fp8_amax_{}", "fp8_amax_history_{}", "fp8_scale_{}")
OPERANDS = ("input", "weight", "grad_output")


def plain_model(seed=0, bias=True):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64, bias=bias), nn.ReLU(), nn.Linear(64, 16, bias=bias))


def float8_model(config=DELAYED, seed=0, bias=True):
    return convert_to_float8_training(plain_model(seed, bias), config=config)


def batches(n, seed=1, batch=16):
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    return [(torch.randn(batch, 32, generator=g), torch.randn(batch, 16, generator=g)) for _ in range(n)]


def train_step(model, opt, x, target, sync=sync_float8_amax_and_scale_history, forward=None, micro=1):
    opt.zero_grad()
    ys = []
    for xm, tm in zip(x.chunk(micro), target.chunk(micro)):
        y = (forward or model)(xm)
        (F.mse_loss(y, tm) / micro).backward()
        ys.append(y.detach())
    if sync is not None:
        sync(model)
    opt.step()
    return torch.cat(ys)


def delayed_buffers(model):
    return {k: v.clone() for k, v in model.state_dict().items() if ".fp8_" in k}


def assert_buffers_equal(a, b):
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), (k, a[k], b[k])


def train(model, data, **kwargs):
    """Outputs, gradients and buffers after each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outs, grads, bufs = [], [], []
    for x, t in data:
        outs.append(train_step(model, opt, x, t, **kwargs))
        grads.append([p.grad.clone() for p in model.parameters()])
        bufs.append(delayed_buffers(model))
    return outs, grads, bufs


def high_precision(model, x):
    """``model(x)`` computed as the plain model with the same weights."""
    for layer in model:
        x = F.linear(x, layer.weight, layer.bias) if isinstance(layer, nn.Linear) else layer(x)
    return x


def test_buffers_in_state_dict():
    model = float8_model()
    sd = model.state_dict()
    for layer in ("0", "2"):
        for op in OPERANDS:
            amax, history, scale = (f"{layer}." + b.format(op) for b in BUFFERS)
            assert sd[amax].shape == () and sd[scale].shape == ()
            assert sd[history].shape == (DELAYED.delayed_scaling_config.history_len,)
            assert f"{layer}.fp8_steps_{op}" not in sd  # the counters are not checkpointed
    assert model[0].delayed.buffer("steps", "input").shape == (6,)
    # dynamic recipes keep nn.Linear's keys only
    assert set(float8_model(Float8LinearConfig()).state_dict()) == set(plain_model().state_dict())
    assert float8_model(Float8LinearConfig())[0].delayed is None


def test_recorded_amax_and_used_scale():
    """The amax recorded is the max of the tensors cast since the sync; the casts use the
    history's scale; the sync rolls the amax into the history and zeroes it."""
    model = float8_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(4)
    for x, t in data[:3]:
        train_step(model, opt, x, t)
    lin = model[0]
    x, t = data[3]
    used = {}

    def observer(site, hp, fp8):
        if site.fqn == "0":
            used[(site.gemm, site.operand)] = fp8._scale.clone()

    f8cast.cast_observers.append(observer)
    try:
        w_before = lin.weight.detach().clone()
        y = model(x)
        y.retain_grad()
        F.mse_loss(y, t).backward()
    finally:
        f8cast.cast_observers.remove(observer)
    assert torch.equal(lin.fp8_amax_input, x.abs().max())
    assert torch.equal(lin.fp8_amax_weight, w_before.abs().max())
    assert torch.equal(model[2].fp8_amax_grad_output, y.grad.abs().max())
    assert {op for _, op in used} == set(OPERANDS)
    for (gemm, op), scale in used.items():
        assert torch.equal(scale, getattr(lin, f"fp8_scale_{op}")), (gemm, op)

    hist_before = lin.fp8_amax_history_input.clone()
    sync_float8_amax_and_scale_history(model)
    hist = lin.fp8_amax_history_input
    assert torch.equal(hist[0], x.abs().max()) and torch.equal(hist[1:], hist_before[:-1])
    assert torch.equal(lin.fp8_scale_input, amax_to_scale(hist.max(), E4M3))
    go_hist = model[2].fp8_amax_history_grad_output
    assert torch.equal(model[2].fp8_scale_grad_output, amax_to_scale(go_hist.max(), E5M2))
    assert not lin.fp8_amax_input.any()  # the next step records from scratch
    assert all(v == {"out_of_range_steps": 0, "nonfinite_steps": 0}
               for ops in delayed_scaling_counters(model).values() for v in ops.values())


def test_shared_cast_records_tentatively():
    """A cast made for several linears (a TP style's shared input) records into all of them; a
    linear that then casts its own input in the step keeps its own amax only."""
    consumer, other = float8_model()[0], float8_model()[0]
    for lin in (consumer, other):
        lin.delayed.synced = True  # past the first step
    big, small = torch.full((16, 32), 4.0), torch.full((16, 32), 0.5)
    for _ in range(2):  # e.g. two micro-batches
        shared_scale([consumer.delayed, other.delayed], Operand.INPUT, big)
        other(small)
    assert consumer.fp8_amax_input == 4.0 and other.fp8_amax_input == 0.5


def test_training_sqnr_vs_fp32():
    model, ref = float8_model(), plain_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step, (x, t) in enumerate(batches(6)):
        y = train_step(model, opt, x, t)
        y_ref = train_step(ref, opt_ref, x, t, sync=None)
        assert sqnr(y_ref, y) > 20, (step, sqnr(y_ref, y))
    assert sqnr(ref[0].weight, model[0].weight) > 35


def test_first_step():
    """Step 0 casts from the current amax; the first sync fills the whole history with it."""
    (x, t), = batches(1)
    model = float8_model()
    used = []
    f8cast.cast_observers.append(lambda site, hp, fp8: used.append((site, fp8._scale.clone())))
    try:
        F.mse_loss(model(x), t).backward()
    finally:
        f8cast.cast_observers.pop()
    scales = {(s.fqn, s.gemm, s.operand): v for s, v in used}
    assert torch.equal(scales[("0", "output", "input")], amax_to_scale(x.abs().max(), E4M3))
    assert not model[0].fp8_amax_history_input.any()  # nothing in the history before the sync
    sync_float8_amax_and_scale_history(model)
    for op in OPERANDS:
        h = getattr(model[2], f"fp8_amax_history_{op}")
        assert h.ne(0).all() and torch.equal(h, h[:1].expand_as(h)), op
    assert torch.equal(model[0].fp8_amax_history_input[0], x.abs().max())

    # amax init off: scale 1.0 where it is in range (an input of amax 30 lands at 30, within
    # [16, 896] for e4m3), the input's own amax where not (its gradients, ~1e-2)
    off = float8_model(DELAYED.replace(enable_amax_init=False))
    used.clear()
    f8cast.cast_observers.append(lambda site, hp, fp8: used.append((site, fp8._scale.clone())))
    try:
        F.mse_loss(off(x * 10), t).backward()
    finally:
        f8cast.cast_observers.pop()
    scales = {(s.fqn, s.gemm, s.operand): v for s, v in used}
    assert scales[("0", "output", "input")] == 1.0 and scales[("0", "output", "weight")] != 1.0
    assert torch.equal(off[0].fp8_amax_input, 10 * x.abs().max())  # recorded for the sync
    sync_float8_amax_and_scale_history(off)
    h = off[0].fp8_amax_history_input
    assert torch.equal(h[0], 10 * x.abs().max()) and not h[1:].any()  # rolled
    h = off[0].fp8_amax_history_weight
    assert h.ne(0).all() and torch.equal(h, h[:1].expand_as(h))  # out of range: restarted


CHECKPOINTING = {
    "full": functools.partial(checkpoint, use_reentrant=False),
    "sac": functools.partial(checkpoint, use_reentrant=False, context_fn=float8_sac_context_fn),
}


def _forward(fwd, compiled):
    return torch.compile(fwd, backend="aot_eager", fullgraph=True) if compiled else fwd


@functools.lru_cache(maxsize=None)
def _trained_without_checkpointing(compiled):
    """The reference of test_activation_checkpointing_changes_nothing, the same for both modes:
    trained once per ``compiled`` (a compile of its graphs is most of the test's time)."""
    torch._dynamo.reset()
    model = float8_model()
    return train(model, batches(4), forward=_forward(model, compiled))


@pytest.mark.parametrize("mode", ["full", "sac"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_activation_checkpointing_changes_nothing(mode, compiled):
    """Outputs, gradients and histories are those of the run without checkpointing: the
    recompute casts the same tensors with the same scales and records nothing new."""
    ref = _trained_without_checkpointing(compiled)
    torch._dynamo.reset()
    model = float8_model()
    got = train(model, batches(4), forward=_forward(functools.partial(CHECKPOINTING[mode], model), compiled))
    for (y1, g1, b1), (y2, g2, b2) in zip(zip(*ref), zip(*got)):
        assert torch.equal(y1, y2)
        assert all(torch.equal(a, b) for a, b in zip(g1, g2))
        assert_buffers_equal(b1, b2)


def test_gradient_accumulation_is_one_step_on_the_whole_batch():
    """The amax of a step is the max over its micro-batches: from a trained state, the histories
    after each step are bit-identical to those of one step on the whole batch, the gradients
    equal up to summation order. At step 0 each micro-batch casts from its own amax; the
    histories of the model input and of the weights after the first sync still equal the whole
    batch's (the others come out of differently rounded gemms)."""
    data = batches(6, batch=32)
    whole, accum = float8_model(), float8_model()
    (_, _, b_whole), (_, _, b_accum) = train(whole, data[:1]), train(accum, data[:1], micro=2)
    exact = [k for k in b_whole[0] if k.endswith("_weight") or k.startswith("0.") and k.endswith("_input")]
    assert len(exact) == 2 * 3 + 3
    for k in exact:
        assert torch.equal(b_whole[0][k], b_accum[0][k]), k
    warm = float8_model()
    train(warm, data[:2])
    _, g1, b1 = train(copy.deepcopy(warm), data[2:])
    _, g2, b2 = train(copy.deepcopy(warm), data[2:], micro=2)
    for s1, s2, h1, h2 in zip(g1, g2, b1, b2):
        assert_buffers_equal(h1, h2)
        assert min(sqnr(a, b) for a, b in zip(s1, s2)) > exact_gemm_db()  # tests/floors.py


def test_evaluation_never_enters_the_history():
    """no_grad, inference_mode and eval() forwards at any point (before the first step, between
    micro-batches, between steps) leave outputs, gradients and buffers as without them."""
    data = batches(4, batch=32)
    eval_x = torch.randn(16, 32) * 100  # out of the training range: would show in any history
    model, ref = float8_model(), float8_model()

    def evaluate():
        with torch.no_grad():
            model(eval_x)
        with torch.inference_mode():
            model(eval_x)
        model.eval()
        model(eval_x).sum().backward()  # eval() mode with grad: not recorded either
        model.train()
        for p in model.parameters():
            p.grad = None

    # before the first sync there is no history: evaluation casts from its own amax
    with torch.no_grad():
        y = model(eval_x)
    assert sqnr(high_precision(model, eval_x), y) > 20
    evaluate()
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for x, t in data:
        opt.zero_grad()
        for xm, tm in zip(x.chunk(2), t.chunk(2)):
            (F.mse_loss(model(xm), tm) / 2).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            evaluate()
            for p, g in zip(model.parameters(), grads):
                p.grad = g
        sync_float8_amax_and_scale_history(model)
        opt.step()
        evaluate()
        y_ref = train_step(ref, opt_ref, x, t, micro=2)
        assert_buffers_equal(delayed_buffers(ref), delayed_buffers(model))
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    assert y_ref is not None


@pytest.mark.parametrize("config", [DELAYED, COUNTED], ids=["rescaled", "counted"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_non_finite_input(bad, config):
    """The bad step's output is non-finite (nothing clamped into a finite number, re-scaled or
    not), its amax stays out of the history (counted), and the next clean step is healthy."""
    data = batches(6)
    model = float8_model(config, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, t in data[:3]:
        train_step(model, opt, x, t)
    before = delayed_buffers(model)
    x, t = data[3]
    x = x.clone()
    x[3, 5] = bad
    opt.zero_grad()
    y = model(x)
    assert not torch.isfinite(y).all()
    F.mse_loss(y, t).backward()
    sync_float8_amax_and_scale_history(model)  # the loop skips the optimizer step: loss is not finite
    after = delayed_buffers(model)
    for k in after:
        assert torch.isfinite(after[k]).all(), k
    assert torch.equal(after["0.fp8_amax_history_input"], before["0.fp8_amax_history_input"])
    assert delayed_scaling_counters(model)["0"]["input"]["nonfinite_steps"] == 1
    for x, t in data[4:]:
        with torch.no_grad():
            ref = high_precision(model, x)
        y = train_step(model, opt, x, t)
        assert torch.isfinite(y).all() and sqnr(ref, y) > 20


def test_activation_drop_is_rescaled():
    """Activations 1e6 times smaller than the history: each cast re-scales from its own amax
    (the output keeps its SQNR instead of flushing to 0), the step is counted, and the restarted
    history serves the next step."""
    data = batches(6)
    model = float8_model(bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, t in data[:3]:
        train_step(model, opt, x, t)
    for x, t in data[3:]:
        x = x * 1e-6
        with torch.no_grad():
            ref = high_precision(model, x)
        y = train_step(model, opt, x, t * 1e-6)
        assert sqnr(ref, y) > 20
    counts = delayed_scaling_counters(model)
    assert counts["0"]["input"]["out_of_range_steps"] == 1  # the step of the drop only
    assert counts["0"]["weight"]["out_of_range_steps"] == 0


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_counted_equals_rescaled_while_in_range(compiled):
    """rescale_out_of_range=False changes nothing while every step is in range: outputs,
    gradients and histories bit-identical to the default, eager and compiled (inductor, where
    the cheaper graph is the point: [Note: the price of re-scaling])."""
    data = batches(4)
    models = [float8_model(DELAYED), float8_model(COUNTED)]
    if compiled:
        torch._dynamo.reset()
        models = [torch.compile(m, fullgraph=True) for m in models]
    (o1, g1, b1), (o2, g2, b2) = (train(m, data) for m in models)
    for a, b in zip(o1 + [g for gs in g1 for g in gs], o2 + [g for gs in g2 for g in gs]):
        assert torch.equal(a, b)
    for h1, h2 in zip(b1, b2):
        assert_buffers_equal(h1, h2)


def test_counted_drop_keeps_the_history_scale():
    """rescale_out_of_range=False ([Note: the price of re-scaling]): the step of the drop casts
    with the history's scale (the input flushes to zero), it is counted, and the restarted
    history serves the next steps. Layer 2 sees the drop one step later (its input was all zero,
    which is never out of range), so it is counted one step later."""
    data = batches(7)
    model = float8_model(COUNTED, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, t in data[:3]:
        train_step(model, opt, x, t)
    for step, (x, t) in enumerate(data[3:]):
        x = x * 1e-6
        with torch.no_grad():
            expected = high_precision(model, x)
            scale = model[0].fp8_scale_input.clone()
        y = train_step(model, opt, x, t * 1e-6)
        if step == 0:  # under half e4m3's smallest subnormal (2**-9): every input casts to 0
            assert scale * x.abs().max() < 2.0**-10 and not y.any()
        if step >= 2:
            assert sqnr(expected, y) > 20
    counts = delayed_scaling_counters(model)
    assert counts["0"]["input"]["out_of_range_steps"] == 1
    assert counts["2"]["input"]["out_of_range_steps"] == 1
    assert counts["0"]["weight"]["out_of_range_steps"] == 0


def test_loss_spike_is_rescaled():
    """A 1e12 loss spike: its gradients are cast from their own amax, not saturated, and the
    steps after it keep nonzero float8 weight gradients."""
    data = batches(6)
    model, ref = float8_model(bias=False), plain_model(bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, t) in enumerate(data):
        scale = 1e12 if step == 3 else 1.0
        ref.load_state_dict({k: v for k, v in model.state_dict().items() if "fp8_" not in k})
        for m in (ref, model):
            m.zero_grad()
            (F.mse_loss(m(x), t) * scale).backward()
        sync_float8_amax_and_scale_history(model)
        for p, p_ref in zip(model.parameters(), ref.parameters()):
            assert sqnr(p_ref.grad, p.grad) > 10, (step, sqnr(p_ref.grad, p.grad))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    counts = delayed_scaling_counters(model)
    assert counts["0"]["grad_output"]["out_of_range_steps"] == 2  # the spike, then the step after


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_buffers_stay_float32(dtype):
    model = float8_model(bias=False).to(dtype)
    assert {v.dtype for v in delayed_buffers(model).values()} == {torch.float32}
    assert model[0].weight.dtype == dtype
    model.half().to(dtype).double().to(dtype)
    assert {v.dtype for k, v in model.named_buffers()} == {torch.float32}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, t in batches(4):
        x, t = x.to(dtype), t.to(dtype)
        with torch.no_grad():
            ref = high_precision(model, x)
        y = train_step(model, opt, x, t)
        assert torch.isfinite(y).all()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        assert sqnr(ref.float(), y.float()) > 20


def test_compile_matches_eager():
    """fullgraph compile of model and sync: bit-identical to eager, range jumps included (the
    out-of-range rule is tensor ops)."""
    model = float8_model()
    compiled_model = copy.deepcopy(model)
    fwd = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    sync = torch.compile(sync_float8_amax_and_scale_history, fullgraph=True, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(compiled_model.parameters(), lr=0.1)
    for step, (x, t) in enumerate(batches(5)):
        x = x * (1e-6 if step == 3 else 1.0)
        y = train_step(model, opt, x, t)
        y_c = train_step(fwd, opt_c, x, t, sync=sync)
        assert torch.equal(y, y_c)
    assert_buffers_equal(delayed_buffers(model), delayed_buffers(compiled_model))
    assert delayed_scaling_counters(model) == delayed_scaling_counters(compiled_model)
    assert delayed_scaling_counters(model)["0"]["input"]["out_of_range_steps"] == 2


def test_logger_shows_delayed_counters(tmp_path):
    model = float8_model()
    printed = []
    logger = Float8StatsLogger(model, every=1, out_dir=str(tmp_path), print_fn=printed.append)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, t) in enumerate(batches(3)):
        with logger.step(step):
            train_step(model, opt, x * (1e-6 if step == 2 else 1.0), t)
    assert not any("delayed scaling" in p for p in printed[:2])
    assert "0:input out_of_range_steps=1" in printed[-1]
    lines = [json.loads(l) for l in (tmp_path / "float8_stats.jsonl").read_text().splitlines()]
    mine = [l for l in lines if (l["step"], l["fqn"], l["gemm"], l["operand"]) == (2, "0", "output", "input")]
    assert mine[0]["delayed_out_of_range_steps"] == 1 and mine[0]["delayed_nonfinite_steps"] == 0


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
    F.mse_loss(model(x), t).backward()
    sync_float8_amax_and_scale_history(model)
    assert model[0].delayed.synced
    model.load_state_dict(plain_sd)  # strict: missing delayed buffers are not errors
    assert torch.equal(model[0].weight, plain_sd["0.weight"])
    # the old weights' histories are dropped; the next step is a first step
    assert not model[0].delayed.synced
    assert not model[0].fp8_amax_history_weight.any()
    assert torch.equal(model[0].fp8_scale_weight, torch.tensor(1.0))
    partial = {k: v for k, v in model.state_dict().items() if "history_input" not in k}
    with pytest.raises(RuntimeError, match="fp8_amax_history_input"):
        float8_model().load_state_dict(partial)

    F.mse_loss(model(x), t).backward()
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


@pytest.mark.parametrize("config", [DELAYED, COUNTED], ids=["rescaled", "counted"])
def test_a_sync_before_any_forward_records_no_data(config):
    # issue 23 item 6: an amax of 0 entered the history as data; the first step then cast with the
    # scale of amax 0 (2**126) instead of from its amax
    model, ref = float8_model(config), float8_model(config)
    fresh = delayed_buffers(model)
    sync_float8_amax_and_scale_history(model)
    sync_float8_amax_and_scale_history(model)
    assert_buffers_equal(fresh, delayed_buffers(model))
    assert not model[0].delayed.synced  # the next step is still a first step
    data = batches(3)
    outs, _, bufs = train(model, data)
    outs_ref, _, bufs_ref = train(ref, data)
    for o, o_ref, b, b_ref in zip(outs, outs_ref, bufs, bufs_ref):
        assert torch.equal(o, o_ref)
        assert_buffers_equal(b_ref, b)


class _Branches(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.a = float8_model(config, seed=0)
        self.b = float8_model(config, seed=1)

    def forward(self, x, use_b=True):
        return self.a(x) + (self.b(x) if use_b else 0)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_layer_skipped_for_steps_keeps_its_history_and_scale(compiled):
    # issue 23 item 6: a branch that did not run in a step recorded amax 0; once the zeros were
    # the history's max, its scale was 2**126 and its output garbage (counted mode)
    model = _Branches(COUNTED)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sync = sync_float8_amax_and_scale_history
    if compiled:
        torch._dynamo.reset()
        sync = torch.compile(sync, fullgraph=True, backend="aot_eager")
    data = batches(2 + 2 * 16)
    for step, (x, t) in enumerate(data):
        use_b = step < 2  # b skipped for more steps than its history is long
        opt.zero_grad()
        F.mse_loss(model(x, use_b=use_b), t).backward()
        sync(model)
        opt.step()
        if step == 1:
            kept = delayed_buffers(model.b)
    assert_buffers_equal(kept, delayed_buffers(model.b))
    x = data[0][0]
    with torch.no_grad():
        assert sqnr(high_precision(model.b, x), model.b(x)) > 20


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_empty_first_batch_is_no_data(compiled):
    # an empty batch's amax 0 entered the histories as data: the first sync filled them with it
    # (scale 2**126) and the next step saturated. Its weight (not empty) records; the weight is
    # unchanged by the step (zero gradients), so training goes on as without the empty batch
    if compiled:
        torch._dynamo.reset()
    model, ref = float8_model(COUNTED), float8_model(COUNTED)
    data = batches(2)
    empty = (data[0][0][:0], data[0][1][:0])
    outs, _, bufs = train(model, [empty] + data, forward=_forward(model, compiled))
    outs_ref, _, bufs_ref = train(ref, data)
    for o, o_ref, b, b_ref in zip(outs[1:], outs_ref, bufs[1:], bufs_ref):
        assert torch.equal(o, o_ref)
        assert_buffers_equal(b_ref, b)
    assert delayed_scaling_counters(model) == delayed_scaling_counters(ref)


def test_an_empty_batch_later_keeps_the_histories():
    # as a step without a record: the input and grad_output histories and scales stay as they
    # were (an amax 0 rolled in before), the weight's roll as in any step
    model = float8_model(COUNTED)
    data = batches(3)
    empty = (data[0][0][:0], data[0][1][:0])
    _, _, bufs = train(model, data[:2] + [empty] + data[2:])
    kept = [k for k in bufs[1] if not k.endswith("_weight")]
    assert_buffers_equal({k: bufs[1][k] for k in kept}, {k: bufs[2][k] for k in kept})
    assert not torch.equal(bufs[1]["0.fp8_amax_history_weight"], bufs[2]["0.fp8_amax_history_weight"])
    assert all(c["out_of_range_steps"] == c["nonfinite_steps"] == 0
               for layer in delayed_scaling_counters(model).values() for c in layer.values())


@pytest.mark.parametrize("init", ["to_empty", "to_empty_and_reset_parameters"])
def test_meta_init_gives_fresh_delayed_buffers(init):
    # issue 23 item 5: to_empty() left the delayed buffers as uninitialized memory
    with torch.device("meta"):
        model = float8_model()
    model.to_empty(device=torch.get_default_device())
    if init == "to_empty_and_reset_parameters":
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()
    fresh = delayed_buffers(float8_model())
    assert_buffers_equal(fresh, delayed_buffers(model))
    assert all(not m.delayed.synced for m in model if isinstance(m, nn.Linear))
    # trained after a weight init, it keeps the buffers a model built on the device has
    ref = float8_model()
    model.load_state_dict({k: v for k, v in ref.state_dict().items() if ".fp8_" not in k},
                          strict=False)
    outs, _, bufs = train(model, batches(2))
    outs_ref, _, bufs_ref = train(ref, batches(2))
    assert torch.equal(outs[-1], outs_ref[-1])
    assert_buffers_equal(bufs_ref[-1], bufs[-1])


@pytest.mark.parametrize("kind,strict", [("plain", True), ("plain", False), ("float8", True)])
def test_meta_build_then_load_with_assign(kind, strict):
    # load_state_dict(sd, assign=True) into a model built on meta (torchtitan's build) assigned
    # the weights and left the delayed buffers on meta: no step recorded, a checkpoint held meta
    # tensors. The buffers sd lacks (all of a plain one's, the non-persistent ones) come fresh
    ref = float8_model()
    if kind == "float8":
        train(ref, batches(2))
    sd = copy.deepcopy({k: v for k, v in ref.state_dict().items()
                        if kind == "float8" or ".fp8_" not in k})  # assign takes these tensors
    with torch.device("meta"):
        model = float8_model()
    model.load_state_dict(sd, strict=strict, assign=True)
    assert not [name for name, b in model.named_buffers() if b.is_meta]
    assert_buffers_equal(delayed_buffers(ref), delayed_buffers(model))
    outs, _, bufs = train(model, batches(2, seed=2))
    outs_ref, _, bufs_ref = train(ref, batches(2, seed=2))
    assert torch.equal(outs[-1], outs_ref[-1])
    assert_buffers_equal(bufs_ref[-1], bufs[-1])


def test_a_meta_state_dict_loads_into_a_meta_model_with_assign():
    with torch.device("meta"):
        model, other = float8_model(), float8_model()
    model.load_state_dict(other.state_dict(), assign=True)  # read no meta history
    assert all(b.is_meta for b in model.buffers()) and not model[0].delayed.synced


def test_a_sync_refuses_buffers_left_on_meta():
    with torch.device("meta"):
        model = float8_model()
    model[0].weight = nn.Parameter(torch.randn(64, 32))  # by hand: the buffers stay on meta
    with pytest.raises(RuntimeError, match=r"^0: its delayed-scaling buffers .* on the meta device "
                                           r"while its weight is on \w+.*to_empty"):
        sync_float8_amax_and_scale_history(model)


def test_reset_parameters_resets_the_delayed_state():
    model = float8_model()
    train(model, batches(2))
    model[0].reset_parameters()
    model[2].reset_parameters()
    assert_buffers_equal(delayed_buffers(float8_model()), delayed_buffers(model))
    assert not model[0].delayed.synced


def test_a_forgotten_sync_warns_once_naming_the_fix():
    # issue 23 item 16: without the sync delayed scaling silently ran as dynamic scaling
    import warnings

    from f8dist.policy.delayed import missing_sync

    model = float8_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, t in data:
            train_step(model, opt, x, t, sync=None)
    missing = [w for w in caught if "without sync_float8_amax_and_scale_history" in str(w.message)]
    assert len(missing) == 1
    assert "f8dist.sync_float8_amax_and_scale_history(model) once per optimizer step" in str(
        missing[0].message)

    synced = float8_model()  # with the sync: no warning
    opt = torch.optim.SGD(synced.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, t in data:
            train_step(synced, opt, x, t)
    assert not [w for w in caught if "without sync" in str(w.message)]
    assert synced[0].delayed not in missing_sync._pending



def test_the_default_counts_out_of_range_steps_without_re_scaling():
    # issue 23 item 19: chosen by measurement ([Note: the price of re-scaling])
    assert DelayedScalingConfig().rescale_out_of_range is False
    assert COUNTED.delayed_scaling_config.rescale_out_of_range is False


def test_the_names_of_the_split_module_stay_importable_from_f8dist_delayed():
    # issue 34 item 8: f8dist/delayed.py became a package of one concept per module
    import f8dist.policy.delayed

    names = ("DELAYED_BUFFER_PREFIXES", "KEPT_BINADES", "SATURATION", "MISSING_SYNC_STEPS",
             "Records", "Scales", "Shardings", "DelayedScaling", "delayed_operands", "in_range",
             "shared_scale", "delayed_buffers", "ignore_in_ddp", "set_amax_group",
             "sync_float8_amax_and_scale_history", "delayed_scaling_counters",
             "apply_to_delayed_module", "load_delayed_state", "strip_delayed_scaling_state")
    assert [n for n in names if not hasattr(f8dist.policy.delayed, n)] == []
    assert set(f8dist.policy.delayed.__all__) <= set(names)
    sync = f8dist.policy.delayed.sync_float8_amax_and_scale_history
    assert f8dist.sync_float8_amax_and_scale_history is sync
