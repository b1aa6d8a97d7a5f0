"""scripts/train.py's checkpoints: --resume with another --float8 recipe ([Note: loading across
recipes] in f8dist/policy/checkpoint.py) and past a damaged step ([Note: verified checkpoints] in
scripts/train.py); and what its log says. train.py runs as plain python (one rank)."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.distributed.harness import REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, "scripts"))
import train as train_script  # noqa: E402

TRAIN = os.path.join(REPO_ROOT, "scripts", "train.py")
TINY = "--dim 32 --n-layers 1 --n-heads 4 --seq-len 16 --batch-size 2 --warmup-steps 0 --log-every 1"


def train(*flags, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    out = subprocess.run([sys.executable, TRAIN, *TINY.split(), *map(str, flags)], env=env,
                         capture_output=True, text=True, timeout=180)
    if check:
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """Two tensorwise steps, a checkpoint after each, float8 stats of each: (its dir, stdout)."""
    tmp = tmp_path_factory.mktemp("train")
    out = train("--steps", 2, "--float8", "tensorwise", "--checkpoint-dir", tmp / "ckpt",
                "--checkpoint-every", 1, "--float8-stats-every", 1, "--float8-stats-dir", tmp / "stats",
                "--metrics-file", tmp / "metrics" / "m.json")
    return tmp, out.stdout


def test_the_log_says_what_ran_where_it_went_and_how_it_ended(first_run):
    tmp, stdout = first_run
    lines = stdout.splitlines()
    # which linears run in float8 (the 7 of each block) and which stay high precision (the output)
    assert ("float8 linears (tensorwise): 7 of 8: layers.*.attention.wq, layers.*.attention.wk, "
            "layers.*.attention.wv, layers.*.attention.wo, layers.*.feed_forward.w1, "
            "layers.*.feed_forward.w2, layers.*.feed_forward.w3 | high precision: 1: output") in lines, stdout
    assert [line for line in lines if line.startswith("saved checkpoint")] == [
        f"saved checkpoint {tmp / 'ckpt' / f'step-{s}'}" for s in (1, 2)]
    # the stats tables go to their files (they were printed into the log at every recorded step)
    assert not any(line.startswith("float8 casts") for line in lines), stdout
    stats = [line for line in lines if line.startswith("float8 stats")]
    assert len(stats) == 1 and f"{tmp / 'stats' / 'float8_stats.txt'}" in stats[0], stats
    assert (tmp / "stats" / "float8_stats.txt").read_text().startswith("float8 casts, step 2")
    done = lines[-1]
    assert re.fullmatch(r"done: 2 steps \(1-2\) in 0:00:\d\d, [\d,]+ tokens/s per rank after the first "
                        r"step, peak memory \d+\.\d\dGiB, final loss \d\.\d{4}, metrics in .*m\.json", done), done
    assert float(done.split("final loss ")[1].split(",")[0]) == pytest.approx(
        json.loads((tmp / "metrics" / "m.json").read_text())["losses"][-1], abs=1e-4)


def test_resume_with_another_float8_recipe_past_a_damaged_step(first_run):
    tmp_path = first_run[0] / "ckpt"
    ckpt = ("--checkpoint-dir", tmp_path, "--checkpoint-every", 1)
    shard = tmp_path / "step-2" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # truncated after the save
    # it failed with DCP's "Missing key in checkpoint state_dict: model.layers.0...fp8_amax_input"
    # (and before that, with an unpickling error in the truncated step-2)
    delayed = train("--steps", 3, "--float8", "delayed", "--resume", *ckpt)
    assert (f"checkpoint {tmp_path / 'step-2'} is damaged: __0_0.distcp differs from what was saved "
            "(100 bytes now); trying the one before it") in delayed.stdout, delayed.stdout
    assert f"resumed from {tmp_path / 'step-1'} at step 1" in delayed.stdout, delayed.stdout
    assert "delayed-scaling histories restarted for 7 linear(s)" in delayed.stdout, delayed.stdout
    assert "step: 3" in delayed.stdout
    # the checkpoint of a 2-step run resumed to 3 steps: the schedule follows this run's --steps,
    # and the log says so ([Note: a resumed schedule]; it changed without a word)
    assert ("learning-rate schedule changed on resume: --steps 3 (saved 2); it follows this run's "
            "flags, so step 2 takes lr 0.000975 (the saved run's: 0.0003)") in delayed.stdout, delayed.stdout
    # a checkpoint past --steps: one line (it printed nothing and exited 0)
    done = train("--steps", 2, "--float8", "delayed", "--resume", *ckpt)
    assert done.stdout.splitlines() == [f"nothing to do: {tmp_path / 'step-3'} is at step 3 and "
                                        "--steps is 2; raise --steps to train on"], done.stdout


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garbage(path):
    path.write_bytes(os.urandom(path.stat().st_size))


@pytest.mark.parametrize("file, spoil, wrong", [
    ("__0_0.distcp", _truncate, "__0_0.distcp differs from what was saved"),
    ("__0_0.distcp", _garbage, "__0_0.distcp differs from what was saved"),
    (".metadata", _truncate, ".metadata differs from what was saved"),
    (".metadata", _garbage, ".metadata differs from what was saved"),
    ("checksums.json", _garbage, "checksums.json unreadable"),
    ("__0_0.distcp", os.remove, "__0_0.distcp missing"),
])
def test_resume_passes_over_a_damaged_step(tmp_path, file, spoil, wrong):
    for step in (10, 20):
        dcp.save({"w": torch.full((64,), float(step))}, checkpoint_id=str(tmp_path / f"step-{step}"))
        train_script.write_checksums(str(tmp_path / f"step-{step}"))
    assert train_script.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step-20")
    spoil(tmp_path / "step-20" / file)
    lines = []
    assert train_script.latest_checkpoint(str(tmp_path), log=lines.append) == str(tmp_path / "step-10")
    assert len(lines) == 1 and f"step-20 is damaged: {wrong}" in lines[0], lines
    spoil(tmp_path / "step-10" / file)
    assert train_script.latest_checkpoint(str(tmp_path), log=lines.append) is None


def test_a_step_without_checksums_needs_a_readable_metadata(tmp_path):
    dcp.save({"w": torch.ones(64)}, checkpoint_id=str(tmp_path / "step-1"))  # an older train.py's
    assert train_script.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step-1")
    _garbage(tmp_path / "step-1" / ".metadata")
    lines = []
    assert train_script.latest_checkpoint(str(tmp_path), log=lines.append) is None
    assert ".metadata unreadable" in lines[0], lines
    # the other direction (a delayed checkpoint into a tensorwise model): tests/policy/test_checkpoint.py
