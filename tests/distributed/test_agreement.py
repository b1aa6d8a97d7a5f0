"""Ranks whose float8 settings disagree fail at the first step, within seconds, with a message that
names the difference; ranks that agree pay one 16-byte all-gather ([Note: ranks that disagree] in
f8dist/agreement.py). The program is tests/distributed/agreement.py (2 ranks, one launch)."""

import pytest

from tests.distributed.harness import run_torchrun

# before f8dist/agreement.py, all but recipes_fsdp hung until the process-group timeout and then
# died with a gloo error; recipes_fsdp trained with different numerics per rank
MISMATCHES = {
    "float8_all_gather_on_rank0_only": ["enable_fsdp_float8_all_gather: True on rank 0, False on rank 1"],
    "delayed_vs_dynamic_fsdp": [
        "cast_config_input.scaling_type: ScalingType.DELAYED on rank 0, ScalingType.DYNAMIC on rank 1"
    ],
    "recipes_fsdp": ["cast_config_input.scaling_granularity", "round_scales_to_power_of_2"],
    "recipes_tp": ["scaling_granularity: ScalingGranularity.TENSORWISE on rank 0, "
                   "ScalingGranularity.AXISWISE on rank 1"],
    "delayed_vs_dynamic_tp": ["cast_config_weight.scaling_type"],
    "float8_styles_on_rank0_only": ["tp_style: Float8ColwiseParallel(", "on rank 0, <not set> on rank 1",
                                    "layers.0.attention.wq"],
}
SECONDS = 10.0  # the process-group timeout these cases used to wait for is minutes


@pytest.fixture(scope="module")
def results():
    return run_torchrun("agreement", 2, timeout=180)


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_disagreeing_ranks_fail_fast_naming_the_difference(results, case):
    outcome = results[case]
    assert outcome["error"] is not None, f"{case}: trained without an error"
    assert "disagree on its float8 settings" in outcome["error"], outcome["error"]
    for words in MISMATCHES[case]:
        assert words in outcome["error"], f"{case}: {words!r} not in\n{outcome['error']}"
    assert outcome["seconds"] < SECONDS, outcome


def test_agreeing_ranks_pay_one_16_byte_all_gather(results):
    outcome = results["matching"]
    assert outcome["error"] is None, outcome["error"]
    first, second = outcome["first"], outcome["second"]
    # the first step runs what every step runs, plus the check: one all-gather of 2 int64 per rank
    extra = {
        kind: {k: first[kind][k] - second.get(kind, {}).get(k, 0) for k in first[kind]}
        for kind in first
    }
    assert extra.pop("all_gather") == {"calls": 1, "input_bytes": 16, "output_bytes": 32}, outcome
    assert all(v == {"calls": 0, "input_bytes": 0, "output_bytes": 0} for v in extra.values()), extra
    assert set(first) == set(second), outcome
