"""torchrun program: scripts/train.py with a mixture-of-experts model (see
tests/distributed/test_train_moe.py): bf16 (with per-op selective activation checkpointing), float8
rowwise and delayed under expert parallelism, the
latter checkpointing; its last checkpoint removed, the one before resumes under FSDP2 alone."""

from __future__ import annotations

import os
import shlex
import shutil
import sys

import torch.distributed as dist

from tests.distributed.common import init, main, write_result

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts")
sys.path.insert(0, os.path.abspath(SCRIPTS))
import train  # noqa: E402


def _args(parser):
    parser.add_argument("--train", default="", help="flags of every run, one string")
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--every", type=int, required=True)


def run(args):
    init()
    common = shlex.split(args.train)
    ckpt = ["--checkpoint-dir", args.ckpt_dir]
    result = {
        "bf16": train.train(train.parse_args(common + ["--float8", "none", "--ep", "2",
                                                       "--ac", "sac"])),
        "rowwise": train.train(train.parse_args(
            common + ["--float8", "rowwise", "--ep", "2", "--checkpoint-every", str(args.every)]
            + ckpt)),
        # experts with amax histories ([Note: delayed experts] in f8dist/nn/grouped.py)
        "delayed": train.train(train.parse_args(common + ["--float8", "delayed", "--ep", "2"])),
    }
    last = max(os.listdir(args.ckpt_dir), key=lambda name: int(name.split("-")[1]))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(os.path.join(args.ckpt_dir, last))
    dist.barrier()
    result["resumed"] = train.train(train.parse_args(
        common + ["--float8", "rowwise", "--ep", "1", "--resume"] + ckpt))
    write_result(args, result)


if __name__ == "__main__":
    main(run, _args)
