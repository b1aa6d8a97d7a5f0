import dataclasses
import types

import pytest
import torch.nn as nn

from f8dist import (
    Float8Linear,
    Float8LinearRecipeName,
    auto_filter_for_recipe,
    convert_to_float8_training,
    fqn_filter,
)
from f8dist.policy.filters import H100_SXM, GpuSpec, float8_gemms, predicted_speedup

RECIPES = [r.value for r in Float8LinearRecipeName]


def _meta_linear(k, n):
    return nn.Linear(k, n, bias=False, device="meta")


@pytest.mark.parametrize("recipe", RECIPES)
def test_converts_large_linears_and_keeps_small_ones(recipe):
    accept = auto_filter_for_recipe(recipe)
    for k, n in [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]:  # LLaMA 8B/70B
        assert accept(_meta_linear(k, n), "layers.0.w1"), (k, n)
    for k, n in [(256, 768), (768, 256), (256, 256), (512, 512)]:  # the llama3 debug model
        assert not accept(_meta_linear(k, n), "layers.0.w1"), (k, n)


@pytest.mark.parametrize("recipe", RECIPES)
def test_decision_is_the_predicted_speedup_crossing_one(recipe):
    accept = auto_filter_for_recipe(recipe)
    decisions = set()
    for k in range(256, 8193, 256):
        for n in (512, 1024, 1536, 2048, 4096):
            gain = predicted_speedup(recipe, k, n)
            assert accept(_meta_linear(k, n), "x") == (gain > 1.0), (k, n, gain)
            decisions.add(gain > 1.0)
    assert decisions == {True, False}  # the grid straddles the boundary


@pytest.mark.parametrize("recipe", RECIPES)
def test_without_memory_cost_the_speedup_is_the_float8_flops_ratio(recipe):
    # infinite bandwidth: no cast cost, every gemm compute-bound; three equal gemms of which the
    # recipe's float8 ones run fp8_flops / bf16_flops times as fast
    gpu = dataclasses.replace(H100_SXM, memory_bandwidth=1e30)
    ratio = gpu.fp8_flops / gpu.bf16_flops
    n_fp8 = sum(float8_gemms(recipe))
    expected = 3 / (n_fp8 / ratio + (3 - n_fp8))
    assert predicted_speedup(recipe, 64, 48, tokens=32, gpu=gpu) == pytest.approx(expected)


def test_cheaper_casts_predict_more_speedup():
    for k, n in [(1024, 1024), (2048, 8192), (8192, 2048)]:
        tw, rw, dl = (predicted_speedup(r, k, n) for r in ("tensorwise", "rowwise", "delayed"))
        assert rw < tw < dl, (k, n)  # rowwise casts each operand twice; delayed skips the amax pass


def test_fewer_tokens_convert_fewer_linears():
    accept_8k = auto_filter_for_recipe("tensorwise", tokens=8192)
    accept_256 = auto_filter_for_recipe("tensorwise", tokens=256)
    lin = _meta_linear(2048, 2048)
    assert accept_8k(lin, "w") and not accept_256(lin, "w")


def test_dims_not_multiple_of_16_stay_high_precision():
    accept = auto_filter_for_recipe("tensorwise")
    assert accept(_meta_linear(8192, 8192), "w")
    assert not accept(_meta_linear(8200, 8192), "w")
    assert not accept(_meta_linear(8192, 8200), "w")


def test_composes_with_an_fqn_filter_and_with_convert():
    model = nn.Sequential(
        nn.Linear(4096, 4096, bias=False, device="meta"),  # converted
        nn.Linear(4096, 256, bias=False, device="meta"),  # too small
        nn.Linear(4096, 4096, bias=False, device="meta"),  # filtered by FQN
    )
    convert_to_float8_training(
        model, module_filter_fn=auto_filter_for_recipe("rowwise", filter_fqns=["2"])
    )
    assert [type(m) for m in model] == [Float8Linear, nn.Linear, nn.Linear]

    keep_output = fqn_filter(["output", "router"])
    assert keep_output(None, "layers.0.w1")
    assert not keep_output(None, "output") and not keep_output(None, "layers.1.moe.router.gate")
    both = auto_filter_for_recipe("tensorwise")
    lin = _meta_linear(4096, 4096)
    assert both(lin, "output") and not (both(lin, "output") and keep_output(lin, "output"))


def test_takes_any_object_with_linear_dims():
    # torchtitan's Linear.Config has in_features / out_features but is no nn.Module
    accept = auto_filter_for_recipe("tensorwise")
    big = types.SimpleNamespace(in_features=4096, out_features=4096)
    small = types.SimpleNamespace(in_features=256, out_features=256)
    assert accept(big, "layers.0.w1") and not accept(small, "layers.0.w1")


def test_bad_arguments_say_what_to_change():
    with pytest.raises(ValueError, match="known recipes"):
        auto_filter_for_recipe("fp8")
    with pytest.raises(ValueError, match="tokens must be a positive int"):
        auto_filter_for_recipe("tensorwise", tokens=0)
    with pytest.raises(TypeError, match="sequence of strings"):
        fqn_filter("output")
    with pytest.raises(ValueError, match="memory_bandwidth must be a positive number"):
        GpuSpec(name="x", bf16_flops=1.0, fp8_flops=2.0, memory_bandwidth=0)


def test_dims_that_do_not_divide_into_blocks_stay_high_precision():
    # 8224 = 257 * 32: MXFP8's 1x32 blocks fit, DeepSeek's 128x128 weight blocks do not
    assert auto_filter_for_recipe("mxfp8")(_meta_linear(8192, 8224), "w")
    assert not auto_filter_for_recipe("blockwise")(_meta_linear(8192, 8224), "w")
    assert auto_filter_for_recipe("blockwise")(_meta_linear(8192, 8192), "w")


def test_high_precision_tail_filter_keeps_the_recipes_last_blocks():
    # [Note: a high-precision tail]: nvfp4 keeps ceil(0.15 * n) blocks; "layers.1." is not "layers.10."
    from f8dist.policy.filters import high_precision_tail_filter

    lin = nn.Linear(16, 16)
    keep = high_precision_tail_filter("nvfp4", 14)  # ceil(2.1) = 3: blocks 11, 12, 13
    assert [i for i in range(14) if not keep(lin, f"layers.{i}.attention.wq")] == [11, 12, 13]
    no_rht = high_precision_tail_filter("nvfp4_no_rht", 14)  # the variant keeps the same tail
    assert [i for i in range(14) if not no_rht(lin, f"layers.{i}.attention.wq")] == [11, 12, 13]
    assert keep(lin, "output") and keep(lin, "layers.1.feed_forward.w1")
    assert all(high_precision_tail_filter("mxfp8", 14)(lin, f"layers.{i}.wq") for i in range(14))
