"""Per-op SAC with expert parallelism on 2 simulated ranks (tests/sim/programs.py); the
bit-for-bit checks against no checkpointing run inside tests/distributed/moe_sac.py, the
all-to-all counts are checked here."""

from tests.sim.programs import simulated


PROGRAM = ("moe_sac", 2)


def test_selective_checkpointing_with_expert_parallelism_saves_the_dispatch():
    r = simulated(*PROGRAM)
    a2a = r["all_to_all"]
    assert r["world"] == 2 and r["params"] > 10, r
    # per layer, forward: the token counts, the dispatch (float8 bytes, their scales), the
    # combine; backward: the combine's and the dispatch's gradients
    assert a2a["none"]["calls"] == 2 * 6, a2a
    assert a2a["sac"] == a2a["none"], a2a  # saved: nothing replayed in backward
    assert a2a["full"]["calls"] == 2 * 10, a2a  # full checkpointing replays the forward's four
