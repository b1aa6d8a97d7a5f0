"""torchrun program: scripts/train.py's loop end to end (see tests/distributed/test_train.py).

On whatever mesh ``--train "..."`` asks for, in one launch:

1. train bf16 (``--float8 none``) and float8 ``--recipe`` on the same data; the float8 run saves
   a checkpoint every ``--every`` steps into ``--ckpt-dir``, and its last save is killed after
   every rank wrote its shards but before DCP's ``.metadata`` (``killed_at_the_last_save``);
2. train again with ``--resume``: a fresh model, loaded from the newest complete checkpoint;
3. resume from ``--resume-from``, a checkpoint saved by a run on one rank;
4. with ``--fp32-states-too``: the float8 run again with ``--optim-states fp32`` (for runs whose
   flags ask for 8-bit states, to compare the two).

Reports the loss curves and compare_loss's markdown table of the first two.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import sys
from unittest import mock

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests.distributed.common import init, main, write_result

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts")
sys.path.insert(0, os.path.abspath(SCRIPTS))
import compare_loss  # noqa: E402
import train  # noqa: E402

# [Note: the kill is a RuntimeError] DCP pickles the coordinator's error to every rank: a class of
# this program's would not unpickle where the program runs as several.py's __main__ module, so the
# kill is a RuntimeError that says so
KILLED = "simulated kill: shards written, .metadata not yet"
DCP_SAVE = dcp.save  # the real one, while train.dcp.save is patched


class _DiesBeforeMetadata(dcp.FileSystemWriter):
    """A writer whose coordinator dies where DCP would write ``.metadata`` (its last file)."""

    def finish(self, metadata, results):
        raise RuntimeError(KILLED)


def killed_at_the_last_save(last_step: int):
    """scripts/train.py's save_checkpoint, except that the save of ``last_step`` stops where a
    kill would: what it wrote stays on disk, nothing after it runs, and training goes on as if a
    restarted job had recorded the losses (the resumed run is compared with them)."""
    real = train.save_checkpoint

    def save(path, model, optimizer, batches, step, args):
        if step != last_step:
            return real(path, model, optimizer, batches, step, args)

        def dying_save(state, checkpoint_id):
            DCP_SAVE(state, storage_writer=_DiesBeforeMetadata(checkpoint_id))

        with mock.patch.object(train.dcp, "save", dying_save):
            try:
                real(path, model, optimizer, batches, step, args)
            except CheckpointException as e:  # the coordinator's error, raised on every rank
                if not any(str(exc) == KILLED for exc, _ in e.failures.values()):
                    raise
            else:
                raise AssertionError("the simulated kill did not happen")

    return mock.patch.object(train, "save_checkpoint", save)


def _args(parser):
    parser.add_argument("--train", default="", help="flags for scripts/train.py, one string")
    parser.add_argument("--recipe", default="tensorwise")
    parser.add_argument("--every", type=int, required=True)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--resume-from", required=True,
                        help="a checkpoint directory saved by a run on another number of ranks")
    parser.add_argument("--fp32-states-too", action="store_true")


def run(args):
    init()
    argv = shlex.split(args.train)
    checkpointing = ["--checkpoint-dir", args.ckpt_dir, "--checkpoint-every", str(args.every)]

    bf16 = train.train(train.parse_args([*argv, "--float8", "none"]))
    fp8_args = train.parse_args([*argv, "--float8", args.recipe, *checkpointing])
    with killed_at_the_last_save(fp8_args.steps):
        fp8 = train.train(fp8_args)
    left = sorted(os.listdir(args.ckpt_dir))  # what the killed save left
    resumed = train.train(train.parse_args([*argv, "--float8", args.recipe, "--checkpoint-dir",
                                            args.ckpt_dir, "--resume"]))

    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        regrouped = train.train(train.parse_args([*argv, "--float8", args.recipe, "--checkpoint-dir",
                                                  args.resume_from, "--resume"]))

    fp32_states = None
    if args.fp32_states_too:
        fp32_states = train.train(train.parse_args([*argv, "--float8", args.recipe,
                                                    "--optim-states", "fp32"]))

    table = compare_loss.loss_table({"none": bf16["losses"], args.recipe: fp8["losses"]},
                                    tail=10, title=args.train)
    write_result(args, {"bf16": bf16, "float8": fp8, "resumed": resumed, "table": table,
                        "checkpoints_after_kill": left, "regrouped": regrouped,
                        "regrouped_log": log.getvalue(), "float8_fp32_states": fp32_states})


if __name__ == "__main__":
    main(run, _args)
