"""``gpudiag replay BUNDLE``: run a bundle's checks here and say what differs.

Each check the reporter ran is run again with its recorded configuration (virtual devices
laid out like the bundle's ``machine.json`` where the reporter used one). Results match
when the status and the finding codes are the same and the numbers agree within
tolerance: what each check's registry entry compares (``compare``,
:mod:`gpudiag.checks.compare_results`: gradcheck's per-strategy agreement and norm ratio,
nancheck's status and first bad step per run, peer's wrong copies per direction, topology's
link per pair). A check that cannot run here is ``skipped``
with the reason and left out of the verdict; a check that errored here shows its error. The
verdict is ``match`` (exit 0), ``differs`` (exit 1) or ``nothing-compared`` (exit 3: no check
could run here as it ran there — never a match). The two environments' differences are listed too.

A bundle is input from someone else. Before anything runs, every recorded configuration is
checked field by field (:mod:`gpudiag.repro.bundle_checks`: wrong types, unknown fields,
sizes beyond its limits are an :class:`~gpudiag.errors.InputError` naming the field). Code the
bundle names — a ``--model`` that is a Python file or module — runs only with
``trust=True`` (``--trust-bundle``); without it that check is skipped and the reason says
what would run. A model file runs from the copy the bundle carries (``model/NAME.py``, or the
``MODEL_SOURCES`` of an older bundle's ``repro.py``), whatever the folder replay runs in; only
a bundle that carries none falls back to the path it names, on this machine. gpudiag's
built-in models and torchvision architectures are gpudiag's or torchvision's code, not the
bundle's, and run (trained weights, which would be downloaded, are refused as bad input).
"""

from __future__ import annotations

import ast
import dataclasses
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpudiag.checks import registry
from gpudiag.checks.suite import CheckRun, Here, run_check
from gpudiag.progress import note
from gpudiag.repro.bundle import Bundle
from gpudiag.repro.bundle_checks import check_configs

SCHEMA = "gpudiag.replay/1"
#: env sections whose differences are worth showing (not compared for the verdict).
ENV_SECTIONS = ("versions", "visibility", "variables", "flags", "iommu", "packages", "gpus")
#: Exit codes per verdict: nothing compared is not a match (no check could run here as there).
EXIT_CODES = {"match": 0, "differs": 1, "nothing-compared": 3}


@dataclass
class CheckReplay:
    name: str
    recorded: CheckRun
    here: CheckRun | None
    differences: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def compared(self) -> bool:
        """Whether the results were compared (the environment is listed, not judged)."""
        return self.name != "env" and self.here is not None and self.here.status != "skipped"

    @property
    def match(self) -> bool:
        return not self.compared or not self.differences

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "recorded": _state(self.recorded),
            "here": None if self.here is None else _state(self.here),
            "compared": self.compared,
            "match": self.match,
            "differences": self.differences,
            "note": self.note,
        }


@dataclass
class ReplayReport:
    bundle: str
    checks: list[CheckReplay]
    environment: list[str]
    trusted: bool = False  # whether code named by the bundle was allowed to run
    rehearsal: str | None = None  # the bundle's faults were injected (its report.json says so)

    def __repr__(self) -> str:
        return f"<ReplayReport {'match' if self.match else 'differs'} · checks {len(self.checks)}>"

    @property
    def verdict(self) -> str:
        """``match``, ``differs``, or ``nothing-compared`` when no check ran here as it ran there."""
        if not any(c.compared for c in self.checks):
            return "nothing-compared"
        return "match" if all(c.match for c in self.checks) else "differs"

    @property
    def match(self) -> bool:
        return self.verdict == "match"

    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "bundle": self.bundle,
            "verdict": self.verdict,
            "match": self.match,
            "trusted": self.trusted,
            "rehearsal": self.rehearsal,
            "checks": [c.to_json() for c in self.checks],
            "environment_differences": self.environment,
        }


def replay(bundle: Bundle, here: Here | None = None, *, trust: bool = False) -> ReplayReport:
    """Re-run every check the bundle ran (not the ones it skipped) and compare. Every
    configuration is checked first; code named by the bundle runs only with ``trust``."""
    check_configs(bundle)
    if here is None:
        here = Here.detect()
        here.machine = bundle.machine()
        here.machine_source = f"{bundle.path}/machine.json" if here.machine is not None else None
    # (what the recorded configurations name inside the bundle: its NCCL logs, its hang dumps)
    here = dataclasses.replace(here, files=bundle.files)
    replays: list[CheckReplay] = []
    with tempfile.TemporaryDirectory(prefix="gpudiag-replay-") as folder:  # (the bundle's model files)
        env_here = _replay_checks(bundle, here, trust, Path(folder), replays)
    environment = env_differences(bundle.document.get("env"), env_here.result if env_here else None)
    rehearsal = bundle.document.get("rehearsal")
    rehearsal = rehearsal if isinstance(rehearsal, str) else None
    return ReplayReport(bundle.path, replays, environment, trusted=trust, rehearsal=rehearsal)


def _replay_checks(
    bundle: Bundle, here: Here, trust: bool, folder: Path, replays: list[CheckReplay]
) -> CheckRun | None:
    """Run each recorded check again into ``replays``; the env check's run here, if any."""
    env_here: CheckRun | None = None
    for recorded in bundle.checks:
        if recorded.status == "skipped" or recorded.config is None:
            replays.append(
                CheckReplay(recorded.name, recorded, None, note="skipped on the reporter's machine")
            )
            continue
        untrusted = None if trust else bundle_code(recorded.config)
        config, carried = recorded.config, ""
        if untrusted is None and trust:
            config, carried = carried_model(recorded.config, bundle, folder)
        why = cannot_run_here(recorded, here)
        if untrusted is not None:
            now = CheckRun(recorded.name, "skipped", _untrusted_reason(untrusted), recorded.config)
        elif why is not None:
            now = CheckRun(recorded.name, "skipped", why, recorded.config)
        else:
            note(f"replay: {recorded.name}")
            now = run_check(recorded.name, config, here)
            now.config = recorded.config  # (as the reporter gave it, not this replay's copy)
        if recorded.name == "env":
            env_here = now
        item = CheckReplay(recorded.name, recorded, now)
        if untrusted is not None:
            item.note = now.headline
        elif now.status == "skipped":
            item.note = f"cannot run here: {now.headline}"
        elif recorded.name != "env":
            item.differences = compare(recorded, now)
            item.note = "; ".join(filter(None, [_meaning(recorded, now, item.differences), carried]))
        replays.append(item)
    return env_here


def carried_model(config: dict[str, Any], bundle: Bundle, folder: Path) -> tuple[dict[str, Any], str]:
    """``config`` with a ``--model`` file replaced by the copy the bundle carries (written into
    ``folder``), and a note saying which file ran; ``config`` as it is for other models."""
    spec = config.get("model")
    if not isinstance(spec, str):
        return config, ""
    text, mark, query = spec.partition("?")
    target, _, attr = text.rpartition(":")
    from gpudiag.models import BUNDLE_MODEL_FOLDER

    if not (target.endswith(".py") or "/" in target):  # (mymodel:build, given beside mymodel.py)
        carried = bundle.files.get(f"{BUNDLE_MODEL_FOLDER}/{target}.py")
        if carried is None:
            return config, ""
        target = f"{target}.py"
    name = Path(target).name
    source = bundle.files.get(f"{BUNDLE_MODEL_FOLDER}/{name}")
    if source is None:
        source = _repro_sources(bundle).get(name)
    if source is None:
        return config, (
            f"the bundle carries no copy of {name}: ran {target} of this machine"
            if Path(target).is_file()
            else ""
        )
    path = folder / name
    path.write_bytes(source)
    return {**config, "model": f"{path}:{attr}{mark}{query}"}, f"ran the bundle's copy of {name}"


def _repro_sources(bundle: Bundle) -> dict[str, bytes]:
    """``MODEL_SOURCES`` of the bundle's ``repro.py`` (where bundles before ``model/`` kept a
    failing check's model file), read as a literal: nothing in it runs."""
    data = bundle.files.get("repro.py")
    if data is None:
        return {}
    try:
        tree = ast.parse(data.decode("utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "MODEL_SOURCES":
            try:
                sources = ast.literal_eval(node.value) if node.value is not None else {}
            except (ValueError, SyntaxError):
                return {}
            if isinstance(sources, dict):
                return {
                    k: v.encode() for k, v in sources.items() if isinstance(k, str) and isinstance(v, str)
                }
    return {}


def _untrusted_reason(what: str) -> str:
    return f"not run: {what} — code the bundle names, not gpudiag's; rerun with --trust-bundle to run it"


def bundle_code(config: dict[str, Any]) -> str | None:
    """What code outside gpudiag and torchvision ``config`` would run (its ``--model``), in
    words; None when it runs only gpudiag's built-in models or a torchvision architecture."""
    from gpudiag.models import BUILTINS

    spec = config.get("model")
    if not isinstance(spec, str):
        return None
    text = spec.partition("?")[0]
    if text in BUILTINS:
        return None
    if text.startswith("torchvision:"):
        return None  # (trained weights, which would be downloaded, are refused by check_configs)
    target, _, attr = text.rpartition(":")
    if target.endswith(".py") or "/" in target:
        return f"--model {spec!r} would run the Python file {target} and call {attr}()"
    return f"--model {spec!r} would import the module {target} and call {target}.{attr}()"


def cannot_run_here(recorded: CheckRun, here: Here) -> str | None:
    """Why ``recorded`` cannot be run the same way here (None: it can): NVML that is not
    here, or CUDA GPUs the reporter used that this machine lacks."""
    config, result = recorded.config or {}, recorded.result or {}
    if recorded.name == "topology" and config.get("machine") is None and here.nvml is not None:
        return f"the reporter read the topology from NVML, which is not available here ({here.nvml})"
    if recorded.name in ("peer", "nancheck") and config.get("machine") is None:
        if recorded.name == "peer":
            used = {p[k] for p in result.get("pairs", []) for k in ("src", "dst")}
        else:
            used = {s["device"] for s in result.get("singles", [])}
            used |= {p[k] for p in result.get("pairs", []) for k in ("a", "b")}
        if any(not 0 <= g < here.cuda_gpus for g in used):
            gpus = ", ".join(map(str, sorted(used)))
            return (
                f"the reporter ran {recorded.name} on CUDA GPU(s) {gpus}; here {here.cuda_gpus} CUDA GPU(s)"
            )
    if recorded.name == "gradcheck":
        run_config = result.get("config")
        devices = run_config.get("devices") if isinstance(run_config, dict) else None
        ids = devices.get("ids") if isinstance(devices, dict) else None
        if (
            isinstance(devices, dict)
            and devices.get("kind") == "cuda"
            and isinstance(ids, list)
            and len(ids) > here.cuda_gpus
        ):
            return (
                f"the reporter ran gradcheck on {len(ids)} CUDA GPU(s); here {here.cuda_gpus} "
                "(CPU virtual devices would not be the same run)"
            )
    return None


def _state(run: CheckRun) -> dict[str, Any]:
    return {"status": run.status, "simulated": run.simulated, "codes": _codes(run)}


def _codes(run: CheckRun) -> list[str]:
    return sorted({f.code for f in run.findings if f.severity != "info"})


def _meaning(recorded_run: CheckRun, here_run: CheckRun, differences: list[str]) -> str:
    bad = ("fail", "error")
    recorded, here = recorded_run.status, here_run.status
    if here == "error":  # what went wrong here comes first: it is why nothing else was compared
        return f"error here: {here_run.headline}"
    if not differences:
        return "same result"
    if recorded == "error":
        return f"error on the reporter's machine: {recorded_run.headline}"
    if recorded in bad and here not in bad:
        return "fails on the reporter's machine, passes here: hardware-specific (or see the environment)"
    if here in bad and recorded not in bad:
        return "passes on the reporter's machine, fails here"
    return "different result"


def compare(recorded: CheckRun, here: CheckRun) -> list[str]:
    """What differs between the recorded run of a check and this one (empty: they match)."""
    out = []
    if recorded.status != here.status:
        out.append(f"status: {recorded.status} there, {here.status} here")
    was, now = set(_codes(recorded)), set(_codes(here))
    if was - now:
        out.append(f"findings only there: {', '.join(sorted(was - now))}")
    if now - was:
        out.append(f"findings only here: {', '.join(sorted(now - was))}")
    numbers = registry.get(recorded.name).compare
    if numbers is not None and recorded.result and here.result:
        out += numbers(recorded.result, here.result)
    return out


def env_differences(there: dict[str, Any] | None, here: dict[str, Any] | None) -> list[str]:
    """``section.field: value there → value here`` for what differs between two env documents."""
    if not there or not here:
        return [] if there == here else ["environment: recorded on one side only"]
    out = []
    for section in ENV_SECTIONS:
        a = there.get("sections", {}).get(section, {}) or {}
        b = here.get("sections", {}).get(section, {}) or {}
        for name in sorted(a.keys() | b.keys()):
            if a.get(name) != b.get(name):
                out.append(f"{section}.{name}: {_short(a.get(name))} there, {_short(b.get(name))} here")
    return out


def _short(value: Any) -> str:
    text = "unset" if value is None else str(value)
    return text if len(text) <= 60 else text[:57] + "..."
