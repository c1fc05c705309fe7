"""``gpudiag ckpt inspect|convert``."""

from __future__ import annotations

import sys
from typing import Any

import click

from gpudiag.cli.group import cli
from gpudiag.cli.options import format_option


@cli.group()
def ckpt() -> None:
    """Inspect, verify and convert checkpoints (single files and DCP folders), safely."""


@ckpt.command("inspect")
@click.argument("path")
@click.option(
    "--model", metavar="SPEC", help="Check that it loads strictly into this model (as for gradcheck)."
)
@click.option(
    "--trust-checkpoint", "trust", is_flag=True, help="Allow arbitrary pickled objects (runs code!)."
)
@format_option(("text", "json", "markdown"))
@click.pass_context
def ckpt_inspect(ctx: click.Context, path: str, model: str | None, trust: bool, fmt: str) -> None:
    """Show the format, state dicts, wrapper prefixes and other entries of a checkpoint.
    With --model: exit 1 when it does not load strictly into it."""
    from pathlib import Path

    from gpudiag.render import render

    if Path(path).is_dir():  # a torch.distributed.checkpoint folder
        from gpudiag.repro.checkpoint import dcp

        result: Any = dcp.inspect(path, model=model)
    else:
        from gpudiag.repro.checkpoint import inspect

        result = inspect(path, model=model, trust=trust)
    render("ckpt_inspect", result, fmt, sys.stdout)
    ctx.exit(result.exit_code())


@ckpt.command("verify")
@click.argument("path", metavar="DIR")
@click.option("--model", metavar="SPEC", help="Also compare keys, shapes and dtypes with this model.")
@format_option(("text", "json", "markdown"))
@click.pass_context
def ckpt_verify(ctx: click.Context, path: str, model: str | None, fmt: str) -> None:
    """Read every byte range of a DCP folder: files, coverage, CRC-32s, NaN/Inf, optimizer
    state, the target model. Exit 1 when a problem is found, 2 when it cannot be read."""
    from gpudiag.render import render
    from gpudiag.repro.checkpoint import dcp

    result = dcp.verify(path, model=model)
    render("ckpt_inspect", result, fmt, sys.stdout)
    ctx.exit(result.exit_code())


@ckpt.command("convert")
@click.argument("src", metavar="IN")
@click.argument("dst", metavar="OUT")
@click.option(
    "--model", metavar="SPEC", help="Choose the renaming that makes the keys load strictly into it."
)
@click.option("--strip", multiple=True, metavar="PREFIX", help="Strip this leading prefix (repeatable).")
@click.option("--add", metavar="PREFIX", help="Add this prefix to every key (e.g. module.).")
@click.option("--to", type=click.Choice(["pt", "safetensors"]), help="Output format (default: the input's).")
@click.option("--dry-run", is_flag=True, help="Print the key mapping; write nothing.")
@click.option(
    "--trust-checkpoint", "trust", is_flag=True, help="Allow arbitrary pickled objects (runs code!)."
)
@click.option("--force", is_flag=True, help="Overwrite an existing OUT.")
@click.option("--only", metavar="GROUP", help="DCP folder: keep one top-level group (e.g. model).")
@click.option(
    "--keys",
    type=click.Choice(["auto", "keep"]),
    default=None,
    help="DCP folder: auto (default) removes wrapper segments (_orig_mod. …) at any depth; "
    "keep leaves keys as saved.",
)
@format_option(("text", "json", "markdown"))
def ckpt_convert(
    src: str, dst: str, fmt: str, trust: bool, only: str | None, keys: str | None, **options: Any
) -> None:
    """Rename checkpoint keys: auto-peel module./_orig_mod./… or as told; or turn a DCP
    folder (IN a directory) into one OUT.pt or OUT.safetensors. IN is never changed."""
    from pathlib import Path

    from gpudiag.render import render

    if Path(src).is_dir():
        from gpudiag.repro.checkpoint import dcp_convert

        given = [f"--{k.replace('_', '-')}" for k in ("model", "strip", "add", "dry_run") if options.get(k)]
        if given or trust:
            raise click.UsageError(f"{', '.join(given or ['--trust-checkpoint'])}: not for a DCP folder")
        result = dcp_convert.convert(
            src, dst, only=only, keys=keys or "auto", to=options["to"], force=options["force"]
        )
        render("ckpt_convert", result, fmt, sys.stdout)
        return
    if only or keys:
        raise click.UsageError("--only and --keys are for a DCP folder (IN a directory)")
    from gpudiag.repro.checkpoint import convert

    options["strip"] = list(options["strip"])
    render("ckpt_convert", convert(src, dst, trust=trust, **options), fmt, sys.stdout)
