"""Everyday torchvision models through gradcheck, nancheck and the Python API on CPU
virtual devices, with ranks forked and in fresh interpreters. resnet50 always runs; the
other families are marked slow (``pytest -m slow``; about a minute each here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torchvision

import gpudiag
from tests.helpers import SEED_MACHINE, codes, invoke

MACHINE = SEED_MACHINE
SMALL = ["--input-shape", "3,32,32", "--batch-size", "4"]

#: Models that broke the launch with "too many fds" (more tensors than a forkserver sends).
FAMILIES = [
    "densenet121",
    "efficientnet_b0",  # (stochastic depth: controlled mode takes its expected value since issue 15)
    "googlenet?aux_logits=false&init_weights=true",  # (aux logits: a tuple output, issue 15)
    "shufflenet_v2_x1_0",
    "regnet_y_400mf",
    "mobilenet_v2",
    "resnext50_32x4d",
]


def run_json(*args: str) -> tuple[int, dict]:
    result = invoke([*args, "--format", "json"], catch_exceptions=False)
    assert result.stdout.startswith("{"), result.stdout + result.stderr
    return result.exit_code, json.loads(result.stdout)


def check_model(spec: str, monkeypatch: pytest.MonkeyPatch, start: str) -> None:
    """gradcheck: BatchNorm explains the as-is difference, the controlled rerun agrees;
    nancheck over DDP on a pair of virtual GPUs: no NaN."""
    monkeypatch.setenv("GPUDIAG_RANK_START", start)
    code, doc = run_json("gradcheck", "--model", spec, *SMALL)
    assert code == 0 and doc["verdict"] == "explained", codes(doc)
    assert "batchnorm-per-replica" in codes(doc)
    assert all(c["ok"] for c in doc["comparisons"] if c["mode"] == "controlled")
    assert set(doc["numerics"]) == {"single", "dp", "ddp rank 0", "ddp rank 1"}
    code, doc = run_json(
        "nancheck", "--model", spec, *SMALL, "--machine", str(MACHINE), "--pairs", "0-1", "--steps", "2",
        "--strategy", "ddp",
    )  # fmt: skip
    assert code == 0 and doc["verdict"] == "pass", codes(doc)


@pytest.mark.slow  # (20 s; fresh ranks with many tensors: core/runtime/test_rank_transport.py, by default)
def test_resnet50_from_a_file_in_fresh_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `file.py:factory` spec: the file's module is private to this process, so the
    model travels by value, 320 tensors in one job file."""
    (tmp_path / "net.py").write_text(
        "import torchvision\n\ndef factory():\n    return torchvision.models.resnet50(num_classes=10)\n"
    )
    check_model(f"{tmp_path / 'net.py'}:factory", monkeypatch, "subprocess")


def test_resnet50_by_name_with_forked_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    check_model("torchvision:resnet50?num_classes=10", monkeypatch, "auto")


@pytest.mark.slow  # (7 s; a closure in fresh ranks: core/runtime/test_rank_transport.py, by default)
def test_resnet50_through_the_python_api_with_a_lambda_in_fresh_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GPUDIAG_RANK_START", "subprocess")
    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    report = gpudiag.gradcheck(
        lambda: torchvision.models.resnet50(num_classes=10),
        x,
        y,
        strategies=("single", "ddp"),
        mode="controlled",
    )
    assert report.verdict == "pass", report.summary()


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_everyday_torchvision_families(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    separator = "&" if "?" in name else "?"
    check_model(f"torchvision:{name}{separator}num_classes=10", monkeypatch, "subprocess")
