"""scripts/train.py with a mixture-of-experts model on 2 CPU ranks: expert parallelism (--ep 2,
float8 token dispatch) in bf16 (per-op selective activation checkpointing), float8 rowwise and
delayed, all learn and float8 ends within 3 % of bf16;
a checkpoint saved under EP (experts sharded over the ep ranks) resumes under FSDP2 alone (--ep 1,
experts sharded by FSDP2), resharded by DCP, and continues the EP run's losses up to summation
order."""

from tests.distributed.harness import launch, result

STEPS, EVERY = 10, 6
FLAGS = (f"--steps {STEPS} --log-every 100 --warmup-steps 2 --seq-len 32 --batch-size 4 "
         "--moe-experts 4 --moe-top-k 2")
# in the 2-rank launch of the selected modules' programs ([Note: one launch, several programs])
PROGRAM = launch("train_moe", 2, "--train", FLAGS, "--ckpt-dir", "TMP", "--every", EVERY, timeout=300)


def _mean(xs):
    return sum(xs) / len(xs)


def test_train_moe_with_expert_parallelism_and_a_resharded_resume():
    r = result(PROGRAM)
    bf16, fp8, resumed = r["bf16"]["losses"], r["rowwise"]["losses"], r["resumed"]
    for other in (fp8, r["delayed"]["losses"]):  # rowwise, delayed (experts with histories)
        for losses in (bf16, other):
            assert _mean(losses[-3:]) < 0.8 * _mean(losses[:3]), losses  # it learned
        assert abs(_mean(other[-3:]) - _mean(bf16[-3:])) / _mean(bf16[-3:]) < 0.03, (bf16, other)
        assert other != bf16
    # the rowwise run's last checkpoint removed, --resume took step 6's, saved under EP
    assert resumed["steps"] == list(range(EVERY + 1, STEPS + 1)), resumed
    for a, b in zip(resumed["losses"], fp8[EVERY:]):
        assert abs(a - b) / b < 0.01, (resumed["losses"], fp8[EVERY:])
