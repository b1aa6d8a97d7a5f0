"""The harness turns a failing rank into a test failure with its traceback, and a hang into a
failure after the timeout (never a hung test run)."""

import pytest

from tests.distributed.harness import run_torchrun


def test_failing_rank_fails_with_its_traceback():
    with pytest.raises(pytest.fail.Exception) as info:
        run_torchrun("fail_rank", 2, "raise", timeout=120)
    msg = str(info.value)
    assert "rank1 traceback" in msg
    assert "ValueError: rank 1 fails on purpose" in msg


def test_hang_is_killed_at_timeout():
    with pytest.raises(pytest.fail.Exception) as info:
        run_torchrun("fail_rank", 2, "hang", timeout=3)
    assert "ran past 3" in str(info.value)
