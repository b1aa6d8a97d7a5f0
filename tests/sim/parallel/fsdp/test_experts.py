"""FSDP2 float8 all-gather of expert weights on 2 simulated ranks (FSDP2 alone) and on a 2 x 2
(dp_shard, ep) mesh; the checks against one device run inside tests/distributed/fsdp_experts.py
(run by tests/sim/programs.py), the bytes are checked here."""

from tests.sim.programs import simulated

DIM, HIDDEN, EXPERTS = 64, 32, 4
WEIGHT = 3 * EXPERTS * HIDDEN * DIM  # w1, w2, w3: elements of the experts' weights


FSDP = ("fsdp_experts", 2, "--scenario", "fsdp")
EP_X_FSDP = ("fsdp_experts", 4, "--scenario", "ep_fsdp")


def test_fsdp_float8_all_gather_of_experts_matches_one_device():
    r = simulated(*FSDP)
    assert r["world"] == 2 and "experts.w2" in r["checked"], r
    b = r["bytes"]
    # 1 byte per element and a float32 scale per expert (gathered with them: FSDP2 shards the
    # experts dim, each rank's experts are whole), against 2 bytes per element
    assert b["float8"]["all_gather"] == WEIGHT + 3 * EXPERTS * 4, b
    assert b["bf16"]["all_gather"] == 2 * WEIGHT, b
    assert b["float8"]["all_reduce"] == 0, b  # no amax crosses ranks: the shards hold whole experts
    assert b["float8"]["all_gather"] / b["bf16"]["all_gather"] < 0.51, b


def test_ep_x_fsdp_float8_all_gather_of_experts_matches_one_device():
    r = simulated(*EP_X_FSDP)
    assert r["world"] == 4 and r["min_sqnr_db_other"] > 100, r
    b, local = r["bytes"], WEIGHT // 2  # each EP rank gathers its 2 experts over dp_shard
    assert b["float8"]["all_gather"] == local and b["bf16"]["all_gather"] == 2 * local, b
    # the local experts' amaxes, one all-reduce per weight over dp_shard (the axis sharding dim 1)
    assert b["float8"]["all_reduce"] == 3 * (EXPERTS // 2) * 4, b
    assert b["float8"]["all_gather"] / b["bf16"]["all_gather"] == 0.5, b
