"""Delayed scaling under TP + SP with the float8 styles (2 simulated ranks) against one device;
the checks run inside tests/distributed/delayed_tp.py (run by tests/sim/programs.py), the figures are re-checked here."""

from tests.sim.programs import simulated


PROGRAM = ("delayed_tp", 2)


def test_delayed_tp_sp_matches_one_device():
    r = simulated(*PROGRAM)
    assert r["world"] == 2
    for init in (True, False):
        figures = r[f"amax_init={init}"]
        steps = figures["collectives_per_step"]
        assert len(steps) == 4
        # one batched all-reduce per sync: 4 linears x 3 delayed operands x (amax, out-of-range
        # flag), fp32; the first sync also checks the ranks' layers (16 bytes)
        n = 4 * 3 * 8
        assert [s["sync"]["all_reduce"]["input_bytes"] for s in steps] == [n + 16, n, n, n], steps
        # after the first step: the logical amax of each cast made before an all-gather (the FFN's
        # and proj's inputs, w2's gradient), 4 bytes each
        assert all(s["fwd"]["all_reduce"]["input_bytes"] == 8 and s["bwd"]["all_reduce"]["input_bytes"] == 4
                   for s in steps[1:]), steps
        # the first step: 4 weights + the 3 inputs cast in float8 (w1 and w3 share one) in
        # forward, 4 grad_outputs in backward
        assert steps[0]["fwd"]["all_reduce"]["calls"] == 7, steps[0]
        assert steps[0]["bwd"]["all_reduce"]["calls"] == 4, steps[0]
        assert figures["sp_fwd_all_gather_bytes_per_element"] == 1.0
        assert figures["sp_bwd_all_gather_bytes_per_element"] == 1.0
        assert figures["min_sqnr_db"] >= 120, figures
        assert figures["buffers_max_rel_diff"] <= 1e-5, figures
    # a 1e4x drop: every cast re-scales from its current amax on the step of the drop (the casts
    # before an all-gather from the logical one), counted, and the histories restart
    drop = r["amax_init=True"]["drop"]
    before, after = drop["output_sqnr_db"][0], drop["output_sqnr_db"][1:]
    assert min(after) > max(15, before - 5), drop  # as before the drop (0 dB without re-scaling)
    counts = drop["counters"]
    assert counts["ffn.w1"]["input"]["out_of_range_steps"] == 1, counts
    assert counts["proj"]["input"]["out_of_range_steps"] == 1, counts
    message = r["errors"]["no_submodule"]
    assert "delayed" in message and "fwd_config_submodule_fqn" in message, message
