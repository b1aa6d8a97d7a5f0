"""FSDP2 float8 gradient reduce-scatter on 2 gloo ranks (program: fsdp_reduce_scatter.py), the
torchrun smoke of the float8 reduce-scatter, scripts/train.py's included; 3 ranks (uneven, an
empty shard) run simulated: tests/sim/parallel/fsdp/test_reduce_scatter.py."""

from tests.distributed.harness import launch, result
from tests.sim.parallel.fsdp.test_reduce_scatter import check_bytes, check_grads, check_train, mean

TWO_RANKS = launch(
    "fsdp_reduce_scatter", 2, "--scenarios", "disagree,grads,bytes,train,train_script", timeout=300)


def test_float8_reduce_scatter_two_ranks():
    r = result(TWO_RANKS)
    assert r["world"] == 2
    assert "ranks disagree" in r["disagree_error"] and "block_size" in r["disagree_error"]
    check_grads(r)
    check_bytes(r)
    check_train(r)

    # scripts/train.py --float8-reduce-scatter: the LLaMA model's gradients cross as uint8
    # all-to-alls (2 FSDP units x 12 steps) and the loss tracks the fp32-reduce run
    s = r["train_script"]
    assert s["collectives"]["all_to_all"]["calls"] == 24
    assert "reduce_scatter" not in s["collectives"]
    plain, f8 = s["plain"], s["float8_reduce_scatter"]
    assert plain != f8
    assert abs(mean(f8[-3:]) - mean(plain[-3:])) / mean(plain[-3:]) < 0.01
