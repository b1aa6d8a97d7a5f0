"""EP x FSDP2 on a 2 x 2 mesh of simulated ranks against one device; the checks run inside
tests/distributed/moe_ep_fsdp.py (run by tests/sim/programs.py), the figures are re-checked here."""

from tests.sim.programs import simulated


PROGRAM = ("moe_ep_fsdp", 4)


def test_ep_x_fsdp2_matches_one_device():
    r = simulated(*PROGRAM)
    assert r["world"] == 4 and r["min_sqnr_db"] > 45, r
    assert r["sqnr_db"]["logits"] > 100 and r["sqnr_db"]["layers.0.moe.router.gate"] > 100, r
    assert any("experts.w2" in name for name in r["sqnr_db"]), r
    assert r["state_dict_local_types"] == ["Tensor"], r["state_dict_local_types"]
