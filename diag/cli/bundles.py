"""``gpudiag report``, ``doctor`` and ``replay``: the checks as one suite, and bundles."""

from __future__ import annotations

import sys
from typing import Any

import click

from gpudiag.cli.group import cli
from gpudiag.cli.options import format_option, suite_options


def _progress(total: int) -> Any:
    """Progress on stderr: one line per check as it starts and as it ends."""
    done = [0]

    def report(name: str, event: str, run: Any) -> None:
        if event == "start":
            click.echo(f"[{done[0] + 1}/{total}] {name} …", err=True)
        else:
            done[0] += 1
            click.echo(f"[{done[0]}/{total}] {name}: {run.status} ({run.seconds:.1f} s)", err=True)

    return report


def _run_suite(kind: str, options: dict[str, Any]) -> Any:
    """Check the inputs, run the checks, write the bundle: the body of report and doctor."""
    import datetime

    from gpudiag.checks.registry import names as check_names
    from gpudiag.checks.suite import Here  # (registers gpudiag's own checks)
    from gpudiag.models import bundle_files as model_bundle_files
    from gpudiag.models import check_input_range, resolve_model
    from gpudiag.redact import Redactor
    from gpudiag.render import render
    from gpudiag.repro.report import check_destination, run_report, write_bundle

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    if options.get("no_bundle") and options["output"]:
        raise click.UsageError("--no-bundle and --output contradict each other: choose one")
    bundle = kind == "report" or bool(options["output"])  # (doctor writes one only when asked)
    output = options["output"] or f"gpudiag-report-{stamp}"
    if bundle:
        check_destination(output, options["force"])
    carried: dict[str, bytes] = {}
    if options["model"]:  # (a model file travels in the bundle: replay runs that copy)
        carried = model_bundle_files(resolve_model(options["model"]))
    check_input_range(options["input_dtype"], options["input_range"])
    nccl_logs = None
    if options.get("nccl_log"):
        if options["checks"] and "transport" not in options["checks"]:
            raise click.UsageError("--nccl-log is read by the transport check: add transport to --checks")
        from gpudiag.transport.run import read_logs

        nccl_logs = read_logs(list(options["nccl_log"]))
    here = Here.detect(options["machine"])
    here.files.update(carried)
    if options["pairs"] != "all" and here.gpus:  # without GPUs no check uses pairs
        from gpudiag.parsers import parse_pairs

        parse_pairs(options["pairs"], here.gpus)
    names = tuple(options["checks"] or check_names(suite_only=True))
    if options.get("hang"):  # a hang folder: bundled under hang/, judged by the hang check
        from gpudiag.hang.bundled import collect

        here.files.update(collect(options["hang"]))
        names += () if "hang" in names else ("hang",)
    if options.get("checkpoint"):  # a DCP folder: its inspection bundled, never its tensors
        from gpudiag.repro.checkpoint.dcp import bundle_files

        here.files.update(bundle_files(options["checkpoint"]))
    report = run_report(
        here,
        names,
        model=options["model"],
        inject=tuple(options["inject"]),
        pairs=options["pairs"],
        anonymize=options["anonymize"],
        progress=_progress(len(names)),
        argv=["gpudiag", *sys.argv[1:]],
        inputs={
            "input_shape": None if options["input_shape"] is None else list(options["input_shape"]),
            "input_dtype": None if options["input_dtype"] == "float" else options["input_dtype"],
            "input_range": None if options["input_range"] is None else list(options["input_range"]),
        },
        nccl_logs=nccl_logs,
    )
    redactor = Redactor(anonymize=options["anonymize"])
    if bundle:
        report.bundle_path = str(write_bundle(report, output, redactor=redactor, force=options["force"]))
    if sys.stdout.isatty() and options["fmt"] == "text":  # (the user's own terminal, in colour)
        render(kind, report, options["fmt"], sys.stdout)
    else:  # (a pipe, a CI log: what is printed is redacted as the bundle is)
        import io

        printed = io.StringIO()
        render(kind, report, options["fmt"], printed)
        sys.stdout.write(
            redactor.bytes(printed.getvalue().encode("utf-8", "surrogateescape")).decode("utf-8", "replace")
        )
    return report


@cli.command()
@suite_options
@click.option(
    "--hang",
    metavar="DIR",
    help="A hang folder (what gpudiag run -o DIR or gpudiag.watch(hang_timeout=) wrote, or "
    "flight-recorder dumps): bundled, and judged by the hang check.",
)
@click.option(
    "--checkpoint",
    metavar="DIR",
    help="A distributed checkpoint folder (.metadata + .distcp): its inspection is bundled "
    "(structure and findings, never its tensors).",
)
@click.pass_context
def report(ctx: click.Context, **options: Any) -> None:
    """Run the checks and write a bug-report bundle a maintainer can reproduce.

    The bundle (a folder, or a .zip) holds report.json, REPORT.md to paste into an issue,
    repro.py (torch only) for each failing check, traces and per-rank logs, and with
    --hang DIR the job's flight-recorder dumps (as JSON), stacks and verdict, with
    --checkpoint DIR a DCP checkpoint's inspection (checkpoint/); secrets never reach it.
    Exit 1 when a check fails.
    """
    ctx.exit(_run_suite("report", options).exit_code())


@cli.command()
@suite_options
@click.option(
    "--no-bundle", is_flag=True, hidden=True, help="(The default: doctor writes a bundle only with -o.)"
)
@click.pass_context
def doctor(ctx: click.Context, **options: Any) -> None:
    """Start here: find what this machine has, run every check that applies, summarise.

    Prints a table (check, status, headline finding) and says what was skipped and why;
    with -o PATH it also writes a report bundle there (as gpudiag report does). Without
    GPUs it runs what it can (gradcheck on CPU virtual devices and gloo, env, host
    probes); --machine FILE diagnoses a GPU machine from its capture. Exit 1 when a check
    fails.
    """
    ctx.exit(_run_suite("doctor", options).exit_code())


@cli.command()
@click.argument("bundle")
@click.option(
    "--trust-bundle",
    is_flag=True,
    help="Also run code the bundle names (a --model that is a Python file or module). "
    "Without it such checks are skipped and the reason says what would run.",
)
@format_option(("text", "json", "markdown"))
@click.pass_context
def replay(ctx: click.Context, bundle: str, trust_bundle: bool, fmt: str) -> None:
    """Re-run a bundle's checks here and compare with what the reporter saw.

    Built-in models and torchvision architectures run; a model that is code the bundle
    names runs only with --trust-bundle (a model file from the copy the bundle carries). A
    check that cannot run here is skipped with the reason. Exit 0 MATCH, 1 DIFFERS, 3
    NOTHING COMPARED (no check could run here as it ran there), 2 for a damaged, oversized
    or malformed bundle or one from a newer gpudiag.
    """
    from gpudiag.progress import shown
    from gpudiag.render import render
    from gpudiag.repro.bundle import read_bundle
    from gpudiag.repro.replay import replay as run_replay

    with shown():
        result = run_replay(read_bundle(bundle), trust=trust_bundle)
    render("replay", result, fmt, sys.stdout)
    ctx.exit(result.exit_code())
