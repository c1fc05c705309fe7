"""Issue 44: every command line gpudiag prints for the user to run is one its own command
line accepts. REPORT.md told users to run ``gpudiag hang --dumps hang --world-size 2``;
``hang`` takes its dumps as arguments and has no ``--dumps``. Here every ``gpudiag …`` a
report, a doctor summary, a replay and a bundle's REPORT.md print — and the command of each
check's configuration as ``gpudiag report`` plans it — is parsed by the real click CLI."""

from __future__ import annotations

import re
import shlex
import zipfile
from pathlib import Path

import click
import pytest

from gpudiag.checks.suite import Here, command_line, plan
from gpudiag.cli import cli
from tests.helpers import FR, SEED_MACHINE, invoke
from tests.helpers.nccl_logs import LOG as NCCL_LOG

#: ``gpudiag SUBCOMMAND …`` in printed text: its words up to a backtick, a comma, a
#: semicolon, a parenthesis, an ellipsis or the end of the line (a Markdown heading that
#: names a command, ``## gpudiag replay``, is a title, not a command line).
_COMMAND = re.compile(r"(?<![\w/.-])(?<!# )gpudiag [a-z][a-z-]*(?: (?:[\w./=:@*>+'\"<\[\]-]+))*")


def commands_in(text: str) -> list[str]:
    return [m.group(0) for m in _COMMAND.finditer(text)]


def accepted(line: str) -> str | None:
    """None when gpudiag's click CLI parses ``line``, else why not."""
    argv = shlex.split(line)
    assert argv[0] == "gpudiag", line
    try:
        with cli.make_context("gpudiag", argv[1:], resilient_parsing=False) as ctx:
            args = [*ctx._protected_args, *ctx.args]  # (click 8.2+: the subcommand and its words)
            name, command, rest = cli.resolve_command(ctx, args)
            assert command is not None and name is not None
            if isinstance(command, click.Group) and rest:
                with command.make_context(name, rest, parent=ctx) as sub:
                    name, command, rest = command.resolve_command(sub, [*sub._protected_args, *sub.args])
                    assert command is not None and name is not None
                    command.make_context(name, rest, parent=sub).close()
            else:
                command.make_context(name, rest, parent=ctx).close()
    except click.exceptions.Exit:
        return None
    except click.ClickException as exc:
        return exc.format_message()
    return None


def test_the_checker_refuses_what_the_cli_refuses() -> None:
    assert accepted("gpudiag hang --dumps hang --world-size 2") is not None
    assert accepted("gpudiag hang --world-size 2 hang") is None
    assert (
        accepted("gpudiag ckpt convert a.pt b.pt") is None and accepted("gpudiag ckpt nonsense") is not None
    )


def test_each_checks_command_as_planned_is_accepted() -> None:
    here = Here.detect(str(SEED_MACHINE))
    configs = [(name, config) for name, config, _ in plan(here, None) if config is not None]
    configs += [("hang", {"dumps": "hang", "world_size": 2}), ("transport", {"from_log": ["nccl/0-a.log"]})]
    assert len(configs) >= 5
    for name, config in configs:
        line = command_line(name, config)
        assert accepted(line) is None, (line, accepted(line))


@pytest.mark.usefixtures("no_gpu")
def test_every_command_a_report_doctor_and_replay_print_is_accepted(tmp_path: Path) -> None:
    bundle = tmp_path / "b.zip"
    report = ["report", "--checks", "hang,transport", "--hang", str(FR / "gloo" / "skip" / "pickle")]
    outputs = []
    for fmt in ("text", "markdown"):
        out = tmp_path / f"b-{fmt}.zip"
        done = invoke([*report, "--nccl-log", str(NCCL_LOG), "-o", str(out), "--format", fmt])
        assert done.exit_code in (0, 1), done.output
        outputs.append(done.stdout)
    bundle = tmp_path / "b-text.zip"
    with zipfile.ZipFile(bundle) as archive:
        outputs.append(archive.read("REPORT.md").decode())
    for fmt in ("text", "markdown"):
        checks = "env,topology,peer,nancheck,transport,hang"
        done = invoke(["doctor", "--no-bundle", "--checks", checks, "--format", fmt])
        outputs.append(done.stdout)
        done = invoke(["replay", str(bundle), "--format", fmt])
        outputs.append(done.stdout)
    found = [line for text in outputs for line in commands_in(text)]
    assert any(line.startswith("gpudiag hang ") for line in found), found
    assert any(line.startswith("gpudiag replay ") for line in found), found
    refused = {line: why for line in found if (why := accepted(line)) is not None}
    assert refused == {}, refused
