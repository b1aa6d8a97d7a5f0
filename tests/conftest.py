"""Test-session settings.

``F8DIST_TEST_DEVICE=cuda`` runs the single-process tests with that device as torch's default
device (``torch.set_default_device``), so every tensor and module a test makes without naming a
device lives on the GPU and every float8 gemm is CUDA's ``torch._scaled_mm``: this is how
``scripts/gpu_check.sh`` runs the suite on a GPU. Tests that name ``"cpu"`` stay on the CPU, and the
multi-process tests (torchrun, gloo) run where their scripts put them. Unset, nothing changes.
"""

import os

import torch

TEST_DEVICE = os.environ.get("F8DIST_TEST_DEVICE", "")


def pytest_configure(config):
    if TEST_DEVICE:
        torch.set_default_device(TEST_DEVICE)


def pytest_report_header(config):
    if TEST_DEVICE:
        name = torch.cuda.get_device_name() if TEST_DEVICE.startswith("cuda") else TEST_DEVICE
        return f"f8dist: default device {TEST_DEVICE} ({name}), torch {torch.__version__}"
    return None


def pytest_collection_modifyitems(config, items):
    # torchrun programs run together only with those of the tests selected ([Note: one launch,
    # several programs] in tests/distributed/harness.py)
    from tests.distributed import harness

    harness.SELECTED_MODULES = {item.module.__name__ for item in items if getattr(item, "module", None)}


def pytest_terminal_summary(terminalreporter):
    # what the run cost in processes (docs/tests.md): each torchrun launch, by program and ranks
    from tests.distributed import harness

    if harness.LAUNCHES:
        launched = ", ".join(f"{program} on {n}" for program, n in harness.LAUNCHES)
        terminalreporter.write_line(f"torchrun launches: {len(harness.LAUNCHES)} ({launched})")
