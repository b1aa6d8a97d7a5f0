"""Delayed scaling on 2 ranks (FSDP2 with float8 all-gather, and TP) against one device; the
checks run inside tests/distributed/delayed_sync.py, the figures are re-checked here."""

from tests.distributed.harness import run_torchrun


def test_delayed_sync_fsdp_and_tp_match_one_device():
    r = run_torchrun("delayed_sync", 2)
    assert r["world"] == 2
    for scenario in ("fsdp", "tp"):
        steps = r[scenario]["collectives_per_step"]
        assert len(steps) == 5
        # one batched all-reduce of every delayed amax of the model (fp32, 4 bytes each) per sync
        n_amax = {"fsdp": 3 * 3, "tp": 2 * 3}[scenario]
        assert all(s["sync"] == {"all_reduce": {"calls": 1, "input_bytes": 4 * n_amax,
                                                "output_bytes": 4 * n_amax}} for s in steps), steps
        assert min(r[scenario]["weight_sqnr_db"].values()) >= 60, r[scenario]
    # first-step init under float8 all-gather: one all-reduce per weight in the first forward only
    assert r["fsdp_amax_init"]["forward_all_reduces"] == [3, 0, 0], r["fsdp_amax_init"]
    fsdp_steps = r["fsdp"]["collectives_per_step"]
    assert all("all_reduce" not in s["fwd_bwd"] for s in fsdp_steps)
    # weights all-gathered in float8 (1 byte per element, with the delayed scale, no amax
    # collective), biases in float32; twice per step (forward, and backward after the reshard)
    weights, biases = 32 * 64 + 64 * 32 + 32 * 16, 64 + 32 + 16
    assert all(s["fwd_bwd"]["all_gather"]["output_bytes"] == 2 * (weights + 4 * biases)
               for s in fsdp_steps), fsdp_steps
