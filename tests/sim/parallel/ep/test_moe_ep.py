"""Expert parallelism against one device on 4 simulated ranks and delayed experts on 2
(tests/sim/programs.py runs the programs tests/distributed/moe_ep.py and moe_ep_delayed.py: the
checks run inside them, the figures are re-checked here); the 2-rank torchrun/gloo smoke of
expert parallelism and its float8 all-to-all is tests/distributed/test_moe_ep.py."""

from tests.sim.programs import simulated

FOUR_RANKS = ("moe_ep", 4, "--recipes", "rowwise")
DELAYED = ("moe_ep_delayed", 2)


def test_expert_parallel_on_4_ranks_matches_one_device_bit_for_bit():
    r = simulated(*FOUR_RANKS)
    assert r["world"] == 4 and r["empty_groups_on_a_rank"], r


def test_delayed_experts_under_expert_parallelism_match_one_device_bit_for_bit():
    """[Note: delayed experts]: histories per expert weight FQN, first-step amaxes over the EP
    axis, the sync over all ranks."""
    r = simulated(*DELAYED)
    assert r["world"] == 2 and r["buffers_checked"] == 3 * 3 * 3 * 4, r  # steps x w x op x buffer
