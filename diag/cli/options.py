"""Every option more than one command takes, defined once, and the callbacks that
check option values while click parses them (without importing torch)."""

from __future__ import annotations

import math
from typing import Any

import click

from gpudiag import defaults as D


class FiniteFloatRange(click.FloatRange):
    """click's :class:`~click.FloatRange` without ``nan`` and ``inf``, which pass its
    comparisons: ``--timeout inf`` failed as "the model factory raised OverflowError",
    ``--timeout nan`` as a crashed rank."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


def format_option(formats: tuple[str, ...]) -> Any:
    return click.option(
        "--format",
        "fmt",
        type=click.Choice(formats),
        default="text",
        show_default=True,
        help="Output format.",
    )


def parse_injections(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
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
        default=D.TIMEOUT_S,
        show_default=True,
        type=FiniteFloatRange(min=0, min_open=True),
        metavar="SECONDS",
        help="Deadline for each phase (the reference, each strategy, the ranks): what is still "
        "running then is stopped and named.",
    )(command)
    command = click.option(
        "--trace",
        metavar="FILE",
        help="Write what the runtime recorded: Chrome trace JSON (Perfetto), or JSON Lines for *.jsonl.",
    )(command)
    return inject_option()(command)


def check_trace(trace: str | None) -> None:
    """Refuse a --trace path gpudiag may not write (a FIFO, a device, a link, a folder)
    before anything runs. An earlier trace file is replaced."""
    if trace:
        from gpudiag.fileio import check_target

        check_target(trace, force=True)


def _numbers(value: str) -> tuple[int, ...]:
    """``3, 32,32`` → (3, 32, 32); () when any item is not plain ASCII digits."""
    parts = [d.strip() for d in value.split(",")]
    return tuple(int(d) for d in parts) if all(d.isascii() and d.isdigit() for d in parts) else ()


def dims(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    """``3,32,32`` → (3, 32, 32), parsed without importing torch (``--help`` and bad
    arguments answer at once)."""
    dims = _numbers(value)
    if not dims or any(d < 1 for d in dims):
        raise click.BadParameter(
            f"bad shape {value!r}: expected positive integers like 3,32,32", ctx=ctx, param=param
        )
    return dims


def input_range(
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
        callback=input_range,
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


def output_key(_ctx: click.Context, _param: click.Parameter, value: str | None) -> int | str | None:
    """``--output 1`` is a tuple index, anything else a dict key or attribute name."""
    if value is None:
        return None
    return int(value) if value.lstrip("-").isdigit() else value


def check_names(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...] | None:
    import gpudiag.checks.suite  # noqa: F401  (registers gpudiag's own checks)
    from gpudiag.checks.registry import names as registered

    if value is None:
        return None
    known = registered()
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise click.BadParameter(
            f"expected a list of {', '.join(known)}; got {value!r}", ctx=ctx, param=param
        )
    return names


class ChecksOption(click.Option):
    """``--checks LIST`` whose help lists the checks registered when help is shown (the
    registry, not a copy of it: importing it at start-up would cost every command)."""

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        import gpudiag.checks.suite  # noqa: F401  (registers gpudiag's own checks)
        from gpudiag.checks.registry import names

        every, suite = ", ".join(names()), ", ".join(names(suite_only=True))
        self.help = (self.help or "").format(checks=every, suite=suite)
        return super().get_help_record(ctx)


def suite_options(command: Any) -> Any:
    """The options ``report`` and ``doctor`` share."""
    options = [
        click.option(
            "--checks",
            cls=ChecksOption,
            callback=check_names,
            metavar="LIST",
            help="Comma-separated, of {checks} (default: {suite}, those that apply here).",
        ),
        click.option(
            "-o",
            "--output",
            metavar="PATH",
            help="Bundle to write: a folder, or a .zip (report's default: gpudiag-report-<UTC time> here; "
            "doctor writes one only when given -o).",
        ),
        click.option("--force", is_flag=True, help="Replace an existing bundle at PATH."),
        click.option(
            "--anonymize", is_flag=True, help="Also mask host names, IP addresses, user names, MASTER_ADDR."
        ),
        machine_option(
            "machine",
            "A machine file or `nvidia-smi topo -m` capture: run topology, peer and nancheck on "
            "virtual devices laid out like it (no GPU needed).",
        ),
        click.option("--model", metavar="SPEC", help="Model for gradcheck and nancheck (default: mlp)."),
        input_shape_option(
            None, f"One sample's shape for gradcheck and nancheck (default: {D.shape_text()})."
        ),
        input_options,
        pairs_option("GPU pairs for peer and nancheck (all pairs can take long on many GPUs)."),
        inject_option("Inject a fault into every check that moves tensors: SRC->DST:KIND[@STEP][xCOUNT]."),
        click.option(
            "--nccl-log",
            "nccl_log",
            multiple=True,
            metavar="FILE",
            help="A saved NCCL_DEBUG=INFO log (repeatable): the transport check reads it and the "
            "bundle keeps it (bounded, redacted; host names masked with --anonymize).",
        ),
        format_option(("text", "json", "markdown")),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def gpu_counts(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    """``1,2,4,8`` → (1, 2, 4, 8); None: what the machine has."""
    if value is None:
        return None
    counts = _numbers(value)
    if not counts or min(counts) < 1:
        raise click.BadParameter(
            f"bad GPU counts {value!r}: expected positive numbers like 2,4", ctx=ctx, param=param
        )
    return counts


def device_list(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    """``5,6`` → (5, 6), distinct; None: chosen by the command."""
    if value is None:
        return None
    ids = _numbers(value)
    if not ids:
        raise click.BadParameter(
            f"bad device list {value!r}: expected numbers like 0,1", ctx=ctx, param=param
        )
    if len(set(ids)) != len(ids):
        raise click.BadParameter(f"each device once, got {value!r}", ctx=ctx, param=param)
    return ids


def data_source(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """``synthetic`` | ``loader`` | ``loader:N``, checked while parsing (no torch)."""
    from gpudiag.checks.bench.data import parse_data
    from gpudiag.errors import InputError

    try:
        parse_data(value)
    except InputError as exc:
        raise click.BadParameter(str(exc).removeprefix(f"--data {value}: "), ctx=ctx, param=param) from None
    return value


#: What --machine means for every command that takes it.
MACHINE_HELP = "Run on CPU virtual devices laid out like this machine file or capture (no GPU needed)."
INJECT_HELP = "Inject a fault: SRC->DST:KIND[@STEP][xCOUNT], KIND nan|inf|zero|bitflip|scale=F (repeatable)."


def machine_option(dest: str = "machine_file", text: str = MACHINE_HELP) -> Any:
    """``--machine FILE``: a machine file or an ``nvidia-smi topo -m`` capture (or a bundled
    example by name), the same for every command."""
    return click.option("--machine", dest, metavar="FILE", help=text)


def inject_option(text: str = INJECT_HELP) -> Any:
    """``--inject SPEC`` (repeatable), checked while options are parsed."""
    return click.option(
        "--inject", "inject", multiple=True, metavar="SPEC", callback=parse_injections, help=text
    )


def pairs_option(text: str = "GPU pairs to run on.") -> Any:
    """``--pairs all|A-B,…``: which GPU pairs (checked against the GPUs when the command runs)."""
    return click.option("--pairs", default="all", show_default=True, metavar="all|A-B,…", help=text)


def input_shape_option(
    default: tuple[int, ...] | None = D.INPUT_SHAPE,
    text: str = "One sample's shape, without the batch dimension.",
) -> Any:
    """``--input-shape DIMS`` (``3,32,32``); a None default leaves it to the checks."""
    return click.option(
        "--input-shape",
        default=None if default is None else D.shape_text(default),
        show_default=default is not None,
        callback=lambda ctx, param, value: None if value is None else dims(ctx, param, value),
        metavar="DIMS",
        help=text,
    )


class ChoiceOrFunction(click.Choice):
    """One of the choices, or ``FILE.py:NAME`` (checked when the command resolves it)."""

    def get_metavar(self, param: Any, *args: Any, **kwargs: Any) -> str:
        """(click ≥ 8.2 passes ``ctx`` by keyword, older clicks nothing more.)"""
        return "[" + "|".join(str(c) for c in self.choices) + "|FILE.py:NAME]"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, str) and ":" in value and value.rpartition(":")[0].endswith(".py"):
            return value
        if value in self.choices:
            return value
        choices = ", ".join(repr(c) for c in self.choices)
        self.fail(f"{value!r} is not one of {choices}, nor a function FILE.py:NAME", param, ctx)


def declared_options(options: type, *names: str) -> Any:
    """The click options ``--NAME`` of a check's options type (``gpudiag.checks.options``),
    each with the type's default, choices or range and help: declared there once."""
    from gpudiag.checks.options import specs

    table = specs(options)

    def decorate(command: Any) -> Any:
        for name in reversed(names):
            default, spec = table[name]
            flag = spec.flag or "--" + name.replace("_", "-")
            if spec.many:
                command = click.option(
                    flag,
                    name,
                    default=",".join(default),
                    show_default=True,
                    metavar=",".join(spec.choices or ()),
                    callback=_choices_list(spec.choices or ()),
                    help=spec.help,
                )(command)
                continue
            kind: Any
            if spec.choices is not None and spec.or_function:
                kind = ChoiceOrFunction(list(spec.choices))
            elif spec.choices is not None:
                kind = click.Choice(list(spec.choices))
            elif isinstance(default, int) and not isinstance(default, bool):
                kind = click.IntRange(
                    None if spec.low is None else int(spec.low), None if spec.high is None else int(spec.high)
                )
            elif spec.low is not None or spec.high is not None:
                kind = FiniteFloatRange(spec.low, spec.high, min_open=spec.low_open)
            else:
                kind = float
            command = click.option(flag, name, default=default, show_default=True, type=kind, help=spec.help)(
                command
            )
        return command

    return decorate


def _choices_list(choices: tuple[str, ...]) -> Any:
    def parse(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
        names = tuple(s.strip() for s in value.split(",") if s.strip())
        if not names or any(n not in choices for n in names):
            raise click.BadParameter(
                f"expected a list of {', '.join(choices)}; got {value!r}", ctx=ctx, param=param
            )
        return names

    return parse


def refuse_unknown_option(ctx: click.Context, word: str) -> None:
    """A command that takes a script and its arguments (``run``) sees a misspelt option as the
    script: ``--stal`` is "no such option --stal; did you mean --stall?" (exit 2)."""
    if not word.startswith("-"):
        return
    import difflib

    flag = word.split("=", 1)[0]
    known = [opt for param in ctx.command.params for opt in param.opts if opt.startswith("-")]
    close = difflib.get_close_matches(flag, known, n=1)
    raise click.UsageError(f"no such option {flag}" + (f"; did you mean {close[0]}?" if close else ""))


def refuse_module(module: str) -> None:
    """``run -m MODULE`` is refused (exit 2) with the module's file where it can be found:
    running a module as ``python -m`` does (its package, ``__main__``) is not supported yet."""
    import importlib.util

    if not module:
        raise click.UsageError("-m needs a MODULE, and running one as python -m does is not supported yet")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    origin = spec.origin if spec is not None and spec.origin not in (None, "built-in", "frozen") else None
    hint = f": gpudiag run {origin} ARGS" if origin else " as SCRIPT (path/to/train.py)"
    raise click.UsageError(
        f"-m {module}: running a module as python -m does is not supported yet; give its file{hint}"
    )
