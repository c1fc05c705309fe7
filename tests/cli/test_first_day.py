"""A new user's mistakes get a hint and exit 2, never an internal error (issue 47, item 5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpudiag.errors import InputError
from gpudiag.models import resolve_model
from tests.helpers import invoke

MODEL = "from torch import nn\n\n\ndef build():\n    return nn.Sequential(nn.Flatten(), nn.Linear(48, 10))\n"


@pytest.mark.parametrize(
    ("spec", "hint"),
    [
        (
            "..:build",
            "'..' is not a module name (package.module) nor a .py file; a file is path/to/file.py:build",
        ),
        (".x:build", "is not a module name"),
        ("resnet18", "did you mean torchvision:resnet18?"),
        ("resnt18", "did you mean torchvision:resnet18?"),
        ("mlpp", "did you mean mlp?"),
        ("mine.py", "a file needs its factory: mine.py:build"),
        ("nosuch_module_x:build", "cannot import module 'nosuch_module_x'"),
    ],
)
def test_a_bad_model_spec_is_exit_2_with_a_hint(spec: str, hint: str) -> None:
    """Issue 47: ``..:build`` was an internal error (exit 1); ``resnet18`` got no hint."""
    result = invoke(["gradcheck", "--model", spec, "--input-shape", "3,4,4"])
    assert result.exit_code == 2, result.output
    assert hint in result.stderr and "internal error" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_bare_module_name_beside_its_file_is_that_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 47: ``mymodel:build`` with mymodel.py in the current folder failed to import."""
    (tmp_path / "mymodel_47.py").write_text(MODEL)
    monkeypatch.chdir(tmp_path)
    factory = resolve_model("mymodel_47:build", (3, 4, 4))
    assert factory.kind == "file" and factory.target == str(tmp_path / "mymodel_47.py")
    assert sum(p.numel() for p in factory().parameters()) == 48 * 10 + 10
    monkeypatch.chdir(tmp_path.parent)
    with pytest.raises(InputError, match="cannot import module 'mymodel_47'"):
        resolve_model("mymodel_47:build")


def test_an_embedding_fed_floats_is_told_about_input_dtype(tmp_path: Path) -> None:
    """Issue 47: torch's dtype error came alone; --input-dtype long is what fixes it."""
    model = tmp_path / "emb.py"
    model.write_text(
        "from torch import nn\n\n\ndef build():\n"
        "    return nn.Sequential(nn.Embedding(100, 8), nn.Flatten(), nn.Linear(32, 10))\n"
    )
    result = invoke(["gradcheck", "--model", f"{model}:build", "--input-shape", "4", "--strategies", "dp"])
    assert result.exit_code == 2, result.output
    assert "'indices'" in result.stderr and "--input-dtype long --input-range 0,VOCAB" in result.stderr


def test_watch_is_not_a_command_and_says_how_to_use_it() -> None:
    for args in (["watch"], ["watch", "--help"], ["watch", "train.py"]):
        result = invoke(args)
        assert result.exit_code == 2, result.output
        assert "gpudiag.watch(model)" in result.stderr and "docs/watch.md" in result.stderr


def test_run_names_a_misspelt_option_and_refuses_dash_m() -> None:
    """Issue 47: ``run --stal 5`` said "no such script"; ``run -m pkg.train`` likewise."""
    typo = invoke(["run", "--stal", "5", "train.py"])
    assert typo.exit_code == 2 and "no such option --stal; did you mean --stall?" in typo.output
    module = invoke(["run", "-m", "json.tool"])
    assert module.exit_code == 2 and "not supported yet; give its file: gpudiag run " in module.output
    assert "json/tool.py" in module.output
    missing = invoke(["run", "-m", "no_such_pkg_47.train"])
    assert missing.exit_code == 2 and "give its file as SCRIPT" in missing.output


def test_checks_help_lists_what_the_registry_accepts() -> None:
    """Issue 47: ``doctor --checks`` help listed 5 checks and accepted 7."""
    import gpudiag.checks.suite  # noqa: F401  (registers gpudiag's own checks)
    from gpudiag.checks.registry import names

    for command in ("doctor", "report", "sweep"):
        text = " ".join(invoke([command, "--help"]).stdout.split())
        assert all(name in text for name in names()), (command, text)
    assert "hang" in names() and "transport" in names()


def test_output_is_an_output_file_or_folder_everywhere(tmp_path: Path) -> None:
    """Issue 47: -o/--output meant a bundle, a folder, a JSON file and (gradcheck) a part of
    the model's output. gradcheck's is --model-output now; --output still works, with a note."""
    for command in ("report", "doctor", "bench", "sweep"):
        help_text = invoke([command, "--help"]).stdout
        assert "-o, --output" in help_text, command
    assert "-o DIR" in invoke(["run", "--help"]).stdout
    gradcheck_help = invoke(["gradcheck", "--help"]).stdout
    assert "--model-output KEY" in gradcheck_help and "--output" not in gradcheck_help.replace(
        "--model-output", ""
    )
    both = invoke(["gradcheck", "--model", "mlp", "--output", "0", "--model-output", "0"])
    assert both.exit_code == 2 and "old spelling of --model-output" in both.output
