"""scripts/gpu_check.sh without CUDA: one line and a non-zero exit, before any part runs."""

import os
import subprocess
import sys

from tests.distributed.harness import REPO_ROOT


def test_without_cuda_it_refuses_in_one_line_before_any_part(tmp_path):
    # it ran every part: after the CUDA parts crashed it trained a compiled 270M-parameter model
    # on the CPU (minutes, 9 GB); CUDA_VISIBLE_DEVICES="" hides a GPU where there is one
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    out = subprocess.run(["bash", os.path.join(REPO_ROOT, "scripts", "gpu_check.sh"),
                          str(tmp_path / "out")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout == "", out.stdout[-2000:]
    assert out.stderr.startswith("gpu_check.sh: needs CUDA and torch "), out.stderr
    assert out.stderr.count("\n") == 1, out.stderr
    assert not (tmp_path / "out").exists()  # no part started
