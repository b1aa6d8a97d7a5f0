"""Delayed scaling under DDP with a different number of micro-batches per rank (``no_sync``) and a
layer that runs on one rank only, against one device; the checks run inside
tests/distributed/delayed_ddp.py, the figures are re-checked here."""

from tests.distributed.harness import launch, result


PROGRAM = launch("delayed_ddp", 2)


def test_delayed_ddp_uneven_micro_batches_and_one_rank_layer_match_one_device():
    r = result(PROGRAM)
    assert min(r["weight_sqnr_db"].values()) >= 100, r
    assert r["buffers_max_rel_diff"] <= 1e-5, r
    # every delayed buffer of the three linears is kept out of DDP's broadcasts
    assert len(r["ddp_ignored"]) == 3 * 3 * 4 and all(".fp8_" in n for n in r["ddp_ignored"]), r
