"""scripts/train.py end to end on 2 CPU ranks, as FSDP2 (dp=2, selective AC) and as tensor
parallel (tp=2, full AC): loss falls, float8 tensorwise ends within 3 % of bf16 on the same data,
and a run resumed from a checkpoint gives the same losses, bit for bit, as the uninterrupted run.
Delayed scaling on both layouts: checkpointing changes no loss, gradient accumulation almost none.
"""

import pytest

from tests.distributed.harness import run_torchrun

STEPS, EVERY = 30, 20


def _mean(xs):
    return sum(xs) / len(xs)


@pytest.mark.parametrize("layout", ["--tp 1 --ac sac", "--tp 2 --ac full"], ids=["fsdp2", "tp2"])
def test_train_float8_tracks_bf16_and_resumes_bit_exact(layout):
    flags = f"--steps {STEPS} --log-every 10 --warmup-steps 5 {layout}"
    result = run_torchrun("train_e2e", 2, "--train", flags, "--every", EVERY, timeout=300)
    bf16, fp8, resumed = result["bf16"], result["float8"], result["resumed"]

    for run in (bf16, fp8):
        assert run["steps"] == list(range(1, STEPS + 1))
        # from ~ln(256) = 5.5 nats/byte at init to well below: the model learned
        assert _mean(run["losses"][-5:]) < 0.7 * _mean(run["losses"][:3]), run["losses"]
    base, ours = _mean(bf16["losses"][-10:]), _mean(fp8["losses"][-10:])
    assert abs(ours - base) / base < 0.03, (base, ours)
    assert bf16["losses"] != fp8["losses"]  # float8 really ran
    assert "| tensorwise |" in result["table"]

    assert resumed["steps"] == list(range(EVERY + 1, STEPS + 1))
    assert resumed["losses"] == fp8["losses"][EVERY:]  # bit for bit


@pytest.mark.parametrize("layout,variants", [
    ("--tp 1", {"full": "--ac full", "sac": "--ac sac", "accum": "--grad-accum-steps 2"}),
    ("--tp 2", {"full": "--ac full", "accum": "--ac sac --grad-accum-steps 2"}),
], ids=["fsdp2", "tp2"])
def test_train_delayed_with_checkpointing_and_accumulation(layout, variants):
    """--float8 delayed: activation checkpointing (full, selective) gives the losses of the run
    without it, bit for bit; two micro-batches per step give those of one batch up to summation
    order and the first step's rounding (each micro-batch casts from its own amax)."""
    flags = f"--steps 8 --log-every 100 --warmup-steps 3 --float8 delayed {layout}"
    args = ["--variant=none=--ac none"] + [f"--variant={k}={v}" for k, v in variants.items()]
    r = run_torchrun("train_variants", 2, "--train", flags, *args, timeout=300)
    base = r["none"]["losses"]
    assert r["none"]["steps"] == list(range(1, 9))
    assert _mean(base[-3:]) < 0.85 * _mean(base[:3]), base  # the model learned
    for name in variants:
        losses = r[name]["losses"]
        if name == "accum":
            assert losses != base and max(abs(a - b) / b for a, b in zip(losses, base)) < 0.01
        else:
            assert losses == base, (name, losses, base)
