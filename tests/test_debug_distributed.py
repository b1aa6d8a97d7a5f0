"""f8dist.debug under DTensor sharding, TP-like and FSDP2 (2 ranks, gloo): the statistics equal a
one-device run's. The program is tests/distributed/debug_stats.py."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_distributed_stats_equal_one_device():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "tests", "distributed", "debug_stats.py")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "checked: direct [Shard(dim=0)], direct [Shard(dim=1)], direct [Replicate()], " \
           "tp-like colwise linear, fsdp2" in proc.stdout
    assert proc.stdout.strip().endswith("OK")
