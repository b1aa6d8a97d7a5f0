"""Launch a torchrun program from pytest; a failing rank or a timeout fails the test.

Programs live next to this file (``tests/distributed/<program>.py``, not named ``test_*``) and use
:mod:`tests.distributed.common` to set up the process group and report results. The pytest
wrappers (``tests/distributed/test_<scenario>.py``) call :func:`run_torchrun`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from scripts.teardown import one_gpu_per_rank

REPO_ROOT = Path(__file__).resolve().parents[2]
PROGRAM_DIR = Path(__file__).resolve().parent
ERROR_DIR_ENV = "F8DIST_TEST_ERROR_DIR"
_TAIL = 6000


def run_torchrun(program: str, nproc: int, *args, timeout: float = 180) -> Optional[dict]:
    """Run ``tests/distributed/<program>.py args...`` on ``nproc`` local ranks with torchrun.

    Returns the JSON object the program wrote with ``common.write_result`` (``None`` if it wrote
    none). The program receives the result path as ``--result <path>``. A rank that raises fails
    the test with that rank's traceback; a run past ``timeout`` seconds is killed (torchrun and
    every process below it) and fails the test.
    """
    script = PROGRAM_DIR / f"{program}.py"
    if not script.exists():
        raise FileNotFoundError(f"no torchrun program {script}")
    with tempfile.TemporaryDirectory(prefix=f"f8dist_{program}_") as tmp:
        result_path = Path(tmp) / "result.json"
        error_dir = Path(tmp) / "errors"
        error_dir.mkdir()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["OMP_NUM_THREADS"] = "1"
        env[ERROR_DIR_ENV] = str(error_dir)
        if not one_gpu_per_rank(nproc):  # gloo on the CPU: no rank may take a GPU (fully_shard)
            env["CUDA_VISIBLE_DEVICES"] = ""
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", str(script), *map(str, args), "--result", str(result_path),
        ]
        log_path = Path(tmp) / "output.log"
        with open(log_path, "wb") as log:
            # stdout to a file, not a pipe: a stray worker holding a pipe open cannot stall us
            proc = subprocess.Popen(
                cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so a timeout reaches every rank
            )
            try:
                proc.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                _kill_tree(proc)
                timed_out = True
        output = log_path.read_bytes()
        if timed_out:
            pytest.fail(
                f"{program} on {nproc} ranks ran past {timeout}s and was killed\n"
                f"{_rank_errors(error_dir)}--- output tail ---\n{_tail(output)}",
                pytrace=False,
            )
        if proc.returncode != 0:
            pytest.fail(
                f"{program} on {nproc} ranks failed (exit {proc.returncode})\n"
                f"{_rank_errors(error_dir)}--- output tail ---\n{_tail(output)}",
                pytrace=False,
            )
        if result_path.exists():
            return json.loads(result_path.read_text())
        return None


def _descendants(pid: int) -> List[int]:
    """Every process below ``pid`` (torchrun may start its workers in their own sessions)."""
    children: Dict[int, List[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun, its process group and every descendant, then reap torchrun."""
    victims = _descendants(proc.pid)
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL),
                 *[(lambda p=p: os.kill(p, signal.SIGKILL)) for p in victims]):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def _tail(output: bytes) -> str:
    text = output.decode(errors="replace")
    return text[-_TAIL:]


def _rank_errors(error_dir: Path) -> str:
    parts = []
    for path in sorted(error_dir.glob("rank*.txt")):
        parts.append(f"--- {path.stem} traceback ---\n{path.read_text()}")
    return "\n".join(parts) + ("\n" if parts else "")
