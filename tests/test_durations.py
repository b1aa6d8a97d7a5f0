"""tests/durations.py: a --durations report summed per file, setup, call and teardown together."""

from tests.durations import kind, per_file

REPORT = """\
============================= slowest durations ==============================
12.50s setup    tests/distributed/test_train.py::test_a[x]
0.25s call     tests/distributed/test_train.py::test_a[x]
1.00s call     tests/sim/test_delayed.py::test_b

(3 durations < 0.005s hidden.  Use -vv to show these durations.)
"""


def test_per_file_sums_every_phase_of_every_test():
    assert per_file(REPORT) == {"tests/distributed/test_train.py": 12.75, "tests/sim/test_delayed.py": 1.0}


def test_kinds():
    assert kind("tests/distributed/test_train.py") == "torchrun"
    assert kind("tests/sim/test_delayed.py") == "sim"
    assert kind("tests/policy/test_delayed.py") == "compile"
