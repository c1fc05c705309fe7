"""The user's model cannot take gpudiag down silently: ``sys.exit``, ``os._exit``,
exceptions, running out of memory or disk, and hangs — in gpudiag's own process or in a
rank — become an error naming where (exit 2 for the model's own doing, 3 for resources)
or a finding, within the ``--timeout`` deadline."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import SEED_MACHINE, invoke, within

MODEL = textwrap.dedent(
    """
    import errno, os, sys, time
    import torch
    from torch import nn

    calls = [0]

    class Model(nn.Module):
        def __init__(self, what, where, after):
            super().__init__()
            self.what, self.where, self.after = what, where, after
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            calls[0] += 1
            in_rank = torch.distributed.is_available() and torch.distributed.is_initialized()
            if calls[0] > self.after and (self.where == "rank") == in_rank:
                if self.what == "sys.exit":
                    sys.exit(3)
                if self.what == "os._exit":
                    os._exit(7)
                if self.what == "raise":
                    raise ValueError("the model's own bug")
                if self.what == "oom":
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
                if self.what == "enospc":
                    raise OSError(errno.ENOSPC, "No space left on device", "/scratch/cache.bin")
                if self.what == "hang":
                    time.sleep(600)
            return self.fc(x)

    def make(what, where="here", after=0):
        return Model(what, where, int(after))

    def exits_while_built():
        sys.exit(4)
    """
)


@pytest.fixture
def model_file(tmp_path: Path) -> str:
    path = tmp_path / "user_model.py"
    path.write_text(MODEL)
    return str(path)


def gradcheck(spec: str, *extra: str) -> tuple[int, str, float]:
    args = ["gradcheck", "--model", spec, "--input-shape", "4", "--num-classes", "3", *extra]
    start = time.monotonic()
    result = invoke(args)
    assert "Traceback" not in result.output and "internal error" not in result.output, result.output
    return result.exit_code, result.output, time.monotonic() - start


@pytest.mark.parametrize(
    ("what", "code", "words"),
    [
        ("sys.exit", 2, "called sys.exit(3)"),
        ("os._exit", 2, "called os._exit(7)"),
        ("raise", 2, "raised ValueError: the model's own bug"),
        ("oom", 3, "ran out of memory"),
        ("enospc", 3, "no space left on device writing /scratch/cache.bin"),
    ],
)
def test_the_models_doing_in_this_process_is_an_error_naming_where(
    model_file: str, what: str, code: int, words: str
) -> None:
    # after=1: the train-mode probe's forward passes, the single-device reference fails
    exit_code, output, _ = gradcheck(f"{model_file}:make?what='{what}'&after=1", "--strategies", "single,dp")
    assert exit_code == code and words in output, output
    assert "the model under single" in output


def test_a_factory_that_exits_is_an_error(model_file: str) -> None:
    exit_code, output, _ = gradcheck(f"{model_file}:exits_while_built")
    assert exit_code == 2 and "the model factory called sys.exit(4)" in output


@pytest.mark.parametrize(
    ("after", "phase"),
    [
        (1, "the train-mode probe (one forward of the model)"),  # (the per-rank usage probe's forward)
        (3, "the single run on device 0"),  # (after the probe's forward and its two shards')
    ],
)
def test_a_forward_that_hangs_here_is_stopped_at_the_deadline(
    model_file: str, after: int, phase: str
) -> None:
    """The per-rank usage probe swallowed the deadline's exception as the model's error and
    the next forward hung for good (609 s): the deadline is never the model's."""
    exit_code, output, seconds = gradcheck(f"{model_file}:make?what='hang'&after={after}", "--timeout", "1")
    assert exit_code == 1 and f"{phase} did not finish within 1 s (--timeout)" in output, output
    assert seconds < within(idle_s=6.0)  # (against a hang: 1.2 s idle, 9.9 s at load 7)


@pytest.mark.parametrize(
    ("what", "code", "words"),
    [("os._exit", "rank-crashed", "exited with code 7"), ("hang", "rank-hung", "gave no answer within 3 s")],
)
def test_the_models_doing_in_a_rank_is_a_finding_naming_the_rank(
    model_file: str, what: str, code: str, words: str
) -> None:
    exit_code, output, seconds = gradcheck(
        f"{model_file}:make?what='{what}'&where='rank'",
        "--strategies",
        "single,ddp",
        "--timeout",
        "3",
        "--format",
        "json",
    )
    assert exit_code == 1
    findings = json.loads(output)["findings"]
    assert [f["code"] for f in findings if f["severity"] == "error"] == [code]
    assert words in findings[0]["message"] and "rank" in findings[0]["message"]
    assert seconds < within(idle_s=6.0)  # (against a hang: 3.1 s idle and at load 7)


def test_nancheck_names_the_device_where_the_model_failed(model_file: str, tmp_path: Path) -> None:
    result = invoke(
        [
            "nancheck",
            "--model",
            f"{model_file}:make?what='raise'",
            "--input-shape",
            "4",
            "--num-classes",
            "3",
            "--machine",
            str(SEED_MACHINE),
        ],
    )
    assert result.exit_code == 2, result.output
    assert "the model under single on device 0 raised ValueError" in result.output


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("torchvision:resnet18?bogus=1", "the model factory raised TypeError"),
        ("torchvision:resnet18?weights='IMAGENET1K_V1'", "weights= would download trained weights"),
        ("torchvision:resnet18?pretrained=True", "pretrained= would download"),
        ("EMBEDDING", "raised RuntimeError"),  # token ids expected, floats given
    ],
)
def test_a_users_mistake_is_exit_2_naming_the_spec(spec: str, words: str, tmp_path: Path) -> None:
    if spec == "EMBEDDING":
        path = tmp_path / "tokens.py"
        path.write_text(
            "from torch import nn\n\n"
            "def make():\n"
            "    return nn.Sequential(nn.Embedding(100, 8), nn.Flatten(), nn.Linear(32, 3))\n"
        )
        spec = f"{path}:make"
    for command in (["gradcheck"], ["nancheck", "--machine", "seed_8gpu_topo.txt", "--pairs", "0-1"]):
        result = invoke([*command, "--model", spec, "--input-shape", "4", "--num-classes", "3"])
        assert result.exit_code == 2, result.output
        assert result.output.startswith(f"gpudiag: error: --model {spec!r}: ") and words in result.output
        assert "internal error" not in result.output and "Downloading" not in result.output


def test_a_child_forked_while_contained_leaves_normally() -> None:
    """A DataLoader worker or any multiprocessing child forked inside ``contained`` ends
    through the real ``os._exit`` (it used to raise ProcessExit there and die with 1)."""
    import multiprocessing
    import os

    from gpudiag.runtime.deadline import ProcessExit, contained

    with contained(30, "the test"):
        child = multiprocessing.get_context("fork").Process(target=print, args=("child",))
        child.start()
        child.join(10)
        with pytest.raises(ProcessExit):
            os._exit(3)
    assert child.exitcode == 0
