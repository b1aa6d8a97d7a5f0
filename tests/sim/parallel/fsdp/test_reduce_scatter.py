"""FSDP2 float8 gradient reduce-scatter on 3 simulated ranks, uneven and empty shards
(tests/distributed/fsdp_reduce_scatter.py run by tests/sim/programs.py); its 2-rank torchrun/gloo
smoke, scripts/train.py included, is tests/distributed/test_fsdp_reduce_scatter.py."""

from tests.sim.programs import simulated

# e4m3 in blocks of 256 measured 34-38 dB on the whole model; a 4-element bias (head.bias) has
# too few elements to average its rounding errors (24-37 dB): each parameter gets the goal's 20 dB
WHOLE_FLOOR_DB, PARAM_FLOOR_DB = 30.0, 20.0
PARAMS = {"all", "emb.weight", "norm.weight", "norm.bias", "fc1.weight", "fc1.bias", "fc2.weight",
          "fc2.bias", "head.weight", "head.bias"}


def mean(xs):
    return sum(xs) / len(xs)


def check_grads(r):
    # every setting: every gradient against FSDP2's own reduction under the same setting (a
    # wrong divide factor, a wrong chunk or a wrong scale would be ~0 dB or worse)
    assert set(r["grads_sqnr_db"]) == {"mean", "force_sum", "divide_by_1", "divide_by_4",
                                       "bf16_reduce"}
    for setting, per_param in r["grads_sqnr_db"].items():
        assert set(per_param) == PARAMS
        for name, db in per_param.items():
            assert db > (WHOLE_FLOOR_DB if name == "all" else PARAM_FLOOR_DB), (setting, name, db)
    # the same float8 payloads scaled by FSDP2's factor: sum = world x mean, divide-by-4 = world/4
    for setting, err in r["sum_vs_mean_max_rel_err"].items():
        assert err < 1e-6, (setting, err)


def check_train(r):
    curves = r["train"]
    for name, losses in curves.items():
        assert mean(losses[-5:]) < 0.7 * losses[0], (name, losses)  # the model learned
    final = {name: mean(losses[-5:]) for name, losses in curves.items()}
    assert abs(final["float8"] - final["bf16"]) / final["bf16"] < 0.01, final
    assert abs(final["float8"] - final["fp32"]) / final["fp32"] < 0.01, final
    assert curves["float8"] != curves["fp32"]  # float8 really reduced the gradients


def check_bytes(r):
    b = r["bytes"]
    assert "reduce_scatter" not in b["float8"]  # the all-to-all replaced it
    f8 = b["float8"]["all_to_all"]["input_bytes"]
    bf16 = b["bf16"]["reduce_scatter"]["input_bytes"]
    fp32 = b["fp32"]["reduce_scatter"]["input_bytes"]
    assert fp32 == 2 * bf16
    assert f8 <= 0.6 * bf16, (f8, bf16)
    assert f8 <= 0.26 * fp32, (f8, fp32)
    assert b["float8"]["all_to_all"]["calls"] == b["bf16"]["reduce_scatter"]["calls"] == 3


def test_float8_reduce_scatter_three_ranks_uneven():
    r = simulated("fsdp_reduce_scatter", 3, "--scenarios", "grads,bytes,train")
    assert r["world"] == 3
    assert r["shard_rows_fc1_head"] == [[43, 2], [43, 2], [42, 0]]  # uneven, one empty shard
    check_grads(r)
    check_bytes(r)
    check_train(r)
