"""Float8 TP+SP on 2 gloo ranks against one device (program: tp_llama.py, tensorwise): the torchrun
smoke of tensor parallelism and its float8 all-gather; every recipe, FSDP2 x TP and the plans'
errors run simulated in tests/sim/parallel/tp/test_llama.py."""

from tests.distributed.harness import launch, result
from tests.sim.parallel.tp.test_llama import check_recipe

TENSORWISE = launch("tp_llama", 2, "--dp", "1", "--recipes", "tensorwise", "--only-recipes",
                    timeout=240)


def test_tp_sp_tensorwise_matches_one_device_and_sends_no_scales():
    figures = result(TENSORWISE)["tensorwise"]
    check_recipe("tensorwise", figures)
    # 5 forward all-gathers (attention + FFN inputs of 2 layers, the output layer's input),
    # exactly 1 byte per element
    assert figures["fwd_all_gather_calls"] == 5
    assert figures["fwd_all_gather_bytes_per_element"] == 1.0
