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
        # one batched all-reduce per sync: 4 linears x 3 delayed operands, fp32
        assert all(s["sync"] == {"all_reduce": {"calls": 1, "input_bytes": 48, "output_bytes": 48}}
                   for s in steps), steps
        # no amax collective in forward / backward, but for the first step's init with amax init
        quiet = steps[1:] if init else steps
        assert all("all_reduce" not in s["fwd"] and "all_reduce" not in s["bwd"] for s in quiet), steps
        if init:  # 4 weights + 3 sharded inputs in forward, 4 sharded grad_outputs in backward
            assert steps[0]["fwd"]["all_reduce"]["calls"] == 7, steps[0]
            assert steps[0]["bwd"]["all_reduce"]["calls"] == 4, steps[0]
        assert figures["sp_fwd_all_gather_bytes_per_element"] == 1.0
        assert figures["sp_bwd_all_gather_bytes_per_element"] == 1.0
        assert figures["min_sqnr_db"] >= 120, figures
        assert figures["buffers_max_rel_diff"] <= 1e-5, figures
    message = r["errors"]["no_submodule"]
    assert "delayed" in message and "fwd_config_submodule_fqn" in message, message
