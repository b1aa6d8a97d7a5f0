"""tests/sim/programs.py: simulated ranks that run as their processes would ([Note: one rank at a
time]), and a torchrun program's result from them."""

import torch
import torch.distributed as dist

from tests.sim.programs import run_as_processes, run_program


def test_each_rank_draws_what_its_process_would():
    # every rank draws from torch's global generator around collectives; each must draw what a
    # fresh process of its own draws (threads share the generator: interleaved draws differ)
    def rank_main(rank):
        first = torch.rand(3)  # a fresh process's seed
        dist.barrier()
        torch.manual_seed(rank)
        x = torch.rand(4)
        dist.all_reduce(torch.ones(1))
        return first, x, torch.rand(4)

    for rank, (first, x, y) in enumerate(run_as_processes(2, rank_main, timeout=60)):
        g = torch.Generator()  # a fresh process's default generator
        assert torch.equal(first, torch.rand(3, generator=g))
        g.manual_seed(rank)
        assert torch.equal(x, torch.rand(4, generator=g)) and torch.equal(y, torch.rand(4, generator=g))


def test_a_program_returns_what_rank_0_wrote():
    r = run_program("comm_counts", 2)
    assert r["world"] == 2 and r["nothing"] == {}
    assert r["all_reduce"] == {"all_reduce": {"calls": 1, "input_bytes": 40, "output_bytes": 40}}


def test_each_rank_observes_its_own_casts():
    # f8dist.debug's recorder observes the casts of its process: on threads, rank 0's observer
    # saw rank 1's casts too (the observers were one list for every rank)
    from f8dist.config import CastSpec
    from f8dist.core import cast

    def rank_main(rank):
        seen = []
        cast.cast_observers.append(lambda site, hp, fp8: seen.append(hp.shape[0]))
        cast.cast_to_float8(torch.ones(rank + 1, 16), CastSpec(dtype=torch.float8_e4m3fn))
        dist.barrier()  # the other rank casts meanwhile
        return seen

    assert run_as_processes(2, rank_main, timeout=60) == [[1], [2]]
    assert cast.cast_observers == []  # the process's own list, back and empty
