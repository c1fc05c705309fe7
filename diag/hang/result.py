"""The verdict of ``gpudiag hang`` (schema ``gpudiag.hang/1``): JSON and exit code (its text
and Markdown: :mod:`gpudiag.render.hang`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpudiag.findings import Finding
from gpudiag.hang.blame import line as _line
from gpudiag.hang.blame import ranks as _ranks
from gpudiag.hang.blame import root_findings as _root_findings
from gpudiag.hang.frames import user_frames, where
from gpudiag.hang.groups import Analysis, GroupHang, mesh_dim, span
from gpudiag.hang.reader import Entry, Frame, frames_of

SCHEMA = "gpudiag.hang/1"
#: verdict → exit code (0 nothing wrong, 1 a hang found, 3 undecided).
EXIT = {"healthy": 0, "stuck": 1, "rank-missing": 1, "undecided": 3}


def _current(a: Analysis, rank: int) -> Entry | None:
    """The entry a rank's row and line show: the collective it is blocked in, else the send
    or recv it waits in, else its last recorded one."""
    dump = a.dumps.get(rank)
    last = dump.entries[-1] if dump is not None and dump.entries else None
    return a.blocked.get(rank) or a.p2p_pending.get(rank) or last


@dataclass
class HangResult:
    """One job's verdict: ``verdict`` (healthy, stuck, rank-missing, undecided), the
    root-cause ``root`` group (None when healthy), the :class:`Analysis` and the findings."""

    verdict: str
    root: GroupHang | None
    analysis: Analysis
    findings: list[Finding]
    summary: str

    def exit_code(self) -> int:
        return EXIT[self.verdict]

    def lines(self) -> dict[int, str]:
        """rank → the user's line of its current (or last) collective, where frames exist."""
        out = {}
        a = self.analysis
        for rank, dump in a.dumps.items():
            entry = (
                a.blocked.get(rank) or a.p2p_pending.get(rank) or (dump.entries[-1] if dump.entries else None)
            )
            line, _ = user_frames(entry.frames) if entry else (None, None)
            if rank not in a.blocked and rank not in a.p2p_pending and rank in a.stacks:
                line = self.analysis.stacks[rank]  # outside any collective: where it is now
            if line is not None:
                out[rank] = where(line) or ""
        return out

    def to_json(self) -> dict[str, Any]:
        a, root = self.analysis, self.root
        collective = None
        if root is not None:
            collective = {
                "group": root.name,
                "members": span(root.members),
                "mesh_dim": mesh_dim(root.desc),
                "seq": root.seq,
                "op": root.op,
                "ranks_in": root.ranks_in(),
                "never_entered": sorted(r for r, s in root.states.items() if s != root.op),
                "finished": root.finished,
                "how": root.how,
            }
        return {
            "schema": SCHEMA,
            "verdict": self.verdict,
            "summary": self.summary,
            "world_size": a.world_size,
            "culprit_ranks": root.culprits if root else (a.missing if self.verdict == "rank-missing" else []),
            "stuck_ranks": sorted(set(a.blocked) | set(a.p2p_pending)),  # (in a collective, or a send/recv)
            "missing_ranks": a.missing,
            "collective": collective,
            "lines": {str(r): line for r, line in sorted(self.lines().items())},
            "ranks": self.rows(),
            "findings": [f.to_json() for f in self.findings],
            "skipped": a.skipped,
        }

    def _rank_row(self, rank: int) -> dict[str, Any]:
        dump = self.analysis.dumps.get(rank)
        if dump is None:
            return {"rank": rank, "dump": None}
        a = self.analysis
        entry = _current(a, rank)
        row: dict[str, Any] = {"rank": rank, "dump": dump.path, "wrapped": dump.wrapped}
        if entry is not None:
            row.update(
                group=entry.desc if entry.desc and entry.desc != "undefined" else f"group {entry.group}",
                seq=entry.seq,
                op=entry.op,
                sizes=entry.input_sizes,
                state="pending" if rank in a.blocked or rank in a.p2p_pending else "completed",
                line=_line(entry),
            )
        return row

    @property
    def simulated(self) -> bool:
        """False: dumps are what the ranks recorded, read, not a simulation."""
        return False

    def rows(self) -> list[dict[str, Any]]:
        """One row per rank of the job: its dump, group, collective, sizes, state, line; a
        run of ranks without a dump is one row (``rank`` the first, ``through`` the last)."""
        out: list[dict[str, Any]] = []
        dumps = self.analysis.dumps
        ranks = sorted(dumps)
        start = 0
        for rank in [*ranks, self.analysis.world_size]:
            if rank > start:  # ranks start..rank-1 left no dump
                out.append(
                    {"rank": start, "dump": None, **({"through": rank - 1} if rank - 1 > start else {})}
                )
            if rank < self.analysis.world_size:
                out.append(self._rank_row(rank))
            start = rank + 1
        return out


#: Largest stacks file read (``stacks/rank<R>.json``), in bytes.
MAX_STACKS_BYTES = 16 * 1024 * 1024


def stack_frame(data: bytes) -> Frame | None:
    """The user's line in the main thread of a stacks file's bytes (``gpudiag run`` wrote
    it); None when it holds none or is not one."""
    try:
        stacks = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(stacks, dict):
        return None
    if stacks.get("_finished") is True:
        return Frame("(the end of the script)", 0, "")
    return user_frames(frames_of(stacks.get("MainThread")))[0]


def stack_line(stacks_dir: Path | None, rank: int) -> Frame | None:
    """The user's line in the main thread's stack that ``gpudiag run`` wrote for ``rank``
    (``stacks/rank<R>.json``); None without one."""
    path = stacks_dir / f"rank{rank}.json" if stacks_dir else None
    try:
        if path is None or not path.is_file() or path.stat().st_size > MAX_STACKS_BYTES:
            return None
        return stack_frame(path.read_bytes())
    except OSError:
        return None


def judge(
    analysis: Analysis, stacks_dir: Path | None = None, stacks: Mapping[int, bytes] | None = None
) -> HangResult:
    """The verdict, its one-paragraph summary and the findings of an :class:`Analysis`;
    ``stacks_dir`` holds the Python stacks ``gpudiag run`` wrote (where a rank outside any
    collective is), or ``stacks`` holds their bytes by rank (a bundle's)."""
    a = analysis
    if stacks is not None:
        a.stacks = {r: f for r in a.dumps if r in stacks and (f := stack_frame(stacks[r])) is not None}
    else:
        a.stacks = {r: f for r in a.dumps if (f := stack_line(stacks_dir, r)) is not None}
    findings: list[Finding] = []
    roots = a.roots
    root = roots[0] if roots else None
    for h in a.hangs:
        if h.cause is not None:
            cause = next(x for x in a.hangs if x.group == h.cause)
            where_ = sorted(
                {f"{_label(a, a.blocked[r].group)} #{a.blocked[r].seq}" for r in h.absent() if r in a.blocked}
            )
            findings.append(
                Finding(
                    "hang-consequence",
                    "warning",
                    f"{h.label} collective #{h.seq} waits for {_ranks(h.absent())}, blocked in "
                    f"{', '.join(where_)}: a consequence of {cause.label} collective #{cause.seq}, "
                    "not the cause",
                    {
                        "group": h.name,
                        "members": span(h.members),
                        "seq": h.seq,
                        "waits_for": h.absent(),
                        "cause_group": cause.name,
                    },
                )
            )
    if root is not None:
        summary = _root_findings(a, root, findings)
        verdict = "rank-missing" if root.culprits and set(root.culprits) <= set(root.missing) else "stuck"
    elif a.all_entered:
        group, seq, op = a.all_entered[0]
        verdict = "undecided"
        summary = (
            f"Every member of group {group} entered collective #{seq} ({op}) with the same sizes and none "
            "reports it completed: the dumps show no rank that diverged."
        )
        findings.append(
            Finding(
                "hang-all-entered",
                "info",
                summary,
                {"group": group, "seq": seq, "op": op},
                cause="the dumps were taken while it ran, or it hangs inside the backend (network, NCCL)",
                fix="dump again later; on NCCL rerun with NCCL_DEBUG=INFO",
            )
        )
    elif a.missing:
        verdict = "rank-missing"
        summary = (
            f"{_ranks(a.missing)} left no dump; the others completed every collective they recorded, "
            "so nothing "
            "shows where the missing ranks stopped."
        )
        findings.append(
            Finding(
                "hang-rank-missing",
                "error",
                summary,
                {"missing_ranks": a.missing},
                fix="collect the missing dumps",
            )
        )
    elif a.p2p_pending:
        verdict = "undecided"
        waits = "; ".join(
            f"rank {r} in {e.op} ({e.state}{', ' + shown if (shown := _line(e)) else ''})"
            for r, e in sorted(a.p2p_pending.items())
        )
        summary = (
            f"Every recorded collective completed, but {_ranks(sorted(a.p2p_pending))} "
            f"{'is' if len(a.p2p_pending) == 1 else 'are'} waiting in a point-to-point operation that "
            f"never completed: {waits}. The dumps cannot tell which "
            "peer failed to post its side."
        )
        findings.append(
            Finding(
                "hang-p2p-pending",
                "warning",
                summary,
                {
                    "ranks": {
                        str(r): {"op": e.op, "state": e.state, "line": _line(e)}
                        for r, e in sorted(a.p2p_pending.items())
                    }
                },
                cause="a peer never posted the matching send or recv (a pipeline schedule out of order, "
                "a rank that skipped a micro-batch), or it is blocked elsewhere",
                fix="compare the peers' stacks (gpudiag run writes them) or py-spy dump --pid each rank",
            )
        )
    elif a.unrecorded:
        verdict = "undecided"
        ran = ", ".join(f"rank {r}: {n}" for r, n in sorted(a.unrecorded.items()))
        summary = (
            f"Every recorded collective completed, but the dumps' operation ids show operations no entry "
            f"lists ({ran}): point-to-point send/recv, which gloo does not record. A rank may be waiting "
            "in a recv whose peer never sends; the dumps cannot tell."
        )
        findings.append(
            Finding(
                "hang-p2p-unrecorded",
                "info",
                summary,
                {"ranks": {str(r): n for r, n in sorted(a.unrecorded.items())}},
                fix="see the stacks (gpudiag run writes them) or py-spy dump each rank",
            )
        )
    else:
        verdict = "healthy"
        summary = f"Healthy: every recorded collective of the {len(a.dumps)} dumps completed on every member."
    for group, desc, seq, sigs in a.mismatches:
        findings.append(
            Finding(
                "hang-size-mismatch",
                "warning",
                f"{desc or group} collective #{seq} completed with other sizes or dtypes on different ranks: "
                + "; ".join(f"rank {r}: {s}" for r, s in sorted(sigs.items())),
                {"group": desc or group, "seq": seq, "ranks": {str(r): s for r, s in sigs.items()}},
                cause="same element count, other shape (gloo and NCCL check only the byte count)",
                fix="make every rank pass tensors of the same shape and dtype",
            )
        )
    if root is not None and a.unrecorded:
        ran = ", ".join(f"rank {r}: {n}" for r, n in sorted(a.unrecorded.items()))
        findings.append(
            Finding(
                "hang-p2p-unrecorded",
                "info",
                f"operations the gloo flight recorder lists no entry for ({ran}): point-to-point "
                "send/recv, which gloo records only as a number; a rank outside any collective may "
                "be waiting in a recv whose peer never sends",
                {"ranks": {str(r): n for r, n in sorted(a.unrecorded.items())}},
                fix="see the stacks (gpudiag run writes them) or py-spy dump each rank",
            )
        )
    if a.skipped:
        findings.append(
            Finding(
                "hang-dump-left-out",
                "warning",
                f"{len(a.skipped)} file{'s' if len(a.skipped) > 1 else ''} not judged: "
                + "; ".join(a.skipped),
                {"files": a.skipped},
                fix="give one run's dumps (a folder per run)",
            )
        )
    wrapped = sorted(r for r, d in a.dumps.items() if d.wrapped)
    if wrapped:
        findings.append(
            Finding(
                "hang-buffer-wrapped",
                "info",
                f"the flight recorder's ring buffer of {_ranks(wrapped)} dropped its oldest entries",
                {"ranks": wrapped},
                fix="raise TORCH_FR_BUFFER_SIZE to keep more",
            )
        )
    return HangResult(verdict, root, a, findings, summary)


def _label(a: Analysis, group: str) -> str:
    """A group's label (its ranks, its mesh dimension) where it hangs, else its name."""
    hang = next((h for h in a.hangs if h.group == group), None)
    if hang is not None:
        return hang.label
    entry = next((e for d in a.dumps.values() for e in d.entries if e.group == group), None)
    desc = entry.desc if entry is not None else ""
    return desc if desc and desc != "undefined" else f"group {group}"
