"""Delayed scaling under TP + SP with the float8 styles (2 ranks) against one device; the checks
run inside tests/distributed/delayed_tp.py, the figures are re-checked here."""

from tests.distributed.harness import run_torchrun


def test_delayed_tp_sp_matches_one_device():
    r = run_torchrun("delayed_tp", 2)
    assert r["world"] == 2
    for init in (True, False):
        figures = r[f"amax_init={init}"]
        steps = figures["collectives_per_step"]
        assert len(steps) == 4
        # one batched all-reduce per sync: 4 linears x 3 delayed operands x (amax, out-of-range
        # flag), fp32; the first sync also checks the ranks' layers (16 bytes)
        n = 4 * 3 * 8
        assert [s["sync"]["all_reduce"]["input_bytes"] for s in steps] == [n + 16, n, n, n], steps
        # no amax collective in forward / backward after the first step
        assert all("all_reduce" not in s["fwd"] and "all_reduce" not in s["bwd"] for s in steps[1:]), steps
        # the first step: 4 weights + the 3 inputs cast in float8 (w1 and w3 share one) in
        # forward, 4 grad_outputs in backward
        assert steps[0]["fwd"]["all_reduce"]["calls"] == 7, steps[0]
        assert steps[0]["bwd"]["all_reduce"]["calls"] == 4, steps[0]
        assert figures["sp_fwd_all_gather_bytes_per_element"] == 1.0
        assert figures["sp_bwd_all_gather_bytes_per_element"] == 1.0
        assert figures["min_sqnr_db"] >= 120, figures
        assert figures["buffers_max_rel_diff"] <= 1e-5, figures
    # a 1e6x drop: the casts before an all-gather keep the history scale on the steps that jump
    # (the FFN input, then proj's input, which the flushed FFN output left at 0), counted; the
    # restarted histories make the next steps healthy
    drop = r["amax_init=True"]["drop"]
    assert min(drop["output_sqnr_db"][2:]) > 20, drop  # (the first two: 0 dB)
    counts = drop["counters"]
    assert counts["ffn.w1"]["input"]["out_of_range_steps"] == 1, counts
    assert counts["proj"]["input"]["out_of_range_steps"] == 1, counts
    message = r["errors"]["no_submodule"]
    assert "delayed" in message and "fwd_config_submodule_fqn" in message, message
