"""f8dist.testing.count_collectives on 2 ranks: calls and bytes of known collectives."""

from tests.distributed.harness import launch, result


PROGRAM = launch("comm_counts", 2)


def test_count_collectives_two_ranks():
    r = result(PROGRAM)
    w = r["world"]
    assert w == 2
    assert r["all_reduce"] == {"all_reduce": {"calls": 1, "input_bytes": 40, "output_bytes": 40}}
    assert r["fsdp_style"] == {
        "all_gather": {"calls": 1, "input_bytes": 6, "output_bytes": 6 * w},
        "reduce_scatter": {"calls": 1, "input_bytes": 2 * 4 * w, "output_bytes": 2 * 4},
    }
    assert r["dtensor_amax"] == {"all_reduce": {"calls": 1, "input_bytes": 4, "output_bytes": 4}}
    assert r["nested_inner"] == {"broadcast": {"calls": 1, "input_bytes": 12, "output_bytes": 12}}
    assert r["nested_outer"] == {
        "broadcast": {"calls": 1, "input_bytes": 12, "output_bytes": 12},
        "all_reduce": {"calls": 1, "input_bytes": 8, "output_bytes": 8},
    }
    assert r["nothing"] == {}
    assert r["expect_raised"] is True
