"""f8dist.debug under DTensor sharding, TP-like and FSDP2 (2 ranks): the statistics equal a
one-device run's. The program is tests/distributed/debug_stats.py."""

from tests.distributed.harness import launch, result as launched

PROGRAM = launch("debug_stats", 2, timeout=300)


def test_distributed_stats_equal_one_device():
    result = launched(PROGRAM)
    assert result is not None, "debug_stats wrote no result"
    assert result["checked"] == [
        "direct [Shard(dim=0)]", "direct [Shard(dim=1)]", "direct [Replicate()]",
        "tp-like colwise linear", "fsdp2",
        "fsdp2 float8 all-gather",
    ]
