"""pytest's hooks and fixtures for every test folder: the ``gpu`` / ``multi_gpu`` marks (skipped
with a reason where no CUDA GPU is, run last) and the ``no_gpu`` fixture. What tests import
(paths, ``codes()``, the CLI runner, the small models) is in ``tests/helpers``."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import settings

from tests.helpers import NVML

#: The one place property tests choose their examples. ``make test`` runs the ``suite`` profile:
#: derandomised (the examples follow from each test's source, the same on every run and every
#: machine) and with no example database, so a fresh clone passes or fails as its last run
#: did. ``make fuzz`` runs the ``fuzz`` profile: new examples from a seed it prints
#: (``--hypothesis-seed``), for as long as asked. ``FUZZ_EXAMPLES`` sets how many per test.
settings.register_profile("suite", derandomize=True, database=None, print_blob=True)
settings.register_profile("fuzz", derandomize=False, database=None, print_blob=True)
settings.load_profile(os.environ.get("GPUDIAG_HYPOTHESIS_PROFILE", "suite"))


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process sees no CUDA GPU and no NVIDIA driver, whatever the machine has: torch
    reports CUDA unavailable (so ``nn.DataParallel`` is a pass-through) and NVML is the
    fake scenario without a driver. (CUDA_VISIBLE_DEVICES is left alone: set here it
    could hide the GPUs from this process for good, from the ``gpu`` tests too.)"""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("GPUDIAG_NVML_SCENARIO", str(NVML / "no_driver.json"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu``/``multi_gpu`` tests with a reason where no CUDA GPU is present, and run
    them after the others: a test that creates a CUDA context in this process makes every
    later rank launch start a fresh interpreter (fork is unsafe after it), so the unmarked
    tests run as they do on a machine without a GPU."""
    marked = [item for item in items if "gpu" in item.keywords or "multi_gpu" in item.keywords]
    if not marked:
        return
    items[:] = [item for item in items if item not in marked] + marked
    count = _cuda_device_count()
    for item in marked:
        if "multi_gpu" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA GPUs, found {count}"))
        elif "gpu" in item.keywords and count < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU, found none"))


#: The unmarked test that first created a CUDA context in this process (a GPU machine).
_CUDA_FIRST: list[str] = []


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    before = _cuda_initialised()
    yield
    unmarked = "gpu" not in item.keywords and "multi_gpu" not in item.keywords
    if unmarked and not before and _cuda_initialised():
        _CUDA_FIRST.append(item.nodeid)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Names the unmarked test that created a CUDA context (so later launches started
    fresh interpreters): it should arrange "no GPU" or carry the ``gpu`` mark."""
    for nodeid in _CUDA_FIRST:
        terminalreporter.write_line(f"CUDA first initialised in this process by an unmarked test: {nodeid}")


def _cuda_device_count() -> int:
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return 0
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
