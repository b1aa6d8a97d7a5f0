"""f8dist.debug.recorder: every cast of a model, by module/gemm/operand; free when off."""

from collections import Counter

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import f8dist
from f8dist.core import cast as cast_module
from f8dist.config import CastSpec
from f8dist.debug import CastStats, StatsRecorder, cast_stats_tensors, record

E4M3 = torch.float8_e4m3fn


def make_model(recipe="tensorwise", seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    config = f8dist.Float8LinearConfig.from_recipe_name(recipe).replace(emulate=True)
    return f8dist.convert_to_float8_training(model, config=config)


def step(model, x):
    model(x).sum().backward()


def sites(stats):
    return {(s.fqn, s.gemm, s.operand) for s in stats}


def test_records_every_cast_by_module_gemm_operand():
    x = torch.randn(8, 32)
    model = make_model("tensorwise")
    with record(model) as rec:
        step(model, x)
    # tensorwise: grad_weight reuses the float8 bytes of the forward input and of grad_input's
    # grad_output, so those operands are not cast again
    per_layer = {("output", "input"), ("output", "weight"), ("grad_input", "grad_output"),
                 ("grad_input", "weight")}
    assert sites(rec.stats()) == {(fqn, g, o) for fqn in ("0", "2") for g, o in per_layer}

    model = make_model("rowwise")
    with record(model) as rec:
        step(model, x)
    assert sites(rec.stats()) == {(fqn, g, o) for fqn in ("0", "2")
                                  for g, o in per_layer | {("grad_weight", "input"),
                                                           ("grad_weight", "grad_output")}}


def test_recorded_stats_equal_direct_cast_of_the_same_tensors():
    x = torch.randn(8, 32) * 4
    model = make_model("rowwise")
    seen = {}
    with record(model, callback=lambda site, hp, fp8: seen.setdefault(site, (hp, fp8))) as rec:
        step(model, x)
    stats = rec.stats()
    assert set(seen) == set(stats)
    first = next(s for s in stats if (s.fqn, s.gemm, s.operand) == ("0", "output", "input"))
    assert torch.equal(seen[first][0], x)  # the callback sees the tensor before quantization
    for site, (hp, fp8) in seen.items():
        direct = CastStats.from_tensors(*cast_stats_tensors(hp, fp8._data, fp8._scale),
                                        float8_dtype=fp8._data.dtype)
        assert stats[site] == direct, site
    # the first layer's input cast against an independent cast of x
    own = f8dist.core.cast.cast_to_float8(x, CastSpec(
        dtype=E4M3, granularity=f8dist.ScalingGranularity.AXISWISE, axis=-1,
        round_scales_to_power_of_2=True))
    assert stats[first].error_sq == pytest.approx((x - own.to_original_precision()).pow(2).sum().item())


def test_steps_and_merging_of_repeated_casts():
    x = torch.randn(8, 32)
    model = make_model()
    rec = record(model)
    for i in range(3):
        rec.set_step(10 * i)
        with rec:
            step(model, x)
            if i == 2:
                step(model, x)  # two micro-batches in one step are merged
    assert rec.steps == [0, 10, 20]
    one = rec.stats(10)
    two = rec.stats(20)
    for site, s in two.items():
        assert s.casts == 2 * one[site].casts and s.numel == 2 * one[site].numel
    assert set(rec.history()) == {0, 10, 20}
    with pytest.raises(KeyError, match="recorded steps"):
        rec.stats(5)


def test_observer_removed_on_exit_and_on_error():
    model = make_model()
    with record(model):
        assert len(cast_module.cast_observers) == 1
    assert cast_module.cast_observers == []
    with pytest.raises(ZeroDivisionError):
        with record(model):
            1 / 0
    assert cast_module.cast_observers == []


def test_only_the_given_model_is_recorded():
    a, b = make_model(seed=0), make_model(seed=1)
    for mod in b.modules():
        if isinstance(mod, f8dist.Float8Linear):
            mod.fqn = "other." + mod.fqn
    x = torch.randn(4, 32)
    with record(a) as rec:
        step(a, x)
        step(b, x)
    assert {s.fqn for s in rec.stats()} == {"0", "2"}


def test_model_without_float8_linear_is_rejected():
    with pytest.raises(ValueError, match="convert_to_float8_training"):
        record(nn.Sequential(nn.Linear(4, 4)))


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def count_ops(model, x):
    model.zero_grad(set_to_none=True)  # every count starts without gradients
    with OpCounter() as counter:
        step(model, x)
    return counter.ops


def test_disabled_telemetry_adds_no_ops():
    x = torch.randn(8, 32)
    model = make_model()
    before = count_ops(model, x)  # telemetry never enabled
    with record(model):
        during = count_ops(model, x)
    after = count_ops(model, x)  # enabled once, then off again
    assert sum(during.values()) > sum(before.values())  # the counter sees the statistics
    assert after == before


def test_compiled_casts_raise_a_clear_error():
    # earlier tests' compiles can exhaust dynamo's recompile limit for the cast's frames, which then
    # run eagerly (and record): start from an empty cache so that this compile traces them
    torch._dynamo.reset()
    x = torch.randn(8, 32)
    model = make_model()
    compiled = torch.compile(model, backend="aot_eager")
    with pytest.raises(RuntimeError, match="eager mode only"):
        with record(model):
            step(compiled, x)
    assert cast_module.cast_observers == []
    with record(model) as rec:  # the eager module records
        step(compiled._orig_mod, x)
    assert len(rec.stats()) == 8  # 2 layers x 4 casts (tensorwise: grad_weight reuses 2)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_an_empty_batch_is_recorded(recipe, capsys):
    # issue 23 item 8: a rowwise cast of no rows has no scales: the record crashed
    model = f8dist.convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)), config=recipe)
    with record(model) as rec:
        model(torch.randn(0, 32, requires_grad=True)).sum().backward()
    stats = rec.stats()
    input_stats = next(s for site, s in stats.items() if (site.gemm, site.operand) == ("output", "input"))
    assert input_stats.numel == 0 and input_stats.amax == 0
    rec.print_table()
    x = torch.randn(16, 32, requires_grad=True)
    with record(model) as rec:  # merged with a non-empty batch: its scales, as if alone
        model(torch.randn(0, 32, requires_grad=True)).sum().backward()
        model(x).sum().backward()
    with record(model) as alone:
        model(x).sum().backward()
    for site, s in alone.stats().items():
        merged = rec.stats()[site]
        assert (merged.scale_min, merged.scale_max) == (s.scale_min, s.scale_max), site


def test_expert_casts_are_recorded_per_expert_weight_fqn():
    from f8dist.models.moe import MoE, MoEArgs

    moe = MoE(32, 64, MoEArgs(num_experts=4, top_k=2))
    moe.init_weights(0.02, torch.Generator().manual_seed(0))
    f8dist.convert_to_float8_training(
        moe, config=f8dist.Float8LinearConfig.from_recipe_name("rowwise"))
    rec = StatsRecorder(moe)
    with rec:
        moe(torch.randn(2, 8, 32)).sum().backward()
    sites = {(s.fqn, str(s.gemm), str(s.operand)) for s in rec.stats()}
    for w in ("w1", "w2", "w3"):
        assert (f"experts.{w}", "grad_weight", "grad_output") in sites
        assert (f"experts.{w}", "output", "weight") in sites
    assert ("experts.w1", "output", "input") in sites  # w1 and w3 share one cast of the tokens
    assert not any(fqn.startswith("router") for fqn, _, _ in sites)
