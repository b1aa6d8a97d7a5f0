"""FSDP2 float8 all-gather on 3 simulated ranks (uneven and empty shards, DCP) against one device:
tests/distributed/fsdp_float8.py run by tests/sim/programs.py; its 2-rank torchrun/gloo smoke is
tests/distributed/test_fsdp_float8.py."""

from tests.sim.programs import simulated

N_FLOAT8_WEIGHTS = 3  # fc1, fc2, head in fsdp_float8.Net
STEPS = 3


def check_precompute_counts(r):
    # the first forward (no precompute yet) reduces each float8 weight's amax; after precompute
    # the forward does none, and precompute itself is one all-reduce of 3 float32 amaxes
    assert r["fp8_ag_forward_all_reduces"] == [N_FLOAT8_WEIGHTS] + [0] * (STEPS - 1)
    assert r["hp_ag_forward_all_reduces"] == [0] * STEPS
    for step in range(STEPS):
        assert r[f"precompute_step{step}"] == {
            "all_reduce": {"calls": 1, "input_bytes": 4 * N_FLOAT8_WEIGHTS,
                           "output_bytes": 4 * N_FLOAT8_WEIGHTS}
        }


def test_fsdp_float8_three_ranks_uneven_and_dcp():
    # parity: bit-identical outputs and grads (asserted in the program), float8 and bf16 all-gather
    r = simulated("fsdp_float8", 3, "--scenarios", "parity,dcp", "--ckpt-dir", "TMP")
    assert r["world"] == 3
    assert r["fc1_shard_rows"] == [43, 43, 42]
    assert r["head_shard_rows"] == [2, 2, 0]  # rank 2 holds an empty shard
    check_precompute_counts(r)
    assert r["dcp_dtypes"] == ["torch.float32"]  # weights stay in high precision
    assert "fc1.weight" in r["dcp_keys"] and "head.weight" in r["dcp_keys"]
