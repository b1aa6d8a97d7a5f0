"""Tensor-parallel attention in the float8 MoE transformer against one device, on 2 simulated
ranks (TP + SP) and on a 2 x 2 (dp, tp) mesh with FSDP2; the program is
tests/distributed/tp_moe.py, run by tests/sim/programs.py."""

from tests.sim.programs import simulated


TP = ("tp_moe", 2, "--recipe", "tensorwise")
FSDP2_X_TP = ("tp_moe", 4, "--dp", "2", "--recipe", "rowwise")


def _check(r, floor, experts_floor):
    floors = r["sqnr_db"]
    assert floors["logits"] > 120 and floors["aux_loss"] > 120, floors
    assert any(".moe.experts." in name for name in floors), floors
    low = {k: v for k, v in floors.items()
           if v <= (experts_floor if ".moe.experts." in k else floor)}
    assert not low, low


def test_tp_attention_in_the_moe_model_matches_one_device():
    r = simulated(*TP)
    # the experts' gradients leave the grouped gemm in bf16, and a tensorwise cast amplifies
    # the attention's summation order into whole float8 steps of a few elements ([Note: a float8
    # cast amplifies summation order] in tests/sim/parallel/tp/test_llama.py)
    _check(r, floor=90, experts_floor=60)


def test_fsdp2_x_tp_attention_in_the_moe_model_matches_one_device():
    r = simulated(*FSDP2_X_TP)
    assert r["dp"] == 2, r
    _check(r, floor=110, experts_floor=110)
