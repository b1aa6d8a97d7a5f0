"""What a torchrun program of tests/distributed/ reports: a file when the harness names one, else
its figures on stdout, and no file left behind."""

import json
import os
from types import SimpleNamespace

from tests.distributed import torchtitan_fsdp
from tests.distributed.common import write_result


def test_write_result_prints_unless_given_a_path(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_result(SimpleNamespace(result=None), {"ratio": 0.5})
    assert json.loads(capsys.readouterr().out) == {"ratio": 0.5}
    write_result(SimpleNamespace(result=None), {"ratio": 0.5},
                 table=lambda r: f"ratio {r['ratio']}")
    assert capsys.readouterr().out == "ratio 0.5\n"
    assert os.listdir(tmp_path) == []  # run by hand: nothing written

    path = tmp_path / "result.json"
    write_result(SimpleNamespace(result=str(path)), {"ratio": 0.5}, table=str)
    assert json.loads(path.read_text()) == {"ratio": 0.5}
    assert capsys.readouterr().out == ""


def _step(**kinds):
    return {k: {"calls": c, "input_bytes": b, "output_bytes": b} for k, (c, b) in kinds.items()}


def test_torchtitan_fsdp_table():
    """The table of docs/torchtitan.md from a result: losses, distance to bf16, collectives."""
    out = {"world": 2}
    for i, variant in enumerate(torchtitan_fsdp.VARIANTS):
        out[variant] = {
            "losses": [8.0 + 0.01 * i, 6.0],
            "forward": [_step(all_gather=(3, 1000), all_reduce=(30, 120)),
                        _step(all_gather=(3, 1000))],
            "optimizer_step": [_step(all_reduce=(2, 736)), _step(all_reduce=(1, 720))],
        }
    lines = torchtitan_fsdp.table(out).splitlines()
    assert lines[0].startswith("| variant | step 1 | step 2 | max abs diff vs bf16 |")
    assert lines[1].count("|---") == lines[0].count("|") - 1
    assert lines[2] == ("| bf16 | 8.0000 | 6.0000 | - | - | 1,000 | step 1: 30 (120 B); "
                        "step 2: 0 | step 1: 2 (736 B); step 2: 1 (720 B) |")
    assert lines[3].startswith("| tensorwise | 8.0100 | 6.0000 | 0.0100 | 0.12% | 1,000 |")
    assert len(lines) == 2 + len(torchtitan_fsdp.VARIANTS)
