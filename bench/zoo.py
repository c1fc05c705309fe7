"""Model zoo: gradcheck (single vs DataParallel vs DDP) over many models, one table.

    .venv/bin/python bench/zoo.py [--only NAME,...] [--fast] [--world-size 2] [--markdown] [--list]

Runs ``gpudiag.checks.gradcheck.gradcheck`` on CPU virtual devices for

- 21 torchvision classification models of different families (``TORCHVISION``), each
  built from a ``torchvision:NAME?num_classes=10&…`` spec with ``resolve_model`` at the
  smallest input resolution that works and keeps it cheap, on ``random_batch``;
- the torch-only models of ``bench/zoo_models.py`` (``ZOO_EXTRA``): language models,
  recurrent and EmbeddingBag classifiers, tied weights, buffers written in forward,
  conditionally unused parameters, tuple / keyword inputs, tuple / dict / ModelOutput
  outputs, and models that draw random numbers in forward without a dropout module.

Every model declares the causes a healthy machine gives at world size 2 (the codes of
gradcheck's warning and error findings; none: verdict ``pass``): BatchNorm in train mode
``batchnorm-per-replica``, any random draw in forward ``dropout-active``, parameters the
loss does not reach ``unused-parameters``.

Prints one row per model as it finishes — model, parameters (millions), verdict,
``expected`` (``ok``, or ``missing X`` / ``unexpected Y`` where the causes differ from
the declared ones), causes, seconds (gradcheck alone) — and as its last line
``zoo: N models, F fail, C crash, W wrong cause``. A model that raises is a ``crash`` row
(the exception's type and first line) and the run goes on. F, C and W are counted each on
its own (a ``fail`` whose causes differ counts in F and in W). Exit status 1 if any of
them is non-zero, 2 for a bad ``--only``. The declared causes hold for world size 2 only:
with another ``--world-size`` the ``expected`` column says ``unchecked`` and W is 0.

``--fast``: a handful of cheap models (``FAST``).
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import inspect
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent


def _load_zoo_models() -> Any:
    """``bench/zoo_models.py`` as a module, registered with cloudpickle so DDP ranks that
    start as fresh interpreters get its models by value (they cannot import it by name)."""
    name = "zoo_models"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, HERE / "zoo_models.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    import cloudpickle

    cloudpickle.register_pickle_by_value(module)
    return module


zoo_models = _load_zoo_models()

NUM_CLASSES = 10
#: The world size the declared causes are for.
EXPECTED_WORLD_SIZE = 2

BN, DROP, UNUSED = zoo_models.BATCHNORM, zoo_models.DROPOUT, zoo_models.UNUSED


@dataclass(frozen=True)
class TV:
    """A torchvision model: builder name, the causes gradcheck must give for it, extra
    constructor kwargs (a spec query), the input resolution and batch size gradcheck runs
    it at, and why (if not the defaults)."""

    name: str
    expected: frozenset[str]
    query: str = ""
    resolution: int = 32
    batch_size: int = 8
    why: str = ""

    @property
    def spec(self) -> str:
        query = "&".join(filter(None, [f"num_classes={NUM_CLASSES}", self.query]))
        return f"torchvision:{self.name}?{query}"


def _set(*codes: str) -> frozenset[str]:
    return frozenset(codes)


#: Resolutions and batch sizes: the smallest input each takes (32 px where it works). One
#: forward+backward at batch 8 on the 2-core CPU (fresh process, 2nd/3rd iteration,
#: 2026-11-23) took 0.01-0.34 s for all but maxvit_t (2.5-2.7 s at 224 px; 1.3-1.5 s at
#: batch 4). A gradcheck's time grows with the parameter count too: vgg11_bn (129M) took
#: about 24 s, mostly comparing gradients and copying weights, whatever the resolution.
#: Causes: BatchNorm modules (train mode, 4 samples per replica) give BN; nn.Dropout with
#: p > 0 (classifier heads), stochastic depth (``StochasticDepth``: ``bernoulli_``) and
#: GoogLeNet's aux-head ``F.dropout`` give DROP; dropout 0 (vit_b_16, densenet121's
#: drop_rate) draws nothing.
TORCHVISION = [
    TV("resnet18", _set(BN)),
    TV("resnet50", _set(BN)),
    TV("resnext50_32x4d", _set(BN)),
    TV("wide_resnet50_2", _set(BN)),
    TV("densenet121", _set(BN)),
    TV("efficientnet_b0", _set(BN, DROP), why="stochastic depth 0.2 (StochasticDepth modules) + dropout 0.2"),
    TV("efficientnet_v2_s", _set(BN, DROP), why="stochastic depth 0.2 + dropout 0.2"),
    TV("mobilenet_v2", _set(BN, DROP)),
    TV("mobilenet_v3_small", _set(BN, DROP)),
    TV("shufflenet_v2_x0_5", _set(BN)),
    TV("regnet_y_400mf", _set(BN)),
    TV("mnasnet0_5", _set(BN, DROP)),
    TV("squeezenet1_1", _set(DROP)),
    TV(
        "googlenet",
        _set(UNUSED, BN, DROP),
        "aux_logits=true&init_weights=true",
        why="aux_logits: a GoogLeNetOutputs (logits, aux2, aux1) namedtuple in training; the aux heads "
        "get no gradient from a loss on the logits",
    ),
    TV(
        "inception_v3",
        _set(BN, DROP),
        "aux_logits=false&init_weights=true",
        75,
        why="75 px is the smallest input; its aux head needs a 17x17 Mixed_6 map (about 299 px): off",
    ),
    TV(
        "vgg11_bn",
        _set(BN, DROP),
        why="129M parameters: AdaptiveAvgPool2d(7) feeds a 25088x4096 Linear at any resolution",
    ),
    TV("alexnet", _set(DROP), resolution=63, why="63 px is the smallest input its three max-pools take"),
    TV(
        "vit_b_16",
        _set(),
        "image_size=32",
        why="image_size=32: 2x2 patches of 16 + the class token; dropout 0, LayerNorm: nothing to explain",
    ),
    TV("swin_t", _set(DROP), why="stochastic depth 0.2; windows pad small maps; LayerNorm"),
    TV("convnext_tiny", _set(DROP), why="stochastic depth 0.1; LayerNorm"),
    TV(
        "maxvit_t",
        _set(BN, DROP),
        "input_size=(224,224)",
        224,
        batch_size=4,
        why="partition size 7 is fixed by maxvit_t: 224 px (7x7 at stride 32) is the smallest input; batch 4",
    ),
]

#: Cheap models for --fast: a plain CNN, BatchNorm + depthwise, a tuple output, a causal
#: transformer, unused parameters, buffers written in forward, keyword inputs.
FAST = (
    "resnet18",
    "mobilenet_v3_small",
    "googlenet",
    "transformer_lm",
    "conditionally_unused",
    "buffer_mutating",
    "tuple_output",
    "dict_input",
)


@dataclass(frozen=True)
class Case:
    """One row of the zoo: a torchvision model or a ``zoo_models.Extra``."""

    name: str
    tv: TV | None = None
    extra: Any = None  # zoo_models.Extra

    @property
    def expected(self) -> frozenset[str]:
        return self.tv.expected if self.tv is not None else self.extra.expected

    def prepare(self, seed: int = 0) -> tuple[Callable[[], torch.nn.Module], Any, torch.Tensor, Any, Any]:
        """``(factory, inputs, targets, loss, output)``."""
        if self.tv is not None:
            from gpudiag.models import random_batch, resolve_model

            shape = (3, self.tv.resolution, self.tv.resolution)
            factory = resolve_model(self.tv.spec, shape, NUM_CLASSES)
            inputs, targets = random_batch(factory, self.tv.batch_size, shape, NUM_CLASSES, "ce", seed)
            return factory, inputs, targets, "ce", None
        inputs, targets = self.extra.make_batch(8, seed)
        return self.extra.factory, inputs, targets, self.extra.loss, self.extra.output


def cases() -> list[Case]:
    return [Case(tv.name, tv=tv) for tv in TORCHVISION] + [
        Case(name, extra=entry) for name, entry in zoo_models.ZOO_EXTRA.items()
    ]


@dataclass
class Row:
    name: str
    params_m: float | None
    verdict: str
    causes: list[str]  # finding codes (warning, error), in order; a crash: its text
    expected: frozenset[str] | None  # None: not checked (another world size)
    seconds: float

    @property
    def crashed(self) -> bool:
        return self.verdict == "crash"

    @property
    def missing(self) -> list[str]:
        if self.crashed or self.expected is None:
            return []
        return sorted(self.expected - set(self.causes))

    @property
    def unexpected(self) -> list[str]:
        if self.crashed or self.expected is None:
            return []
        return [c for c in self.causes if c not in self.expected]

    @property
    def wrong_cause(self) -> bool:
        return bool(self.missing or self.unexpected)

    @property
    def failed(self) -> bool:
        return self.verdict == "fail" or self.crashed or self.wrong_cause

    def expected_text(self) -> str:
        if self.crashed:
            return "-"
        if self.expected is None:
            return "unchecked"
        parts = [f"missing {', '.join(self.missing)}"] if self.missing else []
        parts += [f"unexpected {', '.join(self.unexpected)}"] if self.unexpected else []
        return "; ".join(parts) or "ok"


def _causes(report: Any) -> list[str]:
    return list(dict.fromkeys(f.code for f in report.findings if f.severity in ("warning", "error")))


def _crash_text(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def run_case(case: Case, world_size: int = EXPECTED_WORLD_SIZE) -> Row:
    """gradcheck on ``case``; any exception becomes a ``crash`` row."""
    from gpudiag.checks.gradcheck import gradcheck

    expected = case.expected if world_size == EXPECTED_WORLD_SIZE else None
    params_m: float | None = None
    start = time.perf_counter()
    try:
        factory, inputs, targets, loss, output = case.prepare()
        params_m = sum(p.numel() for p in factory().parameters()) / 1e6
        start = time.perf_counter()
        report = gradcheck(factory, inputs, targets, world_size=world_size, loss=loss, output=output)
        seconds = time.perf_counter() - start
        return Row(case.name, params_m, report.verdict, _causes(report), expected, seconds)
    except Exception as exc:
        return Row(case.name, params_m, "crash", [_crash_text(exc)], expected, time.perf_counter() - start)


class Table:
    """Rows printed as they come (plain text with fixed columns, or Markdown)."""

    def __init__(self, width: int, markdown: bool):
        self.width, self.markdown = width + 1, markdown

    def _line(self, cells: list[str]) -> str:
        name, params, verdict, expected, seconds, causes = cells
        if self.markdown:
            return f"| {name} | {params} | {verdict} | {expected} | {causes} | {seconds} |"
        return f"{name:<{self.width}} {params:>8} {verdict:<9} {seconds:>7}  {expected:<10} {causes}"

    def header(self) -> None:
        print(self._line(["model", "params M", "verdict", "expected", "seconds", "causes"]))
        if self.markdown:
            print("|---|---:|---|---|---|---:|")
        else:
            print("-" * (self.width + 60))

    def row(self, row: Row) -> None:
        params = "?" if row.params_m is None else f"{row.params_m:.{2 if row.params_m >= 0.01 else 4}f}"
        name = f"`{row.name}`" if self.markdown else row.name
        causes = ", ".join(row.causes) or "-"
        cells = [name, params, row.verdict, row.expected_text(), f"{row.seconds:.1f}", causes]
        print(self._line(cells), flush=True)


def _list(selected: list[Case]) -> None:
    for c in selected:
        expected = ", ".join(sorted(c.expected)) or "pass"
        if c.tv is not None:
            print(
                f"{c.name}: {c.tv.spec} at {c.tv.resolution} px, batch {c.tv.batch_size}; "
                f"expected {expected}  {c.tv.why}"
            )
        else:
            factory = c.extra.factory
            doc = inspect.getdoc(factory) or inspect.getdoc(factory()) or ""
            doc = " ".join(doc.split("\n\n")[0].split())
            print(
                f"{c.name}: zoo_models.{factory.__name__}, loss={c.extra.loss}, output={c.extra.output!r}; "
                f"expected {expected}  {doc}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated model names")
    parser.add_argument("--fast", action="store_true", help=f"only the cheap ones: {', '.join(FAST)}")
    parser.add_argument("--world-size", type=int, default=EXPECTED_WORLD_SIZE)
    parser.add_argument("--markdown", action="store_true", help="a Markdown table")
    parser.add_argument("--list", action="store_true", help="list the models and their settings, run nothing")
    args = parser.parse_args(argv)

    selected = cases()
    known = [c.name for c in selected]
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in known]
        if unknown:
            hints = []
            for n in unknown:
                close = difflib.get_close_matches(n, known)
                hints.append(f"{n} (did you mean {', '.join(close)}?)" if close else n)
            print(f"zoo: unknown model(s): {'; '.join(hints)}", file=sys.stderr)
            return 2
        selected = [c for c in selected if c.name in wanted]
    if args.fast:
        selected = [c for c in selected if c.name in FAST]
    if args.list:
        _list(selected)
        return 0

    table = Table(max(len(c.name) for c in selected) + 1, args.markdown)
    table.header()
    rows = []
    for case in selected:
        row = run_case(case, args.world_size)
        rows.append(row)
        table.row(row)
    fails = sum(r.verdict == "fail" for r in rows)
    crashes = sum(r.crashed for r in rows)
    wrong = sum(r.wrong_cause for r in rows)
    print(f"zoo: {len(rows)} models, {fails} fail, {crashes} crash, {wrong} wrong cause")
    return 1 if fails or crashes or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
