import dataclasses
import types

import pytest
import torch.nn as nn

from f8dist import (
    Float8Linear,
    Float8LinearConfig,
    Float8LinearRecipeName,
    auto_filter_for_recipe,
    convert_to_float8_training,
    fqn_filter,
)
from f8dist.policy.filters import (
    B200,
    H100_SXM,
    NVFP4_OPERAND_BYTES,
    GpuSpec,
    auto_recipe_filters,
    float8_gemms,
    predicted_speedup,
)

RECIPES = [r.value for r in Float8LinearRecipeName]
FP4 = ("nvfp4", "nvfp4_no_rht")  # FP4 gemms: predicted on a GPU with FP4 tensor cores only


def _gpu(recipe):
    return B200 if recipe in FP4 else H100_SXM


def _meta_linear(k, n):
    return nn.Linear(k, n, bias=False, device="meta")


@pytest.mark.parametrize("recipe", RECIPES)
def test_converts_large_linears_and_keeps_small_ones(recipe):
    accept = auto_filter_for_recipe(recipe, gpu=_gpu(recipe))
    for k, n in [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]:  # LLaMA 8B/70B
        assert accept(_meta_linear(k, n), "layers.0.w1"), (k, n)
    for k, n in [(256, 768), (768, 256), (256, 256), (512, 512)]:  # the llama3 debug model
        assert not accept(_meta_linear(k, n), "layers.0.w1"), (k, n)


@pytest.mark.parametrize("recipe", RECIPES)
def test_decision_is_the_predicted_speedup_crossing_one(recipe):
    gpu = _gpu(recipe)
    accept = auto_filter_for_recipe(recipe, gpu=gpu)
    decisions = set()
    for k in range(256, 8193, 256):
        for n in (512, 1024, 1536, 2048, 4096):
            gain = predicted_speedup(recipe, k, n, gpu=gpu)
            assert accept(_meta_linear(k, n), "x") == (gain > 1.0), (k, n, gain)
            decisions.add(gain > 1.0)
    assert decisions == {True, False}  # the grid straddles the boundary


@pytest.mark.parametrize("recipe", RECIPES)
def test_without_memory_cost_the_speedup_is_the_float8_flops_ratio(recipe):
    # infinite bandwidth: no cast cost, every gemm compute-bound; three equal gemms of which the
    # recipe's float8 ones run fp8_flops / bf16_flops times as fast (fp4_flops for NVFP4's)
    gpu = dataclasses.replace(_gpu(recipe), memory_bandwidth=1e30)
    ratio = (gpu.fp4_flops if recipe in FP4 else gpu.fp8_flops) / gpu.bf16_flops
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


def _roofline_speedup(m, k, n, low_bytes, low_flops, cast_bytes, gpu):
    # [Note: the auto filter's cost model], written out: three gemms (all low precision here) and
    # the casts' bytes per element of input [m, k], grad_output [m, n], weight [n, k]
    def gemm(a, b, c, op_bytes, flops):
        return max(2 * a * b * c / flops, (op_bytes * (a * b + b * c) + 2 * a * c) / gpu.memory_bandwidth)

    shapes = ((m, k, n), (m, n, k), (n, m, k))
    bf16 = sum(gemm(*s, 2, gpu.bf16_flops) for s in shapes)
    low = sum(gemm(*s, low_bytes, low_flops) for s in shapes)
    b_in, b_go, b_w = cast_bytes
    low += (b_in * m * k + b_go * m * n + b_w * n * k) / gpu.memory_bandwidth
    return bf16 / low


@pytest.mark.parametrize("k,n", [(256, 768), (2048, 2048), (4096, 14336), (8192, 512)])
def test_nvfp4_prediction_uses_the_fp4_rate_and_nvfp4_operand_bytes(k, n):
    from f8dist.policy.filters import CAST_BYTES

    assert NVFP4_OPERAND_BYTES == 0.5 + 1 / 16  # e2m1 half bytes and one e4m3 scale per 16
    assert float8_gemms("nvfp4") == (True, True, True)
    expected = _roofline_speedup(2048, k, n, NVFP4_OPERAND_BYTES, B200.fp4_flops,
                                 CAST_BYTES[Float8LinearRecipeName.NVFP4], B200)
    assert predicted_speedup("nvfp4", k, n, tokens=2048, gpu=B200) == pytest.approx(expected)
    # float8 recipes keep their 1-byte operands and the float8 rate on the same GPU
    expected = _roofline_speedup(2048, k, n, 1, B200.fp8_flops,
                                 CAST_BYTES[Float8LinearRecipeName.MXFP8], B200)
    assert predicted_speedup("mxfp8", k, n, tokens=2048, gpu=B200) == pytest.approx(expected)


def test_fp4_on_a_gpu_without_fp4_is_an_error_that_names_the_fix():
    with pytest.raises(ValueError, match=r"GpuSpec.fp4_flops is None for 'H100 SXM'.*gpu=B200"):
        predicted_speedup("nvfp4", 4096, 4096)
    with pytest.raises(ValueError, match="GpuSpec.fp4_flops is None"):
        auto_filter_for_recipe("nvfp4_no_rht")
    with pytest.raises(ValueError, match="GpuSpec.fp4_flops is None"):
        auto_recipe_filters(("mxfp8", "nvfp4"), num_layers=4)
    assert auto_filter_for_recipe("mxfp8")(_meta_linear(4096, 4096), "w")  # float8: unchanged


@pytest.mark.parametrize("fp4_flops", [0, -1.0, "9e15"])
def test_fp4_flops_is_validated(fp4_flops):
    with pytest.raises(ValueError, match="GpuSpec.fp4_flops must be a positive number"):
        GpuSpec(name="x", bf16_flops=1.0, fp8_flops=2.0, memory_bandwidth=1.0, fp4_flops=fp4_flops)
    assert GpuSpec(name="x", bf16_flops=1.0, fp8_flops=2.0, memory_bandwidth=1.0).fp4_flops is None


# (fqn, K, N): a block of the LLaMA 8B shapes, the debug model's, a narrow one and the last block
CHOICE_CASES = [("layers.0.attention.wo", 4096, 4096), ("layers.0.feed_forward.w1", 4096, 14336),
                ("layers.0.w", 256, 768), ("layers.1.w", 8192, 512), ("layers.1.w", 1024, 1024),
                ("layers.2.w", 2048, 2048), ("layers.3.w", 4096, 4096), ("layers.3.w", 2048, 512),
                ("output", 4096, 256), ("layers.0.w", 4104, 4096)]


@pytest.mark.parametrize("gpu", [B200, dataclasses.replace(B200, fp4_flops=B200.bf16_flops)],
                         ids=["B200", "slow_fp4"])
def test_per_layer_choice_is_the_fastest_predicted_recipe(gpu):
    recipes = ("nvfp4", "mxfp8")
    filters = auto_recipe_filters(recipes, num_layers=4, tokens=2048, gpu=gpu)
    chosen = set()
    for fqn, k, n in CHOICE_CASES:
        gains = {}
        for r in recipes:
            in_tail = r == "nvfp4" and fqn.startswith("layers.3.")  # ceil(0.15 * 4) = 1 block
            fits = k % 32 == 0 and n % 32 == 0  # both recipes' blocks (16x16, 1x32)
            gains[r] = predicted_speedup(r, k, n, tokens=2048, gpu=gpu) if fits and not in_tail else 0
        best = max(recipes, key=gains.get)
        expected = best if gains[best] > 1.0 else None
        got = [r for r, f in zip(recipes, filters) if f(_meta_linear(k, n), fqn)]
        assert got == ([expected] if expected else []), (fqn, k, n, gains)
        chosen.add(expected)
    if gpu is B200:  # nvfp4 where it is allowed and faster, mxfp8 in the tail, bf16 for small ones
        assert chosen == {"nvfp4", "mxfp8", None}
    else:  # FP4 no faster than bf16: the float8 recipe wins where it gains
        assert chosen == {"mxfp8", None}


def test_per_layer_filters_are_exclusive_and_complementary_conversions_work():
    recipes = ("mxfp8", "nvfp4", "tensorwise")
    filters = auto_recipe_filters(recipes, filter_fqns=["output"], num_layers=8, gpu=B200)
    for fqn in ("layers.0.w1", "layers.7.w1", "output"):
        for k in (256, 1024, 2048, 4096, 8192):
            for n in (512, 2048, 14336):
                assert sum(f(_meta_linear(k, n), fqn) for f in filters) <= 1, (fqn, k, n)
    assert not any(f(_meta_linear(4096, 4096), "output") for f in filters)  # filter_fqns
    model = nn.ModuleDict({"layers": nn.ModuleList(
        nn.ModuleDict({"w1": nn.Linear(4096, 4096, bias=False, device="meta")}) for _ in range(8)),
        "output": nn.Linear(4096, 256, bias=False, device="meta")})
    for recipe, accept in zip(recipes, filters):
        convert_to_float8_training(model, config=recipe, module_filter_fn=accept)
    # nvfp4 in blocks 0-5, mxfp8 (faster than tensorwise) in the ceil(0.15 * 8) = 2 tail
    # blocks, the output head in bf16
    configs = {r: Float8LinearConfig.from_recipe_name(r) for r in recipes}
    kinds = [next(r for r, c in configs.items() if m.w1.config == c) for m in model["layers"]]
    assert kinds[:6] == ["nvfp4"] * 6 and kinds[6:] == ["mxfp8"] * 2, kinds
    assert type(model["output"]) is nn.Linear


def test_per_layer_choice_arguments_say_what_to_change():
    with pytest.raises(ValueError, match="num_layers=None.*'nvfp4' keeps its last blocks"):
        auto_recipe_filters(("nvfp4", "mxfp8"), gpu=B200)
    with pytest.raises(ValueError, match="distinct recipes"):
        auto_recipe_filters(("mxfp8", "mxfp8"))
    with pytest.raises(ValueError, match="distinct recipes"):
        auto_recipe_filters(())
    assert len(auto_recipe_filters(("mxfp8", "rowwise"))) == 2  # no tail: num_layers not needed
