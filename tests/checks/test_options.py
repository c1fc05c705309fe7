"""Each check's options are declared once (gpudiag.checks.options): the command's click
options, the Python API's defaults, the suite's defaults and the bundle's field checks are
derived from the declaration and agree with it."""

from __future__ import annotations

import inspect
from typing import Any

import click
import pytest

from gpudiag.checks.options import OPTIONS, specs
from gpudiag.cli import cli
from tests.helpers import invoke


def _api(name: str) -> Any:
    if name == "gradcheck":
        from gpudiag.checks.gradcheck import gradcheck

        return gradcheck
    from gpudiag.checks.nancheck import nancheck

    return nancheck


def _cli_params(name: str) -> dict[str, click.Parameter]:
    command = cli.commands[name]
    return {p.name: p for p in command.params if p.name}


@pytest.mark.parametrize("check", sorted(OPTIONS))
def test_the_command_the_api_the_suite_and_the_bundle_agree(check: str) -> None:
    from gpudiag.checks.builtin import DEFAULT_GRADCHECK, DEFAULT_NANCHECK
    from gpudiag.checks.fields import config_fields

    suite = {"gradcheck": DEFAULT_GRADCHECK, "nancheck": DEFAULT_NANCHECK}[check]
    api = inspect.signature(_api(check)).parameters
    params, fields = _cli_params(check), config_fields()[check]
    for name, (default, spec) in specs(OPTIONS[check]).items():
        assert api[name].default == default, f"{check}({name}=…) default"
        if name in params:  # (--timeout is the runtime's shared option)
            param = params[name]
            shown = ",".join(default) if spec.many else default
            assert param.default == shown, f"--{name} default"
            if spec.choices is not None and not spec.many:
                assert isinstance(param.type, click.Choice) and tuple(param.type.choices) == spec.choices, (
                    name
                )
        if name in suite:
            assert suite[name] == (list(default) if isinstance(default, tuple) else default), f"suite {name}"
        if name in fields:
            check_value = fields[name]
            for choice in spec.choices or ():
                assert check_value([choice] if spec.many else choice) is None, (
                    f"bundle refuses {name}={choice}"
                )
            assert check_value(["no-such"] if spec.many else "no-such") is not None or spec.choices is None
            assert check_value(list(default) if spec.many else default) is None, (
                f"bundle refuses {name} default"
            )


def test_every_cli_choice_list_is_the_declared_one() -> None:
    """The drift that started this (issue 32): the bundle took optimizer none, the CLI did not."""
    assert tuple(_cli_params("gradcheck")["optimizer"].type.choices) == ("sgd", "adam", "none")  # type: ignore[attr-defined]
    assert (
        tuple(_cli_params("nancheck")["loss"].type.choices) == specs(OPTIONS["nancheck"])["loss"][1].choices
    )  # type: ignore[attr-defined]


def test_the_declared_ranges_refuse_on_every_side() -> None:

    from gpudiag.checks.fields import config_fields

    refused = invoke(["gradcheck", "--model", "mlp", "--world-size", "65"])
    assert refused.exit_code == 2 and "65" in refused.output
    assert config_fields()["gradcheck"]["world_size"](65) == "65 is out of range (expected 1 to 64)"
    assert "timeout" not in config_fields()["nancheck"]  # a deadline is no bundle's to set


def test_nancheck_trains_with_the_loss_it_declares(tmp_path: Any) -> None:
    """--loss is declared for nancheck (bundles carried it; the command had none): an mse
    loss gets regression targets of the output's shape, not class labels."""

    seed = "diag/examples/seed_8gpu_machine.json"
    args = ["nancheck", "--machine", seed, "--pairs", "0-1", "--steps", "2", "--input-shape", "8"]
    done = invoke([*args, "--loss", "mse", "--format", "json"])
    assert done.exit_code == 0, done.output


def test_bench_options_are_declared_once_too() -> None:
    """bench is no check of the suite (nothing of it is bundled), but its command and its
    Python API take their defaults, choices and ranges from one declaration as well."""
    from click.testing import CliRunner

    from gpudiag.checks.bench import bench
    from gpudiag.checks.options import BENCH, BenchOptions

    api = inspect.signature(bench).parameters
    params = _cli_params("bench")
    for name, (default, spec) in specs(BenchOptions).items():
        assert api[name].default == default == getattr(BENCH, name), name
        assert params[name].default == (",".join(default) if spec.many else default), name
    assert params["dtypes"].opts == ["--dtype"]  # (the flag users know, for the field dtypes)
    for args, word in ((["--dtype", "fp8"], "fp32, bf16, fp16"), (["--steps", "1"], "--steps")):
        refused = CliRunner().invoke(cli, ["bench", "--model", "mlp", *args])
        assert refused.exit_code == 2 and word in refused.output, refused.output
