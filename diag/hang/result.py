"""The verdict of ``gpudiag hang`` (schema ``gpudiag.hang/1``): JSON and exit code (its text
and Markdown: :mod:`gpudiag.render.hang`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpudiag.findings import Finding
from gpudiag.hang.analysis import ABSENT, Analysis, GroupHang
from gpudiag.hang.frames import user_frames, where
from gpudiag.hang.reader import Entry, Frame, frames_of

SCHEMA = "gpudiag.hang/1"
#: verdict → exit code (0 nothing wrong, 1 a hang found, 3 undecided).
EXIT = {"healthy": 0, "stuck": 1, "rank-missing": 1, "undecided": 3}


def _ranks(ranks: list[int]) -> str:
    words = [str(r) for r in ranks]
    if not words:
        return "no rank"
    text = words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def _current(a: Analysis, rank: int) -> Entry | None:
    """The entry a rank's row and line show: the collective it is blocked in, else the send
    or recv it waits in, else its last recorded one."""
    dump = a.dumps.get(rank)
    last = dump.entries[-1] if dump is not None and dump.entries else None
    return a.blocked.get(rank) or a.p2p_pending.get(rank) or last


def _line(entry: Entry | None) -> str | None:
    if entry is None:
        return None
    line, caller = user_frames(entry.frames)
    shown = where(line)
    return f"{shown}, called from {where(caller)}" if shown and caller else shown


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
                "group": root.label,
                "seq": root.seq,
                "op": root.expected,
                "ranks_in": root.ranks_in(),
                "never_entered": sorted(r for r, s in root.states.items() if s != root.expected),
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
                group=entry.desc or entry.group,
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
        """One row per rank of the job: its dump, group, collective, sizes, state, line."""
        return [self._rank_row(r) for r in range(self.analysis.world_size)]


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
            findings.append(
                Finding(
                    "hang-consequence",
                    "warning",
                    f"{h.label} collective #{h.seq} waits for {_ranks(h.absent())}, blocked in {cause.label} "
                    f"collective #{cause.seq}: a consequence, not the cause",
                    {"group": h.label, "seq": h.seq, "waits_for": h.absent(), "cause_group": cause.label},
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


def _root_findings(a: Analysis, root: GroupHang, findings: list[Finding]) -> str:
    """Findings about the root-cause collective; returns the summary paragraph."""
    head = f"{root.label} collective #{root.seq}"
    ins = root.ranks_in()

    def line_of(rank: int) -> str:
        shown = _line(root.entries.get(rank))
        return f" ({shown})" if shown else ""

    if root.expected is None:
        sides = ", ".join(f"{_ranks([r])}: {s}" for r, s in sorted(root.states.items()))
        unknown = f"; {_ranks(root.missing)} left no dump" if root.missing else ""
        summary = f"{head}: the members split evenly ({sides}){unknown}; a tie names no culprit."
        findings.append(Finding("hang-tie", "error", summary, {"group": root.label, "seq": root.seq}))
        return summary
    in_lines = sorted({_line(root.entries[r]) or "" for r in ins} - {""})
    verb = "is" if len(ins) == 1 else "are"
    in_text = f"{_ranks(ins)} {verb} in {root.expected}" + (f" ({', '.join(in_lines)})" if in_lines else "")
    parts = []
    missing = set(root.missing)  # (a list: a rank looked up in it per culprit took O(n²))
    for rank in root.culprits:
        state = root.states.get(rank)
        if rank in missing:
            msg = (
                f"{_ranks([rank])} left no dump (dead, or killed before dumping) while {in_text}; "
                "its sizes and line cannot be known."
            )
            findings.append(
                Finding(
                    "hang-rank-missing",
                    "error",
                    msg,
                    {"rank": rank, "group": root.label, "seq": root.seq},
                    fix="look at that rank's log (crash, OOM kill, lost node)",
                )
            )
        elif state == ABSENT:
            blocked = a.blocked.get(rank)
            last = [e for e in a.dumps[rank].entries if e.group == root.group]
            done = (
                f"its last {root.label} collective (#{last[-1].seq}) completed"
                if last
                else "it recorded none"
            )
            if blocked is not None:
                group = blocked.desc or blocked.group
                where_ = f"it is blocked in {group} collective #{blocked.seq} ({blocked.op})"
                shown = _line(blocked)
                msg = (
                    f"{_ranks([rank])} never entered {head} while {in_text}; {where_}"
                    + (f" at {shown}" if shown else "")
                    + "."
                )
            else:
                stack = a.stacks.get(rank)
                now = (
                    (
                        "it reached the end of the script"
                        if stack.line == 0
                        else f"its Python stack is at {where(stack)}"
                    )
                    if stack
                    else "it is outside communication (compute, I/O, or a branch that skipped the collective)"
                )
                msg = f"{_ranks([rank])} never entered {head} while {in_text}; {done} and it is in no "
                msg += f"collective: {now}."
            findings.append(
                Finding(
                    "hang-never-entered",
                    "error",
                    msg,
                    {
                        "rank": rank,
                        "group": root.label,
                        "seq": root.seq,
                        "blocked_elsewhere": blocked is not None,
                    },
                    fix=None
                    if blocked is not None or rank in a.stacks
                    else f"run py-spy dump --pid <pid of rank {rank}> to see its line",
                )
            )
        elif root.expected == ABSENT:
            msg = f"{_ranks([rank])} called {state}{line_of(rank)} as {head}, which the others never call."
            findings.append(
                Finding(
                    "hang-extra-collective",
                    "error",
                    msg,
                    {"rank": rank, "group": root.label, "seq": root.seq},
                )
            )
        else:
            msg = (
                f"{_ranks([rank])} called {state}{line_of(rank)} as {head} while {in_text}; "
                f"it never entered that {root.expected}."
            )
            findings.append(
                Finding(
                    "hang-diverged",
                    "error",
                    msg,
                    {"rank": rank, "group": root.label, "seq": root.seq, "op": state},
                )
            )
        parts.append(msg)
    if not root.culprits:
        return f"{head} is pending and no member diverged."
    return " ".join(parts)
