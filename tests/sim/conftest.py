"""[Note: one intra-op thread for simulated ranks]
Simulated ranks compare with one device bit for bit, and a float32 kernel's order of sums can
depend on how many intra-op threads it runs on, which differs between the main thread and rank
threads that share the pool: with 2 threads (OMP_NUM_THREADS unset, as in CI) a rank's input
gradient in tests/sim/parallel/ep/test_dispatch.py's one-rank dp test came out in other last bits than the
reference's. So every test here, reference included, runs with one intra-op thread."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
