"""f8dist.optim.AdamW under FSDP2 and TP, and its DCP round trips (program: optim_dcp.py; the
bit-exact comparisons are asserted there)."""

from tests.distributed.harness import launch, result


RESHARD = launch("optim_dcp", 3, "--ckpt-dir", "TMP", timeout=240)


def test_8bit_adamw_fsdp2_tp_and_dcp_reshard_2_to_3_ranks():
    r = result(RESHARD)
    assert r["world"] == 3
    # a step reads and writes each rank's shard only
    assert r["fsdp2_step_collectives"] == [{}] * 3
    assert r["tp_step_collectives"] == [{}]
    # torch's fp32 AdamW, resharded onto 3 ranks, holds exactly the moments saved from 2
    assert r["reshard_saved_moments"] == r["fsdp2_moments_at_save"]
    assert r["head_shard_rows"] == [2] and r["extra_shard_numel"] == [86]  # rank 0's shards
