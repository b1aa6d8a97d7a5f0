"""f8dist/agreement.py on one process: what the ranks compare, how a difference is named, and that
one process pays nothing. The 2-rank checks are tests/distributed/test_agreement.py."""

import pytest
import torch.nn as nn

from f8dist import Float8LinearConfig, agreement, convert_to_float8_training


def _model(recipe="tensorwise", keep=lambda mod, fqn: True):
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    return convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=keep
    )


def test_settings_name_each_linear_and_config_field():
    s = agreement.settings(_model("rowwise", keep=lambda mod, fqn: fqn != "2"))
    assert s["0", "float8"] == "True" and s["2", "float8"] == "False"
    assert s["0", "cast_config_input.scaling_granularity"] == "ScalingGranularity.AXISWISE"
    assert s["0", "round_scales_to_power_of_2"] == "True"
    assert not any(module == "2" and field != "float8" for module, field in s)


def test_differences_name_fields_ranks_and_modules():
    a, b = agreement.settings(_model("tensorwise")), agreement.settings(_model("delayed"))
    c = agreement.settings(_model("tensorwise", keep=lambda mod, fqn: fqn != "2"))
    text = agreement._differences([a, a, b, c], [0, 1, 2, 3])
    assert ("cast_config_input.scaling_type: ScalingType.DYNAMIC on ranks 0, 1, 3, "
            "ScalingType.DELAYED on rank 2 (modules 0)") in text
    # a linear converted on some ranks only is named once, not by each of its config fields
    assert "float8: True on ranks 0, 1, 2, False on rank 3 (modules 2)" in text
    assert "on rank 3 (modules 0, 2)" not in text


def test_one_process_registers_no_hook():
    before = dict(nn.modules.module._global_forward_pre_hooks)
    _model()
    assert nn.modules.module._global_forward_pre_hooks == before


def test_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(agreement.TIMEOUT_ENV, "2.5")
    assert agreement.timeout_s() == 2.5
    monkeypatch.delenv(agreement.TIMEOUT_ENV)
    assert agreement.timeout_s() == 60.0
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv(agreement.TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match="F8DIST_AGREEMENT_TIMEOUT_S"):
            agreement.timeout_s()


def test_delayed_buffers_are_kept_out_of_ddp_broadcasts():
    model = _model("delayed", keep=lambda mod, fqn: fqn != "2")
    ignored = model._ddp_params_and_buffers_to_ignore
    assert sorted(ignored) == sorted(
        f"0.fp8_{kind}_{op}" for op in ("input", "weight", "grad_output")
        for kind in ("amax", "amax_history", "scale", "steps"))
    assert not hasattr(_model("tensorwise"), "_ddp_params_and_buffers_to_ignore")


def test_settings_cover_experts_and_the_float8_dispatch():
    from f8dist.models.moe import MoE, MoEArgs

    moe = MoE(32, 64, MoEArgs(num_experts=4, top_k=2))
    plain = agreement.settings(moe)
    assert plain["experts", "float8"] == "False" and plain["<root>", "float8_dispatch"] == "True"
    convert_to_float8_training(moe, config=Float8LinearConfig.from_recipe_name("rowwise"))
    converted = agreement.settings(moe)
    assert converted["experts", "float8"] == "True"
    assert converted["experts", "round_scales_to_power_of_2"] == "True"
    moe.float8_dispatch = False
    assert agreement.settings(moe)["<root>", "float8_dispatch"] == "False"
