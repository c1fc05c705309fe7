"""Generated inputs for any model from the CLI: ``--input-dtype`` and ``--input-range``
(token ids for an embedding model), on gradcheck, nancheck, report and doctor, carried in
the bundle so replay makes the same batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpudiag.models import random_inputs
from tests.helpers import invoke

TOKENS = """from torch import nn

def make():
    return nn.Sequential(nn.Embedding(100, 8), nn.Flatten(), nn.Linear(32, 3))
"""


@pytest.fixture
def token_model(tmp_path: Path) -> str:
    path = tmp_path / "tokens.py"
    path.write_text(TOKENS)
    return f"{path}:make"


def test_random_inputs_follow_dtype_and_range() -> None:
    ids = random_inputs(torch.Generator().manual_seed(0), 64, (5,), "long", (3, 7))
    assert ids.dtype == torch.int64 and ids.min() >= 3 and ids.max() < 7
    floats = random_inputs(torch.Generator().manual_seed(0), 64, (5,), "float", (-2.0, -1.0))
    assert floats.dtype == torch.float32 and floats.min() >= -2 and floats.max() < -1
    default = random_inputs(torch.Generator().manual_seed(0), 8, (3,))
    assert torch.equal(default, torch.randn(8, 3, generator=torch.Generator().manual_seed(0)))


def test_a_token_model_is_checked_from_the_cli(token_model: str) -> None:
    args = ["--model", token_model, "--input-shape", "4", "--num-classes", "3"]
    result = invoke(["gradcheck", *args, "--format", "json"])
    assert result.exit_code == 2 and "raised" in result.output  # floats into an embedding
    tokens = ["--input-dtype", "long", "--input-range", "0,100"]
    result = invoke(["gradcheck", *args, *tokens, "--format", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["config"]["input_dtype"] == "long"
    machine = ["--machine", "seed_8gpu_topo.txt", "--pairs", "0-1", "--steps", "2"]
    result = invoke(["nancheck", *args, *tokens, *machine])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--input-dtype", "long"], "needs --input-range"),
        (["--input-dtype", "long", "--input-range", "0,0.5"], "whole numbers"),
        (["--input-range", "5,1"], "LO < HI"),
        (["--input-range", "nope"], "expected LO,HI"),
    ],
)
def test_bad_input_options_are_exit_2(extra: list[str], words: str) -> None:
    for command in (["gradcheck", "--model", "mlp"], ["doctor", "--no-bundle", "--checks", "gradcheck"]):
        result = invoke([*command, *extra])
        assert result.exit_code == 2 and words in result.output, result.output


def test_report_carries_the_inputs_and_replay_makes_the_same_batch(token_model: str, tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    options = [
        "--input-shape",
        "4",
        "--input-dtype",
        "long",
        "--input-range",
        "0,100",
        "--checks",
        "gradcheck",
    ]
    result = invoke(["report", "--model", token_model, *options, "-o", str(bundle)])
    assert result.exit_code == 1  # 3 outputs, 10 classes by default: the model's own error
    config = json.loads((bundle / "report.json").read_text())["checks"][0]["config"]
    assert (
        config["input_dtype"] == "long" and config["input_range"] == [0, 100] and config["input_shape"] == [4]
    )
    replayed = invoke(["replay", str(bundle), "--trust-bundle", "--format", "json"])
    assert replayed.exit_code == 0, replayed.output


class TwoInputs(torch.nn.Module):
    """Takes token ids and a mask by keyword: no generated input fits it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pooled = (self.embed(ids) * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
        return self.head(pooled)


def two_inputs() -> torch.nn.Module:
    return TwoInputs()


def test_inputs_from_a_file_feed_any_model(tmp_path: Path) -> None:
    batch = tmp_path / "batch.pt"
    torch.save({"ids": torch.randint(0, 50, (6, 5)), "mask": torch.ones(6, 5)}, batch)
    result = invoke(
        [
            "gradcheck",
            "--model",
            "tests.cli.test_inputs:two_inputs",
            "--inputs",
            str(batch),
            "--num-classes",
            "3",
            "--strategies",
            "single,dp",
            "--format",
            "json",
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["verdict"] == "pass" and doc["config"]["inputs_file"] == str(batch)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"not a torch file", "not a file of tensors torch.save wrote"),
        ("ragged", "first (batch) dimensions differ"),
        ("scalar", "each with a batch dimension"),
        ("missing", "no such file"),
    ],
)
def test_a_bad_inputs_file_is_exit_2(content: object, words: str, tmp_path: Path) -> None:
    path = tmp_path / "batch.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content == "ragged":
        torch.save((torch.ones(4, 2), torch.ones(3, 2)), path)
    elif content == "scalar":
        torch.save(torch.tensor(1.0), path)
    result = invoke(["gradcheck", "--model", "mlp", "--inputs", str(path)])
    assert result.exit_code == 2 and words in result.output, result.output
