"""f8dist.debug under DTensor sharding, TP-like and FSDP2 on 2 simulated ranks
(tests/sim/programs.py runs tests/distributed/debug_stats.py, each rank recording its own casts):
the statistics equal a one-device run's."""

from tests.sim.programs import run_program


def test_distributed_stats_equal_one_device():
    result = run_program("debug_stats", 2)
    assert result is not None, "debug_stats wrote no result"
    assert result["checked"] == [
        "direct [Shard(dim=0)]", "direct [Shard(dim=1)]", "direct [Replicate()]",
        "tp-like colwise linear", "fsdp2",
        "fsdp2 float8 all-gather",
    ]
