"""scripts/loss_table.py's pieces that need no process group: its layouts parse on their ranks,
and its row."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import loss_table  # noqa: E402
import train  # noqa: E402


@pytest.mark.parametrize("name", list(loss_table.LAYOUTS))
def test_each_layout_runs_in_bf16_and_float8_on_its_ranks(name, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(loss_table.ranks_of(name)))
    both, float8 = loss_table.LAYOUTS[name]
    assert train.parse_args([*both, "--float8", "none"]).float8 == "none"
    assert train.parse_args([*both, *float8]).float8 != "none"


def test_row_gives_final_losses_and_the_gap_to_bf16():
    row = loss_table.layout_row("cp2", [9.0, 2.0, 2.0], [9.0, 2.0, 2.02], ["--float8", "rowwise"],
                                tail=2)
    assert row == "| cp2 | `--float8 rowwise` | 2.0000 | 2.0100 | +0.50% |"


def test_an_unknown_layout_is_refused(capsys):
    with pytest.raises(SystemExit):
        loss_table.main(["--layouts", "cp2,tp4"])
    assert "--layouts cp2,tp4: unknown ['tp4']" in capsys.readouterr().err


def test_a_layout_of_other_ranks_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        loss_table.main(["--layouts", "cp2,hsdp"])
    assert ("each layout runs on its own number of ranks, this job has 2: hsdp (4); run those "
            "with torchrun --nproc_per_node=N") in capsys.readouterr().err
