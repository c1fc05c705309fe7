"""The distributed sweep: run under ``torchrun``, every node checks itself, then the nodes
check the links between them, and rank 0 writes the results.

Per process (one per node, or one per GPU: the process with ``LOCAL_RANK`` 0 is the
node's *leader* and does the node's work, the others join the collectives):

1. **Local phase** (leaders, before joining the group, with torchrun's variables hidden so
   the checks start their own local ranks): the suite's checks (``env``, ``topology``,
   ``peer`` on every pair, ``nancheck`` per GPU and pair) through
   :func:`gpudiag.repro.report.run_report`, and the intra-node all-reduce bus bandwidth
   across the node's GPUs (``nccl-tests``' busbw: bytes / time × 2(n−1)/n) when it has ≥ 2.
2. **Join** the torchrun group through the runtime (:func:`gpudiag.runtime.launch`, which
   under torchrun joins ``env://`` instead of starting ranks).
3. **Between nodes**, each collective with a deadline and its progress in the group's
   store (so a rank that hangs is named: which rank, which collective): the records
   all-gathered; an all-reduce across every rank with a value check; the **pairwise link
   test** (:mod:`gpudiag.repro.sweep.judge`'s rounds: neighbours first, then every node of
   a bad pair with a known-good node), each pair an all-reduce group of its own, timed, with
   a value check.
4. **Gather**: each leader's record and redacted report bundle (a zip written on the node)
   to rank 0 (``gather_object``); rank 0 judges and writes the sweep folder.

The sweep pins ``NCCL_ALGO`` (default Ring) so figures compare, and turns on PyTorch's
flight recorder (:data:`~gpudiag.repro.sweep.flight.FLIGHT_RECORDER`; under NCCL also
its older ``TORCH_NCCL_*`` names, which NCCL's watchdog reads) with its dumps in the
sweep's own temporary folder, and ``TORCH_NCCL_NAN_CHECK``; dumps found there go into the
node's bundle (``flight/``), and when one of the sweep's collectives hangs each rank dumps
its record there itself (:func:`~gpudiag.repro.sweep.flight.dump_flight_recorder`). On
gloo (CPU) NCCL_ALGO and the NaN check have no effect.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpudiag.errors import InputError
from gpudiag.gcpause import paused
from gpudiag.repro.sweep.between import STALLABLE, Between, CollectiveHung, Outcome, between_nodes
from gpudiag.repro.sweep.budget import Budget
from gpudiag.repro.sweep.flight import DUMP_PREFIX, dump_flight_recorder, flight_settings
from gpudiag.repro.sweep.flight import FLIGHT_RECORDER as FLIGHT_RECORDER
from gpudiag.repro.sweep.flight import FLIGHT_RECORDER_NCCL as FLIGHT_RECORDER_NCCL
from gpudiag.repro.sweep.hosts import expected_hosts
from gpudiag.repro.sweep.judge import FleetVerdict, judge
from gpudiag.repro.sweep.node import LOCAL_CHECKS, Identity, Local, SweepOptions, local_phase
from gpudiag.repro.sweep.output import agree_on_output, check_output, not_a_sweep, post_record, posted_records
from gpudiag.repro.sweep.results import (
    NODES,
    RESULTS,
    RULES,
    RUN,
    RUN_SCHEMA,
    SUMMARY,
    check_record,
    results_jsonl,
    summary_markdown,
)
from gpudiag.repro.sweep.rules import load_baseline, load_rules

__all__ = ["LOCAL_CHECKS", "SweepOptions", "SweepRun", "rejudge", "sweep"]


#: How long rank 0 waits, once a collective failed, for every rank to say it still
#: answers (:meth:`~gpudiag.repro.sweep.between.Progress.silent`); the ranks that do not
#: are named (a node killed mid-sweep: its peers' collectives fail at once, on gloo).
CHECK_IN_S = 15.0


def _backend(options: SweepOptions, ident: Identity) -> str:
    """``nccl`` with CUDA GPUs (and no machine file), else ``gloo``; ``--backend nccl``
    without a CUDA GPU cannot run here (exit 3), nor a sweep alone on a node with no GPU
    and no machine file (nothing to check). Under torchrun such a node joins over gloo
    and is named ``node-no-gpus`` with the fleet."""
    from gpudiag.errors import CannotRunHere
    from gpudiag.hw.cuda import cuda_device_count

    gpus = cuda_device_count()
    if options.backend == "nccl" and gpus < 1:
        raise CannotRunHere("--backend nccl needs a CUDA GPU on every node; none here (gloo runs on CPUs)")
    if gpus < 1 and options.machine is None and not ident.torchrun:
        raise CannotRunHere(
            "no CUDA GPU here (torch sees none: check nvidia-smi) and no --machine: nothing to check "
            "(a machine file rehearses a node on CPU virtual devices)"
        )
    if options.backend != "auto":
        return options.backend
    return "nccl" if options.machine is None and gpus > 0 else "gloo"


@contextlib.contextmanager
def _pinned(scratch: Path, backend: str) -> Iterator[tuple[dict[str, str], dict[str, str]]]:
    """Pin NCCL_ALGO and turn the flight recorder and NaN check on (unless set) while
    active: before any process group exists, as PyTorch reads them when it creates one;
    what this process's environment was is restored after. Yields (what the sweep set,
    what the user had set already and it left alone): kept apart, so the sweep's own
    settings never pass for the user's (in host facts, in SUMMARY.md)."""
    wanted = flight_settings(backend, scratch)
    added = [k for k in wanted if k not in os.environ]
    kept = {k: os.environ[k] for k in wanted if k not in added}
    for key in added:
        os.environ[key] = wanted[key]
    try:
        yield {k: wanted[k] for k in added}, kept
    finally:
        for key in added:
            os.environ.pop(key, None)


# -- the whole run ---------------------------------------------------------------------


@dataclass
class SweepRun:
    """What a sweep produced: the verdict (on rank 0), the records, where it wrote them."""

    verdict: FleetVerdict | None
    records: list[dict[str, Any]]
    run: dict[str, Any]
    folder: Path | None
    ident: Identity

    @property
    def exit_code(self) -> int:
        if self.verdict is None:
            return 0
        return self.verdict.exit_code


def _bundle_bytes(report: Any, extra: dict[str, bytes], anonymize: bool) -> bytes:
    """The node's report bundle as zip bytes, redacted here on the node."""
    from gpudiag.redact import Redactor
    from gpudiag.repro.report import write_bundle

    report.files.update(extra)
    with tempfile.TemporaryDirectory(prefix="gpudiag-sweep-bundle-") as tmp:
        path = write_bundle(report, Path(tmp) / "bundle.zip", redactor=Redactor(anonymize=anonymize))
        return path.read_bytes()


def stall_cannot_fire(stall: str, ident: Identity) -> str | None:
    """Why ``--inject-stall STALL`` would never be reached in this run, or None: outside
    torchrun there is no between-node phase; on one node no pairwise link test (its
    ``pair-round1`` and ``gather-round1``). Refused before anything runs, as ``--inject``
    specs that cannot fire are."""
    if not ident.torchrun:
        return "not under torchrun: a fleet of one runs no between-node collective"
    if stall in ("pair-round1", "gather-round1") and ident.nodes < 2:
        return "one node: there is no pairwise link test"
    return None


def sweep(options: SweepOptions, environ: Mapping[str, str] | None = None) -> SweepRun:
    """Run the sweep from this process (a torchrun rank, or alone: a fleet of one).
    Inputs are checked first (rules, baseline, expected hosts, the output folder: exit 2)."""
    env = os.environ if environ is None else environ
    ident = Identity.detect(env)
    rules = load_rules(options.rules)
    baseline = load_baseline(options.baseline)
    hosts, hosts_from = expected_hosts(options.expect_hosts, env)
    folder = refusal = None
    if ident.rank == 0:
        try:
            folder = check_output(options)
        except InputError as exc:
            refusal = exc
    if ident.torchrun and ident.world > 1:  # every node learns rank 0's answer, before any group
        agree_on_output(ident, refusal, env, options.phase_timeout)
    if refusal is not None:
        raise refusal
    stall = None if options.stall is None else options.stall.removesuffix(":kill")
    if stall is not None and stall not in STALLABLE:
        raise InputError(
            f"--inject-stall {options.stall!r}: expected one of {', '.join(STALLABLE)} "
            "(NAME:kill: the node's process is killed there instead)"
        )
    if stall is not None and (why := stall_cannot_fire(stall, ident)):
        raise InputError(
            f"--inject-stall {options.stall}: it cannot fire here ({why}); a rehearsed hang that never "
            "happens would pass as a healthy sweep"
        )
    backend = _backend(options, ident)
    budget = Budget.for_quick(options.quick) if options.budget is None else Budget(options.budget)
    from gpudiag.cleanup import track, untrack
    from gpudiag.runtime.launch import signals_held

    with signals_held():  # (removed by the CLI's clean-up too, if a signal stops the process)
        scratch = track(Path(tempfile.mkdtemp(prefix="gpudiag-sweep-")))
    started = time.perf_counter()
    try:
        with _pinned(scratch, backend) as settings:
            judged = (rules, baseline, hosts, hosts_from, folder)
            return _run(options, ident, backend, scratch, settings, started, judged, budget)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        untrack(scratch)


def _run(
    options: SweepOptions,
    ident: Identity,
    backend: str,
    scratch: Path,
    settings: tuple[dict[str, str], dict[str, str]],
    started: float,
    judged: tuple[Any, ...],
    budget: Budget,
) -> SweepRun:
    """The local phase, the between-node phase (under torchrun), then rank 0's verdict."""
    rules, baseline, hosts, hosts_from, folder = judged
    local = local_phase(options, ident, backend, budget, set(settings[0])) if ident.leader else None
    out = Outcome()
    if local is not None:
        out.records = {ident.node: local.record}
    if not ident.torchrun:  # a fleet of one: nothing between nodes
        out.notes.append("not under torchrun: a fleet of one node (no between-node tests to compare with)")
    else:
        if local is not None:  # (rank 0 reads it there if the group never forms or fails early)
            post_record(ident, local.record, os.environ, options.phase_timeout)
        _between(options, ident, backend, local, out, scratch, budget)
    if ident.rank != 0:
        return SweepRun(None, [], {}, None, ident)
    if ident.torchrun and len(out.records) < ident.nodes:  # a node lost: the others' records still count
        for number, posted in posted_records(ident.nodes, os.environ, options.phase_timeout).items():
            if number not in out.records:
                with contextlib.suppress(InputError, ValueError, KeyError, TypeError):
                    out.records[number] = check_record(json.loads(posted), f"node {number}")
    if local is not None and ident.host not in out.bundles:  # (alone, or the gather failed)
        files = _node_files(out, ident, scratch)
        out.bundles[ident.host] = _bundle_bytes(local.report, files, options.anonymize)
    return _finish(
        options, ident, out, rules, baseline, (hosts, hosts_from), backend, settings, folder, started
    )


def _node_files(out: Outcome, ident: Identity, scratch: Path) -> dict[str, bytes]:
    """What a node adds to its bundle: its sweep record and the flight recorder's dumps."""
    mine = out.records.get(ident.node, {})
    files = {"sweep/node.json": (json.dumps(mine, indent=1) + "\n").encode()}
    files.update(
        {f"flight/{p.name}": p.read_bytes() for p in sorted(scratch.glob(f"{DUMP_PREFIX}*")) if p.is_file()}
    )
    return files


def _between(
    options: SweepOptions,
    ident: Identity,
    backend: str,
    local: Local | None,
    out: Outcome,
    scratch: Path,
    budget: Budget,
) -> None:
    """Join the torchrun group through the runtime and run the between-node phase; each
    leader's bundle goes to rank 0 last (``gather_object``). Each collective's deadline is
    the phase's, capped by what is left of a ``--quick`` budget."""
    from gpudiag.runtime import RankFailure, launch

    deadline = budget.cap(options.phase_timeout)

    def rank_fn(rank: int, world: int) -> bytes:
        b = Between(ident, options, backend, deadline, budget)
        if local is not None:  # (in the store too: rank 0 has it if a collective fails before the gather)
            b.progress.post(f"record/{ident.node}", json.dumps({"record": local.record, "rank": rank}))
        try:
            between_nodes(b, None if local is None else local.record, out)
            payload = None
            if local is not None:
                files = _node_files(out, ident, scratch)
                payload = (ident.host, _bundle_bytes(local.report, files, options.anonymize))
            gathered = b.gather_to_first("gather-bundles", payload)
            out.bundles = {host: data for host, data in (g for g in gathered if g is not None)}
        except CollectiveHung as exc:
            out.failure = exc
            b.progress.check_in()  # (this rank still answers: rank 0 names those that do not)
            out.stuck = b.progress.stuck(exc.name) if rank == 0 else []
            if rank == 0 and not out.stuck:  # every rank was in the same place: who is gone?
                wait = min(b.timeout, CHECK_IN_S)
                out.stuck = [
                    (r, f"in {exc.name} (its process ended or its node went away)")
                    for r in b.progress.silent(wait)
                ]
            if rank == 0:  # the records of nodes that sent one before the failure
                for number in range(ident.nodes):
                    posted = None if number in out.records else b.progress.posted(f"record/{number}")
                    if posted is not None:
                        with contextlib.suppress(InputError, ValueError, KeyError, TypeError):
                            out.records[number] = check_record(json.loads(posted)["record"], f"node {number}")
            dump_flight_recorder(scratch, rank, backend)  # (rank 0's goes into its bundle)
            raise
        return b""

    try:
        # (under NCCL the group's own timeout, at which its watchdog ends the process, is
        # twice the collectives' deadline: rank 0 names the hung rank and writes first)
        timeout = deadline * (2 if backend == "nccl" else 1)
        launch(rank_fn, ident.world, backend=backend, timeout=timeout)
    except (CollectiveHung, RankFailure, RuntimeError) as exc:  # (joining the group timed out)
        if out.failure is None:
            out.failure = exc


def _finish(
    options: SweepOptions,
    ident: Identity,
    out: Outcome,
    rules: dict[str, Any],
    baseline: dict[str, dict[str, float]],
    expected: tuple[list[str], str | None],
    backend: str,
    settings: tuple[dict[str, str], dict[str, str]],
    folder: Path | None,
    started: float,
) -> SweepRun:
    """Rank 0: name the ranks that hung, judge what arrived, write the sweep folder."""
    notes = list(out.notes)
    records = out.ordered()
    if out.failure is not None:
        notes.append(f"the sweep stopped: {out.failure}")
        by_rank = {int(r.get("rank", -1)): r for r in records}
        for rank, where in out.stuck:
            problem = {
                "code": "node-hung",
                "message": f"rank {rank} stopped answering {where} (deadline {options.phase_timeout:g} s)",
                "expected": "an answer",
                "measured": None,
            }
            if rank in by_rank:
                by_rank[rank]["problems"] = [*(by_rank[rank].get("problems") or []), problem]
            else:
                notes.append(
                    f"rank {rank} (not a node leader, or never sent its record) stopped answering {where}"
                )
        if not out.stuck:
            notes.append("no rank stands out as behind: every rank was in the same collective")
    if backend == "gloo":
        notes.append(
            "gloo backend (CPU): NCCL_ALGO and TORCH_NCCL_NAN_CHECK were set but gloo does not use them "
            "(the flight recorder records gloo's collectives too, on PyTorch ≥ 2.15)"
        )
    hosts, hosts_from = expected
    verdict = judge(records, expected_hosts=hosts, rules=rules, baseline=baseline, expected_nodes=ident.nodes)
    if out.failure is not None:
        if verdict.exit_code == 0:
            verdict.notes.append("the sweep did not finish (see the notes): exit 1")
        verdict.failed = True
    run = {
        "schema": RUN_SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": list(options.argv) or ["gpudiag", *sys.argv[1:]],
        "backend": backend,
        "world_size": ident.world,
        "nodes": ident.nodes,
        "expected_hosts": hosts,
        "expected_from": hosts_from,
        "pinned": settings[0],  # set by the sweep for its run
        "user_settings": settings[1],  # of the same variables, set by the user: left alone
        # every node's rehearsed faults (each node has its own options), by host
        "injected": [
            f"{rec['host']}: {spec}"
            for rec in sorted(records, key=lambda r: int(r.get("node", 0)))
            for spec in [
                *(rec.get("injected") or []),
                *([f"delay {rec['delay_s']} s"] if rec.get("delay_s") else []),
            ]
        ],
        "quick": options.quick,
        "phase_timeout_s": options.phase_timeout,
        "message_bytes": options.nbytes,
        "seconds": round(time.perf_counter() - started, 3),
        "finished": out.failure is None,
        "notes": notes,
    }
    if options.anonymize:  # (the records were anonymized on their nodes; the hosts expected stay)
        from gpudiag.redact import Redactor

        masked = Redactor(anonymize=True)
        run.update({key: masked.data(run[key]) for key in ("command", "pinned", "user_settings", "notes")})
    if folder is not None:
        write_sweep(folder, records, run, rules, verdict, out.bundles, force=options.force)
    return SweepRun(verdict, records, run, folder, ident)


def write_sweep(
    folder: Path,
    records: list[dict[str, Any]],
    run: dict[str, Any],
    rules: dict[str, Any],
    verdict: FleetVerdict,
    bundles: dict[str, bytes],
    *,
    force: bool,
) -> Path:
    """The sweep folder, written whole beside its place and renamed into it."""
    from gpudiag.fileio import check_target, write_folder
    from gpudiag.redact import Redactor

    redactor = Redactor()
    nodes = {f"{NODES}/{_safe(host)}.zip": data for host, data in bundles.items()}  # (redacted on their node)
    # the manifest lists every file the sweep wrote: --force replaces those and nothing else
    run = {**run, "files": sorted([RESULTS, RUN, RULES, SUMMARY, *nodes])}
    files = {
        RESULTS: results_jsonl(records).encode(),
        RUN: (json.dumps(run, indent=1) + "\n").encode(),
        RULES: (json.dumps(rules, indent=1) + "\n").encode(),
        SUMMARY: summary_markdown(verdict, records, run).encode(),
    }
    files = {name: redactor.bytes(data) for name, data in files.items()}
    files.update(nodes)
    # checked again now, as it is written: a folder that appeared at -o while the sweep ran
    # (another sweep's, the user's) is replaced only as --force allows, never otherwise
    try:
        check_target(folder, force=force, folder=True, replaceable=not_a_sweep)
    except InputError as exc:
        raise InputError(
            f"{exc} (checked again as the sweep finished: its results were not written)"
        ) from None
    return write_folder(folder, files)


def _safe(host: str) -> str:
    """A host name as a file name (nothing but letters, digits, ``.-_``)."""
    cleaned = "".join(ch if ch.isalnum() or ch in ".-_" else "_" for ch in host).strip(".")
    return cleaned or "host"


def rejudge(
    folder: str,
    *,
    rules: str | None = None,
    baseline: str | None = None,
    expect_hosts: str | None = None,
) -> tuple[FleetVerdict, Any]:
    """``gpudiag sweep --summary``: read a sweep folder (or results.jsonl) and judge again,
    with its own rules.json unless ``rules`` names another file."""
    from gpudiag.repro.sweep.results import read_sweep

    used = load_rules(rules) if rules else None
    with paused():  # (its records make no cycles: gpudiag.gcpause)
        data = read_sweep(folder)
        used = used or data.rules or load_rules(None)
        asked = expected_hosts(expect_hosts, {})[0] if expect_hosts is not None else []
        hosts = asked or list(data.run.get("expected_hosts") or [])
        verdict = judge(data.records, expected_hosts=hosts, rules=used, baseline=load_baseline(baseline))
        verdict.failed = data.run.get("finished") is False  # (it stopped half way: never "healthy")
    return verdict, data
