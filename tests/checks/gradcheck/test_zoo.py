"""The model zoo (``bench/zoo.py``) as tests: every model's gradcheck must not crash, must
not fail, and must give exactly the causes the zoo declares for it (world size 2, CPU
virtual devices). A few cheap torch-only models run by default; the rest, torchvision
models included, are marked slow (``pytest -m slow``; the whole zoo takes minutes here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT

ZOO_PATH = ROOT / "bench" / "zoo.py"


def _load_zoo() -> Any:
    """``bench/zoo.py`` by its path (it is no package); once per process."""
    name = "zoo"
    module = sys.modules.get(name)
    if module is None or Path(getattr(module, "__file__", "")).resolve() != ZOO_PATH:
        spec = importlib.util.spec_from_file_location(name, ZOO_PATH)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


zoo = _load_zoo()

#: Cheap (well under a second each here) and covering the zoo's kinds: dropout in modules
#: and in an RNN, tied weights, unused parameters, a ModelOutput, random draws in forward.
CHEAP = (
    "transformer_lm",
    "lstm_classifier",
    "tied_lm",
    "conditionally_unused",
    "hf_style_output",
    "random_masking",
)

CASES = {case.name: case for case in zoo.cases()}


def test_cheap_cases_exist() -> None:
    assert set(CHEAP) <= set(CASES)


@pytest.mark.parametrize(
    "name", [name if name in CHEAP else pytest.param(name, marks=pytest.mark.slow) for name in CASES]
)
def test_zoo_model(name: str) -> None:
    case = CASES[name]
    row = zoo.run_case(case, world_size=2)
    assert row.verdict != "crash", row.causes
    assert row.verdict != "fail", row.causes
    assert set(row.causes) == set(case.expected), row.expected_text()
    assert row.verdict == ("pass" if not case.expected else "explained")
