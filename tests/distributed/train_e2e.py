"""torchrun program: scripts/train.py's loop end to end (see tests/distributed/test_train.py).

On whatever mesh ``--train "..."`` asks for, in one launch:

1. train bf16 (``--float8 none``) and float8 ``--recipe`` on the same data; the float8 run saves
   a checkpoint every ``--every`` steps;
2. delete its last checkpoint, as if the job had died after the one before;
3. train again with ``--resume``: a fresh model, loaded from that checkpoint.

Reports the three loss curves and compare_loss's markdown table of the first two.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys

import torch.distributed as dist

from tests.distributed.common import init, main, write_result

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts")
sys.path.insert(0, os.path.abspath(SCRIPTS))
import compare_loss  # noqa: E402
import train  # noqa: E402


def _args(parser):
    parser.add_argument("--train", default="", help="flags for scripts/train.py, one string")
    parser.add_argument("--recipe", default="tensorwise")
    parser.add_argument("--every", type=int, required=True)


def run(args):
    init()
    argv = shlex.split(args.train)
    ckpt = os.path.join(os.path.dirname(os.path.abspath(args.result)), "ckpt")
    checkpointing = ["--checkpoint-dir", ckpt, "--checkpoint-every", str(args.every)]

    bf16 = train.train(train.parse_args([*argv, "--float8", "none"]))
    fp8 = train.train(train.parse_args([*argv, "--float8", args.recipe, *checkpointing]))

    last = fp8["steps"][-1]
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(os.path.join(ckpt, f"step-{last}"))
    dist.barrier()
    resumed = train.train(train.parse_args([*argv, "--float8", args.recipe, "--checkpoint-dir",
                                            ckpt, "--resume"]))

    table = compare_loss.loss_table({"none": bf16["losses"], args.recipe: fp8["losses"]},
                                    tail=10, title=args.train)
    write_result(args, {"bf16": bf16, "float8": fp8, "resumed": resumed, "table": table})


if __name__ == "__main__":
    main(run, _args)
