"""f8dist/core/agreement.py on one process: what the ranks compare, how a difference is named, and that
one process pays nothing. The 2-rank checks are tests/distributed/test_agreement.py."""

import pytest
import torch.nn as nn

from f8dist import Float8LinearConfig, convert_to_float8_training
from f8dist.core import agreement


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


class _Ranks:
    """The leader (rank 0) of a 3-rank group, alone with a real TCPStore: what the others set is
    put in the store by hand."""

    def __init__(self, monkeypatch):
        import datetime

        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=10))
        c10d = dist.distributed_c10d
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
        monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1, 2])
        monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
        monkeypatch.setattr(c10d, "_get_default_store", lambda: self.store)
        monkeypatch.setattr(agreement, "_rounds", {})
        self.group = type("Group", (), {"group_name": "g"})()

    def publish(self, rank, settings):
        import hashlib
        import json

        text = json.dumps(sorted([m, f, v] for (m, f), v in settings.items()))
        self.store.set(f"f8dist/agreement/g/0/hash/{rank}", hashlib.sha256(text.encode()).hexdigest())
        self.store.set(f"f8dist/agreement/g/0/settings/{rank}", text)


def test_ranks_that_never_check_cost_the_timeout_once(monkeypatch):
    import time

    ranks = _Ranks(monkeypatch)
    monkeypatch.setenv(agreement.TIMEOUT_ENV, "0.5")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks 1, 2 did not check their float8 settings within 0.5 s"):
        agreement.agree({("0", "float8"): "True"}, ranks.group, what="w", fix="f")
    assert time.monotonic() - start < 0.9  # one deadline, not 0.5 s per missing rank
    assert ranks.store.get("f8dist/agreement/g/0/verdict").decode().startswith("f8dist: w")


def test_the_leader_names_what_differs_and_who_agrees(monkeypatch):
    ranks = _Ranks(monkeypatch)
    mine = agreement.settings(_model("tensorwise"))
    ranks.publish(1, mine)
    ranks.publish(2, agreement.settings(_model("delayed")))
    with pytest.raises(RuntimeError, match="ScalingType.DYNAMIC on ranks 0, 1, ScalingType.DELAYED on rank 2"):
        agreement.agree(mine, ranks.group, what="w", fix="f")
    assert ranks.store.get("f8dist/agreement/g/0/verdict") == b"send 2"  # one rank per distinct hash


def test_agreeing_ranks_get_ok(monkeypatch):
    ranks = _Ranks(monkeypatch)
    mine = agreement.settings(_model("rowwise"))
    ranks.publish(1, mine)
    ranks.publish(2, mine)
    agreement.agree(mine, ranks.group, what="w", fix="f")
    assert ranks.store.get("f8dist/agreement/g/0/verdict") == b"ok"


def test_settings_cover_experts_and_the_float8_dispatch():
    from f8dist.parallel.ep import Float8ExpertParallel
    from f8dist.models.moe import MoE, MoEArgs

    moe = MoE(32, 64, MoEArgs(num_experts=4, top_k=2))
    plain = agreement.settings(moe)
    assert plain["experts", "float8"] == "False" and ("experts", "tp_style") not in plain
    convert_to_float8_training(moe, config=Float8LinearConfig.from_recipe_name("rowwise"))
    converted = agreement.settings(moe)
    assert converted["experts", "float8"] == "True"
    assert converted["experts", "round_scales_to_power_of_2"] == "True"
    # what Float8ExpertParallel._apply records (applied on simulated ranks: tests/sim/parallel/ep/)
    agreement.record_style(moe.experts, Float8ExpertParallel(float8_dispatch=False))
    assert (agreement.settings(moe)["experts", "tp_style"]
            == "Float8ExpertParallel(float8_dispatch=False)")
