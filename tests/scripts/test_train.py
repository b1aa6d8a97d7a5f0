"""scripts/train.py and scripts/compare_loss.py pieces that need no process group."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import compare_loss  # noqa: E402
import train  # noqa: E402
import train_flags  # noqa: E402
from tests.sim.threads import run_threads  # noqa: E402


def test_lr_warms_up_then_decays_to_a_tenth():
    args = train.parse_args(["--steps", "100", "--warmup-steps", "10", "--lr", "1.0"])
    assert train.lr_at(5, args) == 0.5
    assert train.lr_at(10, args) == 1.0
    lrs = [train.lr_at(s, args) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert train.lr_at(100, args) == pytest.approx(0.1)


@pytest.mark.parametrize("argv, match", [
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--float8", "rowwise", "--float8-all-gather"], "tensorwise weight cast"),
    (["--float8", "mxfp8", "--float8-all-gather"], "square weight blocks"),
    (["--float8", "fp8"], "invalid choice"),
    # 128x128 weight blocks: the fixes are flags (they were module_filter_fn and a config field)
    (["--float8", "blockwise"], "(64 -> 64): block-scaled float8 needs the layer's dims to divide "
     "into its blocks, got in_features=64 (block 128), out_features=64 (block 128); add "
     "--pad-inner-dim (the last block zero-padded, exact), use --dim 128 --ffn-dim-multiplier 1.5 "
     "or keep the linears in high precision with --float8 none (see --help)"),
    (["--float8", "mxfp8", "--dim", "48", "--n-heads", "3"], "use --dim 96 or keep"),
    (["--float8", "tensorwise", "--pad-inner-dim"],
     "every linear of this model takes --float8 tensorwise as it is: it would do nothing"),
    (["--float8", "none", "--pad-inner-dim"], "--pad-inner-dim change(s) how float8 linears"),
    (["--float8", "mxfp8", "--dim", "48"], "in_features=48 (block 32)"),
    (["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
    (["--log-every", "0"], "argument --log-every: must be a positive integer, got 0"),  # was % 0
    (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),  # saved nothing
    (["--tp", "0"], "argument --tp: must be a positive integer, got 0"),
    (["--seq-len", "100000000"], "--seq-len 100000000 is longer than the training text"),  # hung
    (["--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
    (["--grad-accum-steps", "0"], "argument --grad-accum-steps: must be a positive integer, got 0"),
    (["--batch-size", "6", "--grad-accum-steps", "4"], "--grad-accum-steps 4 must divide each rank's batch"),
    (["--ep", "2"], "--ep shards experts: it needs --moe-experts N"),
    (["--moe-experts", "2", "--moe-top-k", "3"], "--moe-top-k 3 exceeds --moe-experts 2"),
    (["--moe-experts", "4", "--compile"], "--moe-experts does not run with --compile"),
    (["--max-norm", "-1"], "--max-norm must be positive (inf: no clipping), got -1.0"),  # reversed grads
    (["--max-norm", "0"], "--max-norm must be positive"),
    (["--max-norm", "nan"], "--max-norm must be positive"),
    (["--checkpoint-dir", "/dev/null/ckpt"], "--checkpoint-dir /dev/null/ckpt: /dev/null is not a directory"),
    (["--metrics-file", "/dev/null/m.json"], "--metrics-file /dev/null/m.json: /dev/null is not a directory"),
    (["--metrics-file", "/proc/sys/m.json"], "--metrics-file /proc/sys/m.json: cannot write in /proc/sys"),
    (["--metrics-file", "/tmp"], "--metrics-file /tmp is a directory"),
    (["--float8-stats-every", "1", "--float8-stats-dir", "/dev/null/s"], "--float8-stats-dir /dev/null/s"),
    # flags that would do nothing in the run: refused, not ignored
    (["--float8", "none", "--recompute-norm-output"],
     "--recompute-norm-output change(s) how float8 linears keep"),
    (["--float8", "none", "--float8-activations-for-backward", "--recompute-swiglu-product"],
     "--float8-activations-for-backward, --recompute-swiglu-product change(s)"),
    (["--float8", "mxfp8", "--sp-grad-weight", "recast"], "add --tp N or drop it"),
    (["--moe-top-k", "3"], "--moe-top-k picks the experts of each token: it would do nothing"),
    (["--float8-stats-dir", "s"], "add --float8-stats-every N or drop it"),
    (["--float8-reduce-scatter"], "with one, FSDP2 runs no reduce-scatter"),
    (["--float8-ep-combine"], "--float8-ep-combine casts what an expert-parallel all-to-all "
     "sends; without expert parallelism there is none: it would do nothing in this run; add "
     "--moe-experts N --ep M or drop it"),
    (["--moe-experts", "4", "--float8-ep-backward"], "--float8-ep-backward casts what an"),
])
def test_bad_flags_say_what_to_change_in_one_line(argv, match, capsys):
    with pytest.raises(SystemExit):
        train.parse_args(argv)
    err = capsys.readouterr().err
    assert match in err
    assert err.count("\n") == 1, err  # no usage dump


@pytest.mark.parametrize("argv, match", [
    (["--float8", "none", "--pad-inner-dim"], "--pad-inner-dim change(s) how float8 linears"),
    (["--float8", "fp8"], "argument --float8: invalid choice: 'fp8'"),
    (["--tp", "2", "--float8-reduce-scatter"], "with one, FSDP2 runs no reduce-scatter"),
    (["--pp", "2", "--tp", "2"], "--pp does not run with --tp in train.py yet"),
    (["--dp-replicate", "2", "--float8-reduce-scatter"], "more ranks than --tp x --dp-replicate"),
    (["--float8", "none", "--float8-stats-every", "1"],
     "--float8-stats-every records float8 casts in eager mode: it needs a --float8 recipe and no "
     "--compile"),
])
def test_a_refused_flag_ends_the_script_before_it_imports_torch(argv, match):
    """[Note: flags before torch]: under torchrun every rank paid torch's import for it."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "train.py")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root, "WORLD_SIZE": "2", "RANK": "0"}
    run = subprocess.run([sys.executable, "-X", "importtime", script, *argv], env=env,
                         capture_output=True, text=True, timeout=60)
    lines = run.stderr.splitlines()
    imported = {line.split("|")[-1].strip() for line in lines if line.startswith("import time:")}
    message = [line for line in lines if not line.startswith("import time:")]
    assert run.returncode == 2 and len(message) == 1 and match in message[0], run.stderr[-2000:]
    assert "argparse" in imported and not imported & {"torch", "f8dist"}, sorted(imported)


@pytest.mark.parametrize("argv, match", [
    (["--tp", "3"], "--tp 3 must divide the number of ranks (4)"),
    (["--batch-size", "6"], "--batch-size 6 must be a multiple of the 4 data-parallel ranks"),
    (["--tp", "4", "--n-heads", "2"], "must be multiples of it (got 2)"),
    (["--moe-experts", "6", "--ep", "4"], "--ep 4 must divide --moe-experts (6)"),
    (["--moe-experts", "4", "--ep", "2", "--tp", "2"], "does not run with --tp with --ep > 1"),
    (["--moe-experts", "6", "--float8", "tensorwise", "--float8-all-gather"],
     "which must divide --moe-experts (6)"),
    # 128x128 weight blocks: dim 128 over 2 tp ranks leaves 64 rows of wq per rank
    (["--tp", "2", "--float8", "blockwise", "--dim", "128", "--ffn-dim-multiplier", "1.5"],
     "attention.wq (128 -> 128) over 2 ranks: the output gemm's weight cast has (128, 128) blocks"),
    (["--tp", "4", "--seq-len", "62"], "--seq-len 62 must be a multiple of --tp 4: sequence parallelism"),
    (["--tp", "2", "--float8", "rowwise", "--recompute-norm-output"],
     "under --tp the norms are sequence parallel"),
    (["--tp", "4", "--float8-reduce-scatter"], "with one, FSDP2 runs no reduce-scatter"),
    (["--tp", "2", "--float8", "rowwise", "--sp-grad-weight", "backward_gather"],
     "sp_grad_weight='backward_gather'"),  # a recipe it does not apply to
    # pipeline stages: the flags that do not compose with --pp yet, and the schedule's rules
    (["--pp", "3"], "--pp 3 must divide the number of ranks (4) and be at most --n-layers (2)"),
    (["--pp", "4"], "be at most --n-layers (2): each stage takes whole layers"),
    (["--pp", "2", "--tp", "2", "--compile"], "--pp does not run with --tp, --compile in train.py"),
    (["--pp", "2", "--moe-experts", "4"], "--pp does not run with --moe-experts"),
    (["--pp", "2", "--checkpoint-dir", "ckpt"], "--pp does not run with --checkpoint-dir"),
    (["--pp", "2", "--float8-stats-every", "1"], "--pp does not run with --float8-stats-every"),
    (["--pp", "2", "--grad-accum-steps", "2"], "--grad-accum-steps (use --pp-microbatches)"),
    (["--pp", "2", "--pp-microbatches", "1"], "--pp-microbatches 1 is fewer than the 2 stages"),
    (["--pp", "2", "--pp-microbatches", "3"], "--pp-microbatches 3 must divide each rank's batch"),
    (["--pp", "4", "--n-layers", "4", "--float8-reduce-scatter"], "more ranks than --tp x --pp"),
    (["--pp-microbatches", "2"], "--pp-microbatches splits each rank's batch for the pipeline's "
     "schedule: it would do nothing in this run; add --pp N or drop it"),
    (["--pp-schedule", "gpipe"], "add --pp N or drop it"),
    # context parallelism: the flags that do not compose with --cp yet, and its shapes
    (["--cp", "3"], "--cp 3 must divide the number of ranks (4)"),
    (["--cp", "4", "--seq-len", "62"], "--seq-len 62 must be a multiple of --cp 4: each cp rank"),
    (["--cp", "2", "--tp", "2", "--compile"], "--cp does not run with --compile in train.py"),
    (["--cp", "2", "--tp", "4"], "--cp x --tp (8) must divide the number of ranks (4)"),
    (["--cp", "2", "--tp", "2", "--seq-len", "66"], "--seq-len 66 must be a multiple of --cp x --tp (4)"),
    (["--cp", "2", "--pp", "2"], "--cp does not run with --pp"),
    (["--cp", "2", "--moe-experts", "4"], "--cp does not run with --moe-experts"),
    (["--cp", "2", "--float8-stats-every", "1"], "--cp does not run with --float8-stats-every"),
    (["--cp", "2", "--batch-size", "3"], "--batch-size 3 must be a multiple of the 2 data-parallel"),
    # HSDP: a (dp_replicate, dp_shard, tp) mesh of the dense model
    (["--dp-replicate", "3"], "--dp-replicate 3 x --tp 1 must divide the number of ranks (4): "
     "FSDP2 shards over the 4 / (dp_replicate x tp) ranks left; change --dp-replicate"),
    (["--dp-replicate", "2", "--tp", "4"], "--dp-replicate 2 x --tp 4 must divide"),
    (["--dp-replicate", "2", "--pp", "2"], "--dp-replicate does not run with --pp in train.py yet"),
    (["--dp-replicate", "2", "--cp", "2"], "--dp-replicate does not run with --cp in train.py yet"),
    (["--dp-replicate", "2", "--moe-experts", "4"], "--dp-replicate does not run with --moe-experts"),
    (["--dp-replicate", "2", "--tp", "2", "--float8-reduce-scatter"],
     "--float8-reduce-scatter reduce-scatters gradients over the data-parallel ranks that shard "
     "them; with one, FSDP2 runs no reduce-scatter: it would do nothing in this run; add more "
     "ranks than --tp x --dp-replicate or drop it"),
    (["--dp-replicate", "4", "--float8-reduce-scatter"], "more ranks than --tp x --dp-replicate"),
    (["--dp-replicate", "2", "--batch-size", "2"], "--batch-size 2 must be a multiple of the 4 "
     "data-parallel ranks"),
])
def test_flags_that_do_not_fit_torchruns_ranks_fail_before_any_rank_starts(argv, match, capsys,
                                                                            monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        train.parse_args(argv)
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--cp", "2", "--batch-size", "2"],  # 2 data-parallel ranks of 2 cp ranks each
    ["--cp", "4", "--grad-accum-steps", "2", "--float8-reduce-scatter", "--float8", "delayed"],
    ["--cp", "2", "--tp", "2", "--ac", "sac", "--checkpoint-dir", "ckpt", "--resume"],
])
def test_cp_flags_that_run_parse_on_torchruns_ranks(argv, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert train.parse_args(argv).cp == int(argv[1])


@pytest.mark.parametrize("argv, shard", [
    (["--dp-replicate", "2", "--float8-reduce-scatter", "--float8-all-gather"], 2),
    (["--dp-replicate", "2", "--tp", "2", "--float8", "rowwise"], 1),  # replicas of a TP pair
    (["--dp-replicate", "4", "--grad-accum-steps", "2"], 1),  # DDP-like: FSDP2 only all-reduces
])
def test_hsdp_flags_that_run_parse_on_torchruns_ranks(argv, shard, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = train.parse_args(argv)
    assert 4 // (args.dp_replicate * args.tp) == shard


def _train_on_threads(world, *flags, monkeypatch):
    """train.py's losses of ``flags`` on ``world`` simulated ranks in this process
    (tests/sim/threads.py)."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    args = train.parse_args([*CP_TINY.split(), *map(str, flags)])
    monkeypatch.delenv("WORLD_SIZE")
    return run_threads(world, lambda rank: train.train(args))[0]["losses"]


CP_TINY = ("--dim 32 --n-layers 1 --n-heads 4 --seq-len 16 --batch-size 2 --warmup-steps 0 "
           "--log-every 100 --cp 2")


def test_stochastic_rounding_streams_follow_the_data_parallel_coordinate():
    # [Note: the stochastic rounding key]: a stream per data-parallel replica, shared by the
    # ranks that shard one tensor (tp, cp, ep), whatever the axes' order
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {("dp", "tp"): (2, 2), ("dp_shard", "ep"): (2, 2), ("dp", "cp"): (2, 2),
              ("pp", "dp"): (2, 2), ("dp_replicate", "dp_shard", "tp"): (2, 2, 1)}
    streams = run_threads(4, lambda rank: {
        names: train.sr_stream_of(init_device_mesh("cpu", shape, mesh_dim_names=names))
        for names, shape in meshes.items()})
    assert {names: [s[names] for s in streams] for names in meshes} == {
        ("dp", "tp"): [0, 0, 1, 1], ("dp_shard", "ep"): [0, 0, 1, 1], ("dp", "cp"): [0, 0, 1, 1],
        ("pp", "dp"): [0, 1, 0, 1], ("dp_replicate", "dp_shard", "tp"): [0, 1, 2, 3]}


def test_train_cp_with_tp_matches_cp_alone(monkeypatch):
    """``--cp 2 --tp 2`` on 4 simulated ranks trains as ``--cp 2`` on 2 (the same K/V casts,
    [Note: context parallelism with tensor parallelism]): fp32, high-precision linears, so tp's
    partial sums differ in summation order only."""
    flags = ("--steps", 3, "--float8", "none", "--dtype", "float32")
    alone = _train_on_threads(2, *flags, monkeypatch=monkeypatch)
    with_tp = _train_on_threads(4, *flags, "--tp", 2, monkeypatch=monkeypatch)
    assert with_tp == pytest.approx(alone, rel=1e-6) and len(alone) == 3, (with_tp, alone)


def test_train_cp_resumes_bit_for_bit_with_activation_checkpointing(tmp_path, monkeypatch):
    """A ``--cp 2`` checkpoint of step 2 (DCP, FSDP2 over dp x cp) resumed under ``--ac full``
    gives the unbroken run's losses bit for bit: the resume restores everything, and the
    recomputed attention gathers the same K and V again."""
    flags = ("--steps", 4, "--float8", "tensorwise", "--checkpoint-dir", tmp_path)
    unbroken = _train_on_threads(2, *flags, "--checkpoint-every", 2, monkeypatch=monkeypatch)
    shutil.rmtree(tmp_path / "step-4")
    resumed = _train_on_threads(2, *flags, "--resume", "--ac", "full", monkeypatch=monkeypatch)
    assert resumed == unbroken[2:] and len(unbroken) == 4, (resumed, unbroken)


def test_nvfp4_resumes_its_stochastic_rounding_bit_for_bit(tmp_path, monkeypatch):
    """[Note: stochastic rounding in checkpoints]: a resumed nvfp4 run draws on as the unbroken one
    (its gradients' stochastic rounding keyed on each site's count of casts), so its losses are the
    unbroken run's bit for bit."""
    flags = ("--steps", 4, "--float8", "nvfp4", "--checkpoint-dir", tmp_path, "--cp", 1,
             "--n-heads", 2, "--batch-size", 2, "--n-layers", 3)  # 2 nvfp4 blocks, 1 kept
    unbroken = _train_on_threads(1, *flags, "--checkpoint-every", 2, monkeypatch=monkeypatch)
    shutil.rmtree(tmp_path / "step-4")
    resumed = _train_on_threads(1, *flags, "--resume", monkeypatch=monkeypatch)
    assert resumed == unbroken[2:] and len(unbroken) == 4, (resumed, unbroken)


@pytest.mark.parametrize("argv", [
    ["--moe-experts", "4", "--tp", "2"],  # [Note: MoE under tensor parallelism]
    ["--moe-experts", "4", "--ep", "2", "--ac", "sac"],  # [Note: SAC around a nested FSDP2 unit]
])
def test_moe_flags_that_run_parse_on_torchruns_ranks(argv, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert train.parse_args(argv).moe_experts == 4


def test_ep_float8_flags_reach_the_expert_parallel_style(monkeypatch):
    """--float8-ep-combine and --float8-ep-backward are Float8ExpertParallel's float8_combine and
    float8_backward."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = train.parse_args(["--moe-experts", "4", "--ep", "2", "--float8-ep-combine",
                             "--float8-ep-backward"])
    seen = {}

    def parallelize_moe(model, ep_mesh, **options):
        seen.update(options)
        raise StopIteration  # the rest needs a process group

    monkeypatch.setattr(train, "parallelize_moe", parallelize_moe)
    with pytest.raises(StopIteration):
        train.build_model(args, {"ep": None}, torch.device("cpu"))
    assert seen == {"float8_combine": True, "float8_backward": True}


@pytest.mark.parametrize("argv, microbatches", [
    (["--pp", "2"], 2),  # as many as stages, the fewest 1F1B takes
    (["--pp", "2", "--pp-schedule", "gpipe", "--pp-microbatches", "1"], 1),
    (["--pp", "2", "--float8-reduce-scatter", "--ac", "sac", "--float8", "delayed"], 2),
])
def test_pp_flags_that_run_parse_on_torchruns_ranks(argv, microbatches, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert train.parse_args(argv).pp_microbatches == microbatches


@pytest.mark.parametrize("argv", [
    ["--float8", "blockwise", "--pad-inner-dim"],
    ["--float8", "blockwise", "--dim", "128", "--ffn-dim-multiplier", "1.5"],
    ["--float8", "mxfp8", "--dim", "96", "--n-heads", "3"],
])
def test_the_flags_a_float8_refusal_names_fit(argv):
    assert train.parse_args(argv).float8 == argv[1]


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: ") and "One flat loop, nanoGPT-style." in text  # the layout kept
    options = re.split(r"\n  (?=-)", text.split("\noptions:\n", 1)[1])
    assert len(options) > 30
    lacking = [o.split()[0] for o in options if "(default: " not in " ".join(o.split())]
    assert lacking == ["-h,"], lacking  # every flag's default (there were none)
    assert "--steps STEPS " in text and "(default: 60)" in text


def test_only_rank0_prints_a_flag_error(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit):
        train.parse_args(["--steps", "0"])
    assert capsys.readouterr().err == ""


def test_resume_takes_the_newest_complete_checkpoint(tmp_path):
    # step-10 is complete; step-20 has no .metadata (a save killed before train.py saved
    # atomically); step-30.partial is a killed atomic save
    for name, complete in (("step-10", True), ("step-20", False), ("step-30.partial", False)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_bytes(b"shard")
        if complete:
            (tmp_path / name / ".metadata").write_bytes(b"meta")
            train.write_checksums(str(tmp_path / name))
    assert train.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step-10")
    assert train.latest_checkpoint(str(tmp_path / "missing")) is None


def test_float8_config_follows_the_flag():
    assert train.float8_config(train.parse_args(["--float8", "none"])) is None
    config = train.float8_config(train.parse_args(["--float8", "rowwise"]))
    assert config.round_scales_to_power_of_2  # the rowwise recipe, not the default table


def test_loss_table_compares_each_recipe_with_bf16():
    curves = {"none": [5.0, 2.0, 2.0], "tensorwise": [5.0, 2.2, 2.0]}
    table = compare_loss.loss_table(curves, tail=2, title="t")
    assert "| bf16 | 2.0000 |  |" in table
    assert "| tensorwise | 2.1000 | +5.00% |" in table


def test_loss_table_compares_8bit_states_with_fp32_states():
    curves = {"none/fp32": [5.0, 2.0, 2.0], "none/8bit": [5.0, 2.0, 2.02],
              "tensorwise/fp32": [5.0, 2.2, 2.0], "tensorwise/8bit": [5.0, 2.2, 2.1]}
    table = compare_loss.loss_table(curves, tail=2, title="t")
    assert "| bf16, fp32 states | 2.0000 |  |  |" in table
    assert "| bf16, 8bit states | 2.0100 | +0.50% | +0.50% |" in table
    assert "| tensorwise, 8bit states | 2.1500 | +7.50% | +2.38% |" in table


def test_loss_table_versus_adds_each_runs_gap_to_that_run():
    curves = {"none": [5.0, 2.0, 2.0], "mxfp8": [5.0, 2.0, 2.02], "nvfp4": [5.0, 2.1, 2.1]}
    table = compare_loss.loss_table(curves, tail=2, title="t", versus="mxfp8")
    assert "| recipe | final loss (mean of last 2 steps) | vs bf16 | vs mxfp8 |\n|---|---|---|---|\n" in table
    assert "| bf16 | 2.0000 |  | -0.50% |" in table
    assert "| mxfp8 | 2.0100 | +0.50% |  |" in table
    assert "| nvfp4 | 2.1000 | +5.00% | +4.48% |" in table


def test_gap_table_gives_each_runs_loss_and_gaps_at_each_step():
    curves = {"none": [5.0, 4.0, 2.0, 2.0], "mxfp8": [5.0, 4.0, 2.0, 2.02],
              "nvfp4": [5.0, 4.4, 2.1, 2.1]}
    table = compare_loss.gap_table(curves, [1, 2, 3, 4], [2, 4], tail=2, versus="mxfp8")
    assert "in brackets vs bf16 / vs mxfp8" in table
    assert "| step | bf16 | mxfp8 | nvfp4 |\n|---|---|---|---|\n" in table
    assert "| 2 | 4.5000 | 4.5000 (+0.00%) | 4.7000 (+4.44% / +4.44%) |" in table  # steps 1-2
    assert "| 4 | 2.0000 | 2.0100 (+0.50%) | 2.1000 (+5.00% / +4.48%) |" in table  # steps 3-4


@pytest.mark.parametrize("argv, match", [
    (["--recipes", "none,nvfp4", "--versus", "mxfp8"], "--versus mxfp8: one of --recipes"),
    (["--recipes", "none,nvfp4", "--steps", "40", "--gap-at", "20,41"],
     "--gap-at 20,41: steps from 1 to --steps 40"),
])
def test_compare_loss_refuses_a_versus_or_gap_step_it_cannot_show(argv, match, capsys):
    with pytest.raises(SystemExit):
        compare_loss.main(argv)
    assert match in capsys.readouterr().err


def test_optim_states_flag_picks_the_optimizer():
    import torch

    from f8dist.optim import AdamW

    model = torch.nn.Linear(4, 4)
    assert type(train.build_optimizer(model, train.parse_args([]))) is torch.optim.AdamW
    eight = train.build_optimizer(model, train.parse_args(["--optim-states", "8bit"]))
    assert isinstance(eight, AdamW) and eight.defaults["betas"] == (0.9, 0.95)


def test_float8_activations_flag_sets_the_config_field():
    args = train.parse_args(["--float8", "rowwise", "--float8-activations-for-backward"])
    assert train.float8_config(args).float8_activations_for_backward
    off = train.float8_config(train.parse_args(["--float8", "rowwise"]))
    assert not off.float8_activations_for_backward
    rc = train.float8_config(train.parse_args(
        ["--float8", "rowwise", "--float8-activations-for-backward", "--recompute-swiglu-product"]))
    assert rc.recompute_swiglu_product and not off.recompute_swiglu_product
    n = train.float8_config(train.parse_args(["--float8", "rowwise", "--recompute-norm-output"]))
    assert n.recompute_norm_output and not off.recompute_norm_output
    assert off.sp_grad_weight == "forward_gather"


def test_sp_grad_weight_flag_sets_the_config_field_under_tp(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    sp = train.float8_config(train.parse_args(
        ["--float8", "mxfp8", "--tp", "2", "--dim", "256", "--sp-grad-weight", "recast"]))
    assert sp.sp_grad_weight == "recast"


def test_memory_line_splits_params_grads_optimizer_and_activations():
    """[Note: the memory line]: parameters, gradients and optimizer state counted from the
    tensors themselves; activations from what autograd saves (the CPU's count)."""
    import torch

    from f8dist.models import ModelArgs, Transformer
    from f8dist.testing import saved_tensor_bytes

    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, max_seq_len=16)
    model = Transformer(args)
    n, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    tokens = torch.randint(0, 256, (2, 16))
    for states in ("fp32", "8bit"):
        optimizer = train.build_optimizer(model, train.parse_args(["--optim-states", states]))
        model(tokens).float().sum().backward()
        optimizer.step()
        split = train.memory_split(model, optimizer)
        assert split["params"] == 4 * n + model.rope.numel() * 4
        assert split["grads"] == 4 * n
        if states == "fp32":  # two fp32 moments per parameter, a float32 step per tensor
            assert split["optim"] == 8 * n + 4 * tensors
        else:  # 2.1875 bytes per element of whole blocks of 64 (3 float32 per block)
            assert 2.1875 * n < split["optim"] <= 2.1875 * (n + 63 * tensors) + 4 * tensors
        model.zero_grad(set_to_none=True)

    block, x = model.layers["0"], torch.randn(2, 16, 32)
    with train.kept_for_backward(torch.device("cpu"), model, split):  # its params and buffers out
        block(x.clone().requires_grad_(), model.rope)
    assert split["act"] == saved_tensor_bytes(block, x, model.rope) > 0
    line = train.memory_text(torch.device("cpu"), split)
    assert line.startswith("memory: ")
    assert "GiB (params 0.1MiB grads 0.1MiB optim 0.1MiB act " in line, line


def test_directories_that_do_not_exist_yet_are_fine_where_they_can_be_made(tmp_path):
    args = train.parse_args(["--checkpoint-dir", str(tmp_path / "a" / "b"),
                             "--metrics-file", str(tmp_path / "c" / "m.json"), "--max-norm", "inf"])
    assert args.max_norm == float("inf") and not (tmp_path / "a").exists()  # nothing made yet


def test_tps_leaves_out_the_first_step():
    # a first step of 100 s (compiling), then 1 s per step of 10 tokens: 10 tokens/s at step 10
    # (it was 90 tokens / 109 s, the compile counted in)
    rate = train.Throughput(now=1.0)
    for step in range(1, 11):
        rate.step(10, now=101.0 + step - 1)
    assert rate.tps(now=110.0) == 10.0
    rate.step(10, now=111.0)
    assert rate.tps(now=111.0) == 10.0
    only = train.Throughput(now=1.0)  # a line at the first step has nothing else to count
    only.step(10, now=101.0)
    assert only.tps(now=101.0) == 0.1


def test_eta_leaves_out_the_first_step():
    # a first step of 100 s (compiling), then 1 s per step: 9 steps left take 9 s, not 91 * 9 / 10
    assert train.eta_seconds(now=110.0, first_step_end=101.0, done=10, left=9, start=1.0) == 9.0
    assert train.eta_seconds(now=101.0, first_step_end=101.0, done=1, left=9, start=1.0) == 900.0


def test_float8_linears_line_folds_the_blocks():
    from f8dist import Float8LinearConfig, convert_to_float8_training
    from f8dist.models import ModelArgs, Transformer

    model = Transformer(ModelArgs(dim=32, n_layers=3, n_heads=4, vocab_size=256, max_seq_len=16))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                               module_filter_fn=lambda m, fqn: fqn not in ("output", "layers.1.attention.wo"))
    text = train.float8_linears_text(model, "rowwise")
    assert text.startswith("float8 linears (rowwise): 20 of 22: layers.*.attention.wq, "), text
    assert "layers.{0,2}.attention.wo, layers.*.feed_forward.w1" in text, text
    assert text.endswith("| high precision: 2: layers.{1}.attention.wo, output"), text


def test_nvfp4_keeps_the_last_block_in_high_precision():
    # [Note: a high-precision tail] in f8dist/policy/filters.py: 3 blocks, ceil(0.45) = 1 kept
    from f8dist import Float8LinearConfig
    from f8dist.models import ModelArgs, Transformer

    model = Transformer(ModelArgs(dim=32, n_layers=3, n_heads=4, vocab_size=256, max_seq_len=16))
    train.convert_float8(model, Float8LinearConfig.from_recipe_name("nvfp4"), "nvfp4")
    text = train.float8_linears_text(model, "nvfp4")
    assert text.startswith("float8 linears (nvfp4): 14 of 22: layers.{0,1}.attention.wq"), text
    assert text.endswith("| high precision: 8: layers.{2}.attention.wq, layers.{2}.attention.wk, "
                         "layers.{2}.attention.wv, layers.{2}.attention.wo, "
                         "layers.{2}.feed_forward.w1, layers.{2}.feed_forward.w2, "
                         "layers.{2}.feed_forward.w3, output"), text


def test_nvfp4_keeps_the_last_blocks_experts_in_high_precision_too():
    # the tail is whole blocks: a kept block's grouped experts stay high precision with its linears
    from f8dist import Float8LinearConfig
    from f8dist.models import ModelArgs
    from f8dist.models.moe import MoEArgs, MoETransformer
    from f8dist.nn.grouped import Float8GroupedExperts

    model = MoETransformer(ModelArgs(dim=32, n_layers=3, n_heads=4, vocab_size=256, max_seq_len=16),
                           MoEArgs(num_experts=4, top_k=2))
    train.convert_float8(model, Float8LinearConfig.from_recipe_name("nvfp4"), "nvfp4")
    converted = [name for name, layer in model.layers.named_children()
                 if any(isinstance(m, Float8GroupedExperts) for m in layer.modules())]
    assert converted == ["0", "1"], converted


def test_float8_linears_line_names_the_grouped_experts():
    from f8dist import Float8LinearConfig, convert_to_float8_training
    from f8dist.models import ModelArgs
    from f8dist.models.moe import MoEArgs, MoETransformer

    model = MoETransformer(ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=16),
                           MoEArgs(num_experts=4, top_k=2))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                               module_filter_fn=lambda m, fqn: fqn not in ("output", "layers.1.moe.experts"))
    text = train.float8_linears_text(model, "tensorwise")
    # the routed experts were not in the line (it listed only the shared expert's linears)
    assert text.endswith("| high precision: 1: output || float8 grouped experts: 1 of 2: "
                         "layers.{0}.moe.experts | high precision: 1: layers.{1}.moe.experts"), text


def test_recipe_names_have_one_list_that_train_reads_without_torch():
    """train_flags.py reads Float8LinearRecipeName from f8dist/config/recipe_names.py as a file (before
    torch); it is the enum f8dist.config and f8dist.config.recipes give, not a copy of it."""
    import f8dist.config.recipe_names
    from f8dist.config import Float8LinearRecipeName

    assert Float8LinearRecipeName is f8dist.config.recipe_names.Float8LinearRecipeName
    assert train_flags.RECIPES == train.RECIPES == ("none", *(r.value for r in Float8LinearRecipeName))


def test_a_new_recipe_is_picked_up_with_what_its_config_allows(monkeypatch):
    """The recipe lists come from Float8LinearRecipeName and each recipe's config: a recipe
    added there is a --float8 choice, a block recipe if its casts are, a --float8-all-gather
    one if its config takes enable_fsdp_float8_all_gather."""
    import importlib
    from f8dist.config import Float8LinearConfig

    names = train_flags.RECIPES
    from_name = Float8LinearConfig.from_recipe_name
    monkeypatch.setattr(train_flags, "RECIPES", (*names, "new"))
    monkeypatch.setattr(Float8LinearConfig, "from_recipe_name", staticmethod(
        lambda r: from_name("mxfp8_square_weights" if str(getattr(r, "value", r)) == "new" else r)))
    try:
        new = importlib.reload(train)
        assert new.RECIPES == (*names, "new")
        assert "new" in new.BLOCK_RECIPES and "new" in new.FLOAT8_ALL_GATHER
        assert new.parse_args(["--float8", "new"]).float8 == "new"
    finally:
        monkeypatch.undo()
        importlib.reload(train)
    assert train.RECIPES == names
    assert train.BLOCK_RECIPES == ("mxfp8", "mxfp8_wgrad_with_hp", "mxfp8_square_weights",
                                   "blockwise", "nvfp4", "nvfp4_no_rht")
    assert train.FLOAT8_ALL_GATHER == ("tensorwise", "delayed", "mxfp8_square_weights",
                                       "blockwise", "nvfp4", "nvfp4_no_rht")
