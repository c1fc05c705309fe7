"""The ``gpudiag`` click group and the one place errors become exit codes."""

from __future__ import annotations

import signal
import sys
from typing import Any

import click

from gpudiag import __version__
from gpudiag.errors import (
    EXIT_PROBLEM,
    GpudiagError,
    Interrupted,
    from_user_code,
    is_out_of_memory,
    is_out_of_space,
)


class GpudiagGroup(click.Group):
    """Turns :class:`GpudiagError` into a one-line message and its exit code; what the
    user's code did that escaped a check (``sys.exit``, running out of memory or disk)
    into the same; an interruption into one line and ``128 + signal``."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Interrupted as exc:
            click.echo(f"gpudiag: interrupted by {signal.Signals(exc.signum).name}; stopped", err=True)
            ctx.exit(exc.exit_code)
        except GpudiagError as exc:
            if (ctx.obj or {}).get("debug"):
                raise
            click.echo(f"gpudiag: error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except BrokenPipeError:
            sys.stderr.close()
            ctx.exit(EXIT_PROBLEM)
        except SystemExit as exc:  # (click's own exits are click.exceptions.Exit)
            error = from_user_code(exc, "code gpudiag ran (the model or its factory)")
            click.echo(f"gpudiag: error: {error}", err=True)
            ctx.exit(error.exit_code)
        except Exception as exc:
            if (ctx.obj or {}).get("debug"):
                raise
            if is_out_of_memory(exc) or is_out_of_space(exc):
                error = from_user_code(exc, "the run")
                click.echo(f"gpudiag: error: {error}", err=True)
                ctx.exit(error.exit_code)
            click.echo(
                f"gpudiag: internal error: {type(exc).__name__}: {exc} "
                "(rerun with --debug for the traceback and report it)",
                err=True,
            )
            ctx.exit(EXIT_PROBLEM)


@click.group(cls=GpudiagGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpudiag")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Diagnose multi-GPU PyTorch training: interconnect, gradients, NaNs, checkpoints."""
    ctx.obj = {"debug": debug}
