"""FSDP2 float8 all-gather of block-scaled weights on 2 simulated ranks (tests/sim/programs.py
runs tests/distributed/fsdp_block.py); 8 ranks, uneven and empty shards: test_weight.py."""

from tests.sim.programs import simulated


PROGRAM = ("fsdp_block", 2, "--scenarios", "parity,bytes,split")


def test_fsdp_block_scaled_all_gather_parity_bytes_and_split_blocks():
    r = simulated(*PROGRAM)
    assert r["world"] == 2
    # bit-identical to one device (asserted in the program); each forward all-gathers the two
    # weights (bytes and scales in one call each) and reduces no amax
    for tag in ("fp8_ag", "hp_ag"):
        for fwd in r[f"{tag}_forward_collectives"]:
            assert set(fwd) == {"all_gather"} and fwd["all_gather"]["calls"] == 2, (tag, fwd)
    b = r["bytes"]
    # 1 byte per element plus 1 e8m0 byte per 32x32 block, against bf16's 2 bytes per element
    assert b["fp8_all_gather_output_bytes"] == (128 * 64 + 64 * 128) * (1 + 1 / 1024)
    assert b["ratio"] <= 0.52, b
    assert "splits its 32-wide blocks" in r["split_error"]
    assert "enable_fsdp_float8_all_gather=False" in r["split_error"]
