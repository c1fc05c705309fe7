"""The ``gpudiag`` command line. Every command parses, calls one function, renders.

Exit codes: 0 nothing wrong, 1 a problem found, 2 bad usage or input, 3 cannot run here.
Errors are one line on stderr; ``--debug`` shows the traceback. Heavy modules (torch,
pynvml, rich) are imported inside commands, so ``gpudiag --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import os
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


def format_option(formats: tuple[str, ...]) -> Any:
    return click.option(
        "--format",
        "fmt",
        type=click.Choice(formats),
        default="text",
        show_default=True,
        help="Output format.",
    )


def _parse_injections(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    if not values:
        return values  # (the runtime imports torch: not before the command needs it)
    from gpudiag.runtime.faults import InjectSpecError, parse_fault

    for value in values:
        try:
            parse_fault(value)
        except InjectSpecError as exc:
            raise click.BadParameter(str(exc), ctx=ctx, param=param) from None
    return values


def runtime_options(command: Any) -> Any:
    """``--inject SPEC`` (repeatable), ``--trace FILE`` and ``--timeout`` for every command that runs the
    instrumented runtime (grammar: ``docs/runtime.md``)."""
    command = click.option(
        "--timeout",
        default=300.0,
        show_default=True,
        type=click.FloatRange(min=0, min_open=True),
        metavar="SECONDS",
        help="Deadline for each phase (the reference, each strategy, the ranks): what is still "
        "running then is stopped and named.",
    )(command)
    command = click.option(
        "--trace",
        metavar="FILE",
        help="Write what the runtime recorded: Chrome trace JSON (Perfetto), or JSON Lines for *.jsonl.",
    )(command)
    return click.option(
        "--inject",
        "inject",
        multiple=True,
        metavar="SPEC",
        callback=_parse_injections,
        help="Inject a fault: SRC->DST:KIND[@STEP][xCOUNT], KIND nan|inf|zero|bitflip|scale=F (repeatable).",
    )(command)


def _check_trace(trace: str | None) -> None:
    """Refuse a --trace path gpudiag may not write (a FIFO, a device, a link, a folder)
    before anything runs. An earlier trace file is replaced."""
    if trace:
        from gpudiag.fileio import check_target

        check_target(trace, force=True)


@click.group(cls=GpudiagGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpudiag")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Diagnose multi-GPU PyTorch training: interconnect, gradients, NaNs, checkpoints."""
    ctx.obj = {"debug": debug}


@cli.command()
@click.option(
    "--from-file",
    "from_file",
    metavar="PATH|-",
    help="Read an `nvidia-smi topo -m` capture (may be followed by `topo -p2p rw`); - is stdin.",
)
@click.option(
    "--machine",
    metavar="FILE",
    help="Read a machine file (as --save-machine writes) or a capture; bundled examples by name.",
)
@click.option(
    "--save-machine",
    metavar="FILE",
    help="Also write what was read as a machine file.",
)
@click.option("--force", is_flag=True, help="Overwrite an existing --save-machine file.")
@format_option(("text", "json", "markdown", "dot"))
def topology(
    from_file: str | None, machine: str | None, save_machine: str | None, force: bool, fmt: str
) -> None:
    """Show which GPUs are joined by NVLink or PCIe, P2P status, and how to group them.

    Reads live NVML unless --from-file or --machine is given. GPU numbers are
    nvidia-smi's (PCI bus order).
    """
    from gpudiag.hw.machine import save_machine as write_machine
    from gpudiag.hw.sources import read_topology
    from gpudiag.render import render
    from gpudiag.topology.analysis import analyze

    topo = read_topology(from_file=from_file, machine=machine)
    if save_machine:
        write_machine(topo, save_machine, force=force)
    render("topology", analyze(topo), fmt, sys.stdout)


def _dims(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    """``3,32,32`` → (3, 32, 32), parsed without importing torch (``--help`` and bad
    arguments answer at once)."""
    parts = [d.strip() for d in value.split(",")]
    dims = tuple(int(d) for d in parts) if all(d.isascii() and d.isdigit() for d in parts) else ()
    if not dims or any(d < 1 for d in dims):
        raise click.BadParameter(
            f"bad shape {value!r}: expected positive integers like 3,32,32", ctx=ctx, param=param
        )
    return dims


def _input_range(
    _ctx: click.Context, _param: click.Parameter, value: str | None
) -> tuple[float, float] | None:
    """``0,30522`` → (0.0, 30522.0); checked against --input-dtype when the batch is made."""
    if value is None:
        return None
    parts = [p.strip() for p in value.split(",")]
    try:
        lo, hi = (float(p) for p in parts)
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected LO,HI, e.g. 0,30522") from None
    return lo, hi


def input_options(command: Any) -> Any:
    """``--input-dtype`` and ``--input-range``: generated inputs for models that take no
    float image (token ids: ``--input-dtype long --input-range 0,30522``)."""
    command = click.option(
        "--input-range",
        callback=_input_range,
        metavar="LO,HI",
        help="Draw inputs from [LO, HI): uniform floats, or integers for long/int (default: normal floats).",
    )(command)
    return click.option(
        "--input-dtype",
        type=click.Choice(["float", "long", "int"]),
        default="float",
        show_default=True,
        help="Generated inputs' dtype (long/int need --input-range).",
    )(command)


def _output_key(_ctx: click.Context, _param: click.Parameter, value: str | None) -> int | str | None:
    """``--output 1`` is a tuple index, anything else a dict key or attribute name."""
    if value is None:
        return None
    return int(value) if value.lstrip("-").isdigit() else value


def _strategies(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in value.split(",") if s.strip())
    bad = [s for s in names if s not in ("single", "dp", "ddp")]
    if bad or not names:
        raise click.BadParameter(f"expected a list of single, dp, ddp; got {value!r}", ctx=ctx, param=param)
    return names


@cli.command()
@click.option(
    "--model",
    "model",
    required=True,
    metavar="SPEC",
    help="torchvision:NAME[?k=v], path/file.py:factory, package.module:factory, or a built-in "
    "(mlp, mlp-dropout, mlp-unused, cnn, cnn-bn).",
)
@click.option(
    "--input-shape",
    default="3,32,32",
    show_default=True,
    callback=_dims,
    metavar="DIMS",
    help="One sample's shape, without the batch dimension.",
)
@input_options
@click.option(
    "--num-classes", default=10, show_default=True, type=click.IntRange(1), help="Classes for ce losses."
)
@click.option("--batch-size", default=8, show_default=True, type=click.IntRange(1), help="Global batch size.")
@click.option(
    "--loss", type=click.Choice(["ce", "ce-sum", "mse", "mse-sum"]), default="ce", show_default=True
)
@click.option(
    "--strategies",
    default="single,dp,ddp",
    show_default=True,
    callback=_strategies,
    help="Comma-separated; single is always the reference.",
)
@click.option(
    "--world-size",
    default=2,
    show_default=True,
    type=click.IntRange(1),
    help="Devices for dp and ranks for ddp (CUDA if there are enough GPUs, else CPU virtual devices).",
)
@click.option("--steps", default=1, show_default=True, type=click.IntRange(1), help="Optimizer steps.")
@click.option("--lr", default=0.01, show_default=True, type=float)
@click.option("--optimizer", type=click.Choice(["sgd", "adam"]), default="sgd", show_default=True)
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default="fp32", show_default=True)
@click.option(
    "--mode",
    type=click.Choice(["auto", "as-is", "controlled"]),
    default="auto",
    show_default=True,
    help="controlled: BatchNorm on running statistics, random draws (dropout, drop path, RReLU, "
    "noise) at their expected value; auto: as-is, then controlled where that could explain a difference.",
)
@click.option(
    "--output",
    default=None,
    callback=_output_key,
    metavar="KEY",
    help="The part of the model's output the loss takes: an index into a tuple, or a dict key / "
    "attribute (default: the tensor, .logits, 'out', or a tuple's first element).",
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--sync-batchnorm",
    is_flag=True,
    help="Convert BatchNorm to SyncBatchNorm under ddp (CUDA only; on CPU the run says it skipped it).",
)
@runtime_options
@click.option(
    "--strict", is_flag=True, help="Exit 1 when differences are explained, not only when they fail."
)
@format_option(("text", "json", "markdown"))
@click.pass_context
def gradcheck(ctx: click.Context, strict: bool, fmt: str, trace: str | None, **options: Any) -> None:
    """Do single-GPU, DataParallel and DDP compute the same gradients? If not, why?

    Exit 0 for pass or explained (1 with --strict), 1 for fail.
    """
    from gpudiag.checks.gradcheck import gradcheck_spec
    from gpudiag.progress import shown

    _check_trace(trace)
    with shown():
        report = gradcheck_spec(**options)
    from gpudiag.render import render
    from gpudiag.runtime.record import write_trace

    if trace:
        write_trace(trace, report.recorders, force=True)
    render("gradcheck", report, fmt, sys.stdout)
    ctx.exit(report.exit_code(strict))


@cli.command()
@click.option("--pairs", default="all", show_default=True, metavar="all|A-B,…", help="GPU pairs to train on.")
@click.option("--strategy", type=click.Choice(["dp", "ddp"]), default="dp", show_default=True)
@click.option(
    "--steps", default=10, show_default=True, type=click.IntRange(1), help="Training steps per run."
)
@click.option("--model", default="mlp", show_default=True, metavar="SPEC", help="As for gradcheck.")
@click.option("--input-shape", default="3,32,32", show_default=True, callback=_dims, metavar="DIMS")
@input_options
@click.option("--num-classes", default=10, show_default=True, type=click.IntRange(1))
@click.option("--batch-size", default=8, show_default=True, type=click.IntRange(1))
@click.option("--lr", default=0.01, show_default=True, type=float)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--machine",
    "machine_file",
    metavar="FILE",
    help="Run on CPU virtual devices laid out like this machine file or capture (no GPU needed).",
)
@runtime_options
@format_option(("text", "json", "markdown"))
@click.pass_context
def nancheck(ctx: click.Context, fmt: str, trace: str | None, **options: Any) -> None:
    """Find the GPU pair, the link and the step where training goes NaN.

    Trains on every GPU alone and on every pair, and names a link-corruption, a
    device-fault, a numeric-divergence or a loss-explosion. Exit 0 pass, 1 fail.
    """
    from gpudiag.checks.nancheck import nancheck_spec
    from gpudiag.progress import shown
    from gpudiag.render import render
    from gpudiag.runtime.record import write_trace

    _check_trace(trace)
    options["inject"] = tuple(options["inject"])
    with shown():
        report = nancheck_spec(**options)
    if trace:
        write_trace(trace, report.recorders, force=True)
    render("nancheck", report, fmt, sys.stdout)
    ctx.exit(report.exit_code())


@cli.command()
@click.option("--pairs", default="all", show_default=True, metavar="all|A-B,…")
@click.option(
    "--sizes", metavar="4K,1M,…", help="Copy sizes (default 4K..256M on GPUs, 4K..1M on virtual devices)."
)
@click.option(
    "--machine",
    "machine_file",
    metavar="FILE",
    help="Run on CPU virtual devices laid out like this machine file or capture (no GPU needed).",
)
@click.option(
    "--inject",
    multiple=True,
    metavar="SPEC",
    callback=_parse_injections,
    help="Break copies and collectives: SRC->DST:KIND[@STEP][xCOUNT] (repeatable).",
)
@format_option(("text", "json", "markdown"))
@click.pass_context
def peer(
    ctx: click.Context,
    pairs: str,
    sizes: str | None,
    machine_file: str | None,
    inject: tuple[str, ...],
    fmt: str,
) -> None:
    """Prove each GPU pair's peer-to-peer path: verified copies, bandwidth, exact all-reduce, host facts.

    Exit 0 when nothing is broken, 1 when a copy or collective is wrong or hangs, 3 when
    there are not two GPUs to test (the host probes still run and are shown). With
    --machine the result is simulated on CPU virtual devices.
    """
    from gpudiag.checks.peer import peer as run_peer
    from gpudiag.hw.sources import read_machine_or_capture
    from gpudiag.parsers import parse_sizes
    from gpudiag.render import render

    machine = read_machine_or_capture(machine_file) if machine_file else None
    report = run_peer(
        machine=machine,
        pairs=pairs,
        sizes=parse_sizes(sizes) if sizes else None,
        inject=inject,
        machine_source=machine_file,
    )
    render("peer", report, fmt, sys.stdout)
    ctx.exit(report.exit_code())


@cli.group()
def ckpt() -> None:
    """Inspect checkpoints and repair DataParallel/DDP/compile key prefixes, safely."""


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
    from gpudiag.render import render
    from gpudiag.repro.checkpoint import inspect

    result = inspect(path, model=model, trust=trust)
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
@format_option(("text", "json", "markdown"))
def ckpt_convert(src: str, dst: str, fmt: str, trust: bool, **options: Any) -> None:
    """Rename checkpoint keys: auto-peel module./_orig_mod./… or as told. IN is never changed."""
    from gpudiag.render import render
    from gpudiag.repro.checkpoint import convert

    options["strip"] = list(options["strip"])
    render("ckpt_convert", convert(src, dst, trust=trust, **options), fmt, sys.stdout)


@cli.command()
@click.option(
    "--anonymize", is_flag=True, help="Also mask host names, IP addresses, user names, MASTER_ADDR."
)
@format_option(("text", "json", "markdown"))
def env(anonymize: bool, fmt: str) -> None:
    """What maintainers ask for: versions, GPUs and their numbering, topology, NCCL settings.

    Everything `python -m torch.utils.collect_env` reports plus topology, the torch/NVML/PCI
    mapping, NCCL/TORCH/CUDA variables and config files, TF32/determinism flags and the
    IOMMU. Secrets are replaced by a marker; anything that cannot be read says why.
    """
    from gpudiag.checks.env import collect_env
    from gpudiag.redact import Redactor
    from gpudiag.render import render

    render("env", collect_env(redactor=Redactor(anonymize=anonymize)), fmt, sys.stdout)


def _check_names(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...] | None:
    from gpudiag.checks.suite import CHECKS

    if value is None:
        return None
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    bad = [n for n in names if n not in CHECKS]
    if bad or not names:
        raise click.BadParameter(
            f"expected a list of {', '.join(CHECKS)}; got {value!r}", ctx=ctx, param=param
        )
    return names


def suite_options(command: Any) -> Any:
    """The options ``report`` and ``doctor`` share."""
    options = [
        click.option(
            "--checks",
            callback=_check_names,
            metavar="LIST",
            help="Comma-separated: env, topology, peer, gradcheck, nancheck (default: all that apply here).",
        ),
        click.option(
            "-o",
            "--output",
            metavar="PATH",
            help="Bundle to write: a folder, or a .zip (default: gpudiag-report-<UTC time> here).",
        ),
        click.option("--force", is_flag=True, help="Replace an existing bundle at PATH."),
        click.option(
            "--anonymize", is_flag=True, help="Also mask host names, IP addresses, user names, MASTER_ADDR."
        ),
        click.option(
            "--machine",
            metavar="FILE",
            help="A machine file or `nvidia-smi topo -m` capture: run topology, peer and nancheck on "
            "virtual devices laid out like it (no GPU needed).",
        ),
        click.option("--model", metavar="SPEC", help="Model for gradcheck and nancheck (default: mlp)."),
        click.option(
            "--input-shape",
            callback=lambda ctx, param, value: None if value is None else _dims(ctx, param, value),
            metavar="DIMS",
            help="One sample's shape for gradcheck and nancheck (default: 3,32,32).",
        ),
        input_options,
        click.option(
            "--pairs",
            default="all",
            show_default=True,
            metavar="all|A-B,…",
            help="GPU pairs for peer and nancheck (all pairs can take long on many GPUs).",
        ),
        click.option(
            "--inject",
            multiple=True,
            metavar="SPEC",
            callback=_parse_injections,
            help="Inject a fault into every check that moves tensors: SRC->DST:KIND[@STEP][xCOUNT].",
        ),
        format_option(("text", "json", "markdown")),
    ]
    for option in reversed(options):
        command = option(command)
    return command


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

    from gpudiag.checks.suite import CHECKS, Here
    from gpudiag.models import check_input_range, resolve_model
    from gpudiag.redact import Redactor
    from gpudiag.render import render
    from gpudiag.repro.report import check_destination, run_report, write_bundle

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    bundle = not options.get("no_bundle")
    if not bundle and options["output"]:
        raise click.UsageError("--no-bundle and --output contradict each other: choose one")
    output = options["output"] or f"gpudiag-report-{stamp}"
    if bundle:
        check_destination(output, options["force"])
    if options["model"]:
        resolve_model(options["model"])
    check_input_range(options["input_dtype"], options["input_range"])
    here = Here.detect(options["machine"])
    if options["pairs"] != "all" and here.gpus:  # without GPUs no check uses pairs
        from gpudiag.parsers import parse_pairs

        parse_pairs(options["pairs"], here.gpus)
    names = options["checks"] or CHECKS
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
    )
    if bundle:
        redactor = Redactor(anonymize=options["anonymize"])
        report.bundle_path = str(write_bundle(report, output, redactor=redactor, force=options["force"]))
    render(kind, report, options["fmt"], sys.stdout)
    return report


@cli.command()
@suite_options
@click.pass_context
def report(ctx: click.Context, **options: Any) -> None:
    """Run the checks and write a bug-report bundle a maintainer can reproduce.

    The bundle (a folder, or a .zip) holds report.json, REPORT.md to paste into an issue,
    repro.py (torch only) for each failing check, traces and per-rank logs; secrets never
    reach it. Exit 1 when a check fails.
    """
    ctx.exit(_run_suite("report", options).exit_code())


@cli.command()
@suite_options
@click.option("--no-bundle", is_flag=True, help="Only the summary: write no report bundle.")
@click.pass_context
def doctor(ctx: click.Context, **options: Any) -> None:
    """Start here: find what this machine has, run every check that applies, summarise.

    Prints a table (check, status, headline finding), says what was skipped and why, and
    writes a report bundle. Without GPUs it runs what it can (gradcheck on CPU virtual
    devices and gloo, env, host probes); --machine FILE diagnoses a GPU machine from its
    capture. Exit 1 when a check fails.
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
    names runs only with --trust-bundle. A check that cannot run here is skipped with the
    reason. Exit 0 when the results match, 1 when they differ, 2 for a damaged, oversized
    or malformed bundle or one from a newer gpudiag.
    """
    from gpudiag.progress import shown
    from gpudiag.render import render
    from gpudiag.repro.replay import replay as run_replay
    from gpudiag.repro.report import read_bundle

    with shown():
        result = run_replay(read_bundle(bundle), trust=trust_bundle)
    render("replay", result, fmt, sys.stdout)
    ctx.exit(result.exit_code())


def _counts(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    """``1,2,4,8`` → (1, 2, 4, 8); None: what the machine has."""
    return None if value is None else _dims(ctx, param, value)


def _dtypes(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in value.split(",") if s.strip())
    if not names or any(n not in ("fp32", "bf16", "fp16") for n in names):
        raise click.BadParameter(f"expected a list of fp32, bf16, fp16; got {value!r}", ctx=ctx, param=param)
    return names


@cli.command()
@click.option("--model", metavar="SPEC", help="As for gradcheck (required unless --compare).")
@click.option("--input-shape", default="3,32,32", show_default=True, callback=_dims, metavar="DIMS")
@input_options
@click.option("--num-classes", default=10, show_default=True, type=click.IntRange(1))
@click.option("--batch-size", default=32, show_default=True, type=click.IntRange(1))
@click.option(
    "--per-gpu/--global",
    "per_gpu",
    default=True,
    show_default=True,
    help="--batch-size per GPU (the global batch grows with the GPUs) or in total (split over them).",
)
@click.option("--strategies", default="single,dp,ddp", show_default=True, callback=_strategies)
@click.option(
    "--gpus",
    default=None,
    callback=_counts,
    metavar="N,…",
    help="GPU counts for dp/ddp (default: 2,4,8 up to what there is).",
)
@click.option(
    "--dtype", "dtypes", default="fp32", show_default=True, callback=_dtypes, metavar="fp32,bf16,fp16"
)
@click.option("--data", default="synthetic", show_default=True, type=click.Choice(["synthetic"]))
@click.option("--steps", default=20, show_default=True, type=click.IntRange(2), help="Timed steps.")
@click.option(
    "--warmup", default=3, show_default=True, type=click.IntRange(1), help="Steps run first and not timed."
)
@click.option(
    "--machine",
    "machine",
    metavar="FILE",
    help="Run on CPU virtual devices laid out like this machine file or capture (no GPU needed).",
)
@click.option("--timeout", default=300.0, show_default=True, type=click.FloatRange(min=0, min_open=True))
@click.option("-o", "output", metavar="FILE", help="Also write the result as JSON (gpudiag.bench/1) to FILE.")
@click.option("--force", is_flag=True, help="Replace an existing -o FILE.")
@click.option("--compare", nargs=2, metavar="BEFORE AFTER", help="Compare two -o files instead of measuring.")
@format_option(("text", "json", "markdown"))
@click.pass_context
def bench(
    ctx: click.Context,
    fmt: str,
    output: str | None,
    force: bool,
    compare: tuple[str, str] | None,
    per_gpu: bool,
    **options: Any,
) -> None:
    """Measure samples/s, step time and phases of single, DataParallel and DDP, and say why
    one is slower than it should be. On CPU virtual devices the figures are simulated.

    Exit 0 measured (findings are warnings), 1 a case failed, 2 bad input.
    """
    from gpudiag.render import render

    if compare:
        from gpudiag.checks.bench import compare_files

        render("bench", compare_files(*compare), fmt, sys.stdout)
        return
    if not options["model"]:
        raise click.UsageError("--model is required (or --compare BEFORE AFTER)")
    if output:
        from gpudiag.fileio import check_target

        check_target(output, force=force)
    from gpudiag.checks.bench import bench as run_bench
    from gpudiag.progress import shown

    with shown():
        result = run_bench(options.pop("model"), convention="per_gpu" if per_gpu else "global", **options)
    if output:
        import json

        from gpudiag.fileio import atomic_write

        atomic_write(output, json.dumps(result.to_json(), indent=2) + "\n", force=force)
    render("bench", result, fmt, sys.stdout)
    ctx.exit(result.exit_code())


def stop_on_signals() -> None:
    """SIGINT and SIGTERM raise :class:`Interrupted` in the main thread, so the command
    unwinds: ranks are terminated and reaped, temporary files and folders removed, one
    line printed, exit 130 / 143. Signals arriving while it unwinds are ignored (every
    cleanup step is bounded)."""

    def interrupt(signum: int, _frame: Any) -> None:
        for each in (signal.SIGINT, signal.SIGTERM):
            signal.signal(each, signal.SIG_IGN)
        raise Interrupted(signum)

    for each in (signal.SIGINT, signal.SIGTERM):
        signal.signal(each, interrupt)


def main() -> None:
    """Console-script entry point.

    Once the command has finished and its output is flushed, the process leaves with
    ``os._exit``: tearing down an interpreter that loaded torch takes most of a second and
    does nothing a finished command needs (its files are already closed and renamed, rank
    processes already reaped, temporary folders removed in ``finally`` blocks). Measured
    2026-11-23 (commit a210671, 2-core machine), `gpudiag gradcheck --model mlp
    --input-shape 3,8,8` three times each: 2.48 / 2.33 / 2.27 s with ``os._exit`` against
    3.07 / 3.12 / 3.15 s leaving normally.
    """
    stop_on_signals()
    try:
        cli(prog_name="gpudiag")
        code = 0
    except Interrupted as exc:  # (arrived outside a command, e.g. while parsing)
        print(f"gpudiag: interrupted by {signal.Signals(exc.signum).name}; stopped", file=sys.stderr)
        code = exc.exit_code
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BrokenPipeError, ValueError):
            stream.flush()
    os._exit(code)
