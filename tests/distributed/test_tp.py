"""Float8 TP+SP (2 ranks) and FSDP2 x TP (4 ranks) against one device; programs in tp_llama.py."""


import pytest

from tests.distributed.harness import run_torchrun

FLOOR_DB = 120.0  # fp32: only summation order differs from one device


def _check_recipe(name, figures, *, weight_grads=True):
    sqnr = figures["sqnr_db"]
    low = {k: v for k, v in sqnr.items() if v < FLOOR_DB and (weight_grads or not k.startswith("grad:"))}
    assert not low, f"{name}: below {FLOOR_DB} dB against one device: {low}"
    # every sequence-parallel input crosses the wire in float8: 1 byte per element, plus a
    # 4-byte scale per token (per `dim` elements) for per-token recipes
    assert figures["fwd_all_gather_bytes_per_element"] <= 1.1, figures
    assert figures["bwd_all_gather_bytes_per_element"] <= 1.1, figures


@pytest.fixture(scope="module")
def tp_results():
    return run_torchrun("tp_llama", 2, "--dp", "1", timeout=240)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_tp_sp_matches_one_device(tp_results, recipe):
    _check_recipe(recipe, tp_results[recipe])


def test_tp_sp_float8_activations_for_backward_match_one_device(tp_results):
    _check_recipe("rowwise+float8_activations", tp_results["rowwise+float8_activations"])


def test_tp_backward_takes_the_weight_amax_from_forward(tp_results):
    """[Note: what the matmul keeps for backward]: a TP-sharded tensorwise weight all-reduces its
    amax in forward only; computing it again in backward costs one all-reduce per float8 linear,
    with the same numbers."""
    carried, recomputed = tp_results["tensorwise"], tp_results["tensorwise+weight_amax_recomputed"]
    assert carried["float8_linears"] == recomputed["float8_linears"] > 0
    extra = recomputed["bwd_all_reduce_calls"] - carried["bwd_all_reduce_calls"]
    assert extra == carried["float8_linears"], (carried, recomputed)
    _check_recipe("tensorwise+weight_amax_recomputed", recomputed)


def test_tp_sp_rowwise_with_gw_hp(tp_results):
    # grad_weight in high precision takes the float8-communicated operands, dequantized: outputs
    # and input grads match one device; weight grads match one device that makes the same wire
    # casts, and not a plain one (which proves the wire carried float8)
    plain = tp_results["rowwise_with_gw_hp"]
    _check_recipe("rowwise_with_gw_hp", plain, weight_grads=False)
    _check_recipe("rowwise_with_gw_hp+wire_reference", tp_results["rowwise_with_gw_hp+wire_reference"])
    worst = min(v for k, v in plain["sqnr_db"].items() if k.startswith("grad:"))
    assert worst < 60, plain["sqnr_db"]


def test_tensorwise_sends_no_scales(tp_results):
    # 5 forward all-gathers (attention + FFN inputs of 2 layers, the output layer's input),
    # exactly 1 byte per element
    figures = tp_results["tensorwise"]
    assert figures["fwd_all_gather_calls"] == 5
    assert figures["fwd_all_gather_bytes_per_element"] == 1.0


def test_padded_local_shard(tp_results):
    assert tp_results["padded_shard_sqnr_db"] >= FLOOR_DB


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_rowwise_style_with_replicated_input_matches_one_device(tp_results, recipe):
    # Replicate() -> Shard(-1) is a local split, no communication: see [Note: which
    # redistributions carry float8] in f8dist/tp/style.py
    figures = tp_results["rowwise_replicated_input"][recipe]
    assert isinstance(figures, dict), f"{recipe}: {figures}"
    low = {k: v for k, v in figures.items() if v < FLOOR_DB}
    assert not low, f"{recipe}: below {FLOOR_DB} dB against one device: {low}"


@pytest.mark.parametrize(
    "case, words",
    [
        ("embedding", ["Float8ColwiseParallel", "Embedding", "Float8Linear"]),
        ("plain_linear", ["Float8RowwiseParallel", "convert_to_float8_training", "RowwiseParallel"]),
        ("partial_input", ["P(sum)", "Replicate()"]),
        ("bad_submodule", ["'w9'", "['w1', 'w2', 'w3']"]),
        ("shard_not_16", ["proj", "over 2 ranks", "out_features = 24", "pad_inner_dim"]),
        ("delayed_input", ["delayed", "fwd_config_submodule_fqn"]),
        ("2d_mesh_to_plan", ["1-D", "mesh['tp']"]),
        ("unconverted_model", ["no Float8Linear", "convert_to_float8_training", "float8=False"]),
    ],
)
def test_misspecified_plans_raise(tp_results, case, words):
    message = tp_results["errors"][case]
    assert message != "no error", f"{case} raised nothing"
    for word in words:
        assert word in message, f"{case}: {word!r} not in {message!r}"


@pytest.fixture(scope="module")
def results_2d():
    return run_torchrun("tp_llama", 4, "--dp", "2", "--recipes", "tensorwise,rowwise", timeout=240)


FLOAT8_ALL_GATHER = ["tensorwise+float8_all_gather", "tensorwise+float8_all_gather+precompute"]


# [Note: a float8 cast amplifies summation order]
# TP sums partial products across ranks in another order than one device's gemm, so activations
# and gradients differ from one device in the last fp32 bit. Downstream, a tensorwise float8 cast
# whose amax moved by one ulp moves its scale, and every element near a rounding boundary flips
# by one float8 ulp. Whether that happens depends on the CPU's BLAS blocking: 2-D weight
# gradients measured 81-118 dB on an Intel (AVX-512) machine, > 120 dB on an AMD one, and the
# rowwise 2-D grad_input 92 dB on the CPU of the H100 machine (scripts/gpu_check.sh). The hole
# this guards against (a weight amax reduced over dp only) shows as 42-48 dB, and its exact
# detector is the scale check below (bit-equal scales).
FLOOR_2D_DB = 70.0


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", *FLOAT8_ALL_GATHER])
def test_fsdp_x_tp_matches_one_device(results_2d, recipe):
    # 2 x 2 mesh: each dp rank's batch against one device running that batch; weight grads
    # against one device accumulating both batches
    sqnr = results_2d[recipe]["sqnr_db"]
    low = {k: v for k, v in sqnr.items() if v < FLOOR_2D_DB}
    assert not low, f"{recipe} (dp=2 x tp=2): below {FLOOR_2D_DB} dB against one device: {low}"


@pytest.mark.parametrize("variant", FLOAT8_ALL_GATHER)
def test_fsdp_x_tp_float8_all_gather_uses_the_whole_weight_scale(results_2d, variant):
    # the all-gathered (and precomputed) scale of every float8 weight equals the one-device scale
    # bit for bit on every rank: an amax reduced over dp only (torchao's hole) differs on the tp
    # ranks that do not hold the weight's max (checked in tp_llama.check_weight_scales)
    assert results_2d[variant]["weight_scales_equal_one_device"] is True


def test_fsdp_x_tp_precompute_all_reduces(results_2d):
    plain = results_2d["tensorwise"]
    eager = results_2d["tensorwise+float8_all_gather"]
    pre = results_2d["tensorwise+float8_all_gather+precompute"]
    n = pre["float8_linears"]
    assert n > 0
    # precompute: ONE all-reduce for all weights (sharded over dp and tp = over every rank)
    assert pre["precompute_all_reduce_calls"] == 1
    # forward: a high-precision all-gathered weight reduces its amax over tp, a float8
    # all-gathered one over dp and tp at once (1 per weight either way), a precomputed one not at
    # all; the other all-reduces (activation amaxes) are the same in every variant
    assert plain["fwd_all_reduce_calls"] - pre["fwd_all_reduce_calls"] == n
    assert eager["fwd_all_reduce_calls"] - pre["fwd_all_reduce_calls"] == n
