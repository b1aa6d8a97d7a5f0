"""f8dist/core/agreement.py on 4 simulated ranks in one process (threads): each rank counts its own
checks over a group, so repeated checks by ranks sharing a process agree (they hung, each thread
bumping the round of the others), and a rank that differs is still named."""

import pytest
import torch.distributed as dist

from f8dist.core import agreement
from tests.sim.threads import run_threads


def test_ranks_in_one_process_make_repeated_checks(monkeypatch):
    monkeypatch.setenv(agreement.TIMEOUT_ENV, "5")  # a hang fails in seconds

    def rank_main(rank):
        for _ in range(3):  # each check over the same group is its own round
            agreement.agree({("fc", "float8"): "True"}, dist.group.WORLD, what="w", fix="f")
        return True

    assert run_threads(4, rank_main, timeout=30) == [True] * 4


def test_runs_of_other_worlds_start_with_fresh_checks(monkeypatch):
    """run_threads' ranks start without the checks of an earlier run (as fresh processes): a
    2-rank run then a 4-rank one over a group of the same name (they hung: ranks 0 and 1 a round
    ahead of ranks 2 and 3)."""
    monkeypatch.setenv(agreement.TIMEOUT_ENV, "2")

    def rank_main(rank):
        agreement.agree({("fc", "float8"): "True"}, dist.group.WORLD, what="w", fix="f")
        return True

    assert run_threads(2, rank_main, timeout=30) == [True] * 2
    assert run_threads(4, rank_main, timeout=30) == [True] * 4


def test_a_differing_rank_is_named_by_ranks_in_one_process(monkeypatch):
    monkeypatch.setenv(agreement.TIMEOUT_ENV, "5")

    def rank_main(rank):
        agreement.agree({("fc", "float8"): "True"}, dist.group.WORLD, what="w", fix="f")
        agreement.agree({("fc", "float8"): str(rank != 3)}, dist.group.WORLD, what="w", fix="f")

    with pytest.raises(RuntimeError, match="rank 3") as e:
        run_threads(4, rank_main, timeout=30)
    assert "fc" in str(e.value)
