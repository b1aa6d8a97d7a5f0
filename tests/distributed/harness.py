"""Launch a torchrun program from pytest; a failing rank or a timeout fails the test.

Programs live next to this file (``tests/distributed/<program>.py``, not named ``test_*``) and use
:mod:`tests.distributed.common` to set up the process group and report results. The pytest
wrappers (``tests/distributed/test_<scenario>.py``) call :func:`run_torchrun`.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import pytest

from scripts.teardown import one_gpu_per_rank

REPO_ROOT = Path(__file__).resolve().parents[2]
PROGRAM_DIR = Path(__file__).resolve().parent
ERROR_DIR_ENV = "F8DIST_TEST_ERROR_DIR"
_TAIL = 6000
LAUNCHES: List[Tuple[str, int]] = []  # (program, ranks) of every launch, for the run's summary


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
    LAUNCHES.append((program, nproc))
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


# [Note: one launch, several programs]
# Starting torchrun and importing torch in every rank costs seconds per launch on a 2-core
# machine, more than many programs take to run. So a test module declares its programs with
# ``launch(...)`` at import, and the first test that asks for one (``result(launch)``) runs every
# declared program of the same world size, of the modules pytest selected, in ONE torchrun launch
# (tests/distributed/several.py): one after the other, on the same process group, each program's
# module run afresh as ``__main__``, each its own result. A program failing fails that launch's
# tests with the rank's traceback, which names the program. Programs that test the launch itself
# (the harness, a rank that never checks in agreement.py, train.py's own process) keep their own.


class Launch:
    """A program of tests/distributed/ on ``nproc`` ranks with ``args`` (``TMP``: a fresh folder)."""

    def __init__(self, program: str, nproc: int, args: tuple, timeout: float, module: str):
        self.program, self.nproc, self.args, self.timeout, self.module = program, nproc, args, timeout, module

    def __repr__(self) -> str:
        return f"{self.program} on {self.nproc} ranks {' '.join(map(str, self.args))}"


_DECLARED: List[Launch] = []
_RESULTS: Dict[int, object] = {}  # id(launch) -> its result, or the message its launch failed with
SELECTED_MODULES: Optional[Set[str]] = None  # set by tests/conftest.py once pytest has selected


def launch(program: str, nproc: int, *args, timeout: float = 180) -> Launch:
    """Declare ``run_torchrun(program, nproc, *args)`` for :func:`result`, at a test module's import."""
    declared = Launch(program, nproc, args, timeout, sys._getframe(1).f_globals["__name__"])
    _DECLARED.append(declared)
    return declared


def result(declared: Launch) -> Optional[dict]:
    """What ``declared``'s program wrote; runs it, with every other pending program of its world
    size in the selected modules, in one launch ([Note: one launch, several programs])."""
    if id(declared) not in _RESULTS:
        batch = [l for l in _DECLARED if l.nproc == declared.nproc and id(l) not in _RESULTS
                 and (l is declared or SELECTED_MODULES is None or l.module in SELECTED_MODULES)]
        with tempfile.TemporaryDirectory(prefix="f8dist_several_") as tmp:
            cases = []
            for i, l in enumerate(batch):
                args = [os.path.join(tmp, str(i)) if a == "TMP" else str(a) for a in l.args]
                cases.append(f"--case=c{i}={shlex.join([l.program, *args])}")
            try:
                out = run_torchrun("several", declared.nproc, *cases,
                                   timeout=sum(l.timeout for l in batch))
            except pytest.fail.Exception as e:
                for l in batch:
                    _RESULTS[id(l)] = e
                raise
        for i, l in enumerate(batch):
            _RESULTS[id(l)] = out[f"c{i}"]
    got = _RESULTS[id(declared)]
    if isinstance(got, pytest.fail.Exception):
        pytest.fail(f"{declared} ran in a launch that failed:\n{got}", pytrace=False)
    return got


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
