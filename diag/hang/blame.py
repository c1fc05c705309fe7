"""The findings about the root-cause collective of a hang, and the paragraph that sums them
up (:func:`root_findings`; :mod:`.result` adds the rest of the verdict)."""

from __future__ import annotations

from gpudiag.findings import Finding
from gpudiag.hang.frames import user_frames, where
from gpudiag.hang.groups import ABSENT, Analysis, GroupHang, span
from gpudiag.hang.reader import Entry


def ranks(numbers: list[int]) -> str:
    """``rank 2``, ``ranks 0 and 1``, ``ranks 0-99, 120`` (more than three as ranges)."""
    words = [str(r) for r in numbers]
    if not words:
        return "no rank"
    if len(words) > 3:
        return "ranks " + span(numbers)
    text = words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]
    return ("rank " if len(numbers) == 1 else "ranks ") + text


def line(entry: Entry | None) -> str | None:
    """The user's line of ``entry`` (``train.py:29, called from train.py:50``), if its frames show one."""
    if entry is None:
        return None
    found, caller = user_frames(entry.frames)
    shown = where(found)
    return f"{shown}, called from {where(caller)}" if shown and caller else shown


def _lines(root: GroupHang, members: list[int]) -> str:
    shown = sorted({line(root.entries.get(r)) or "" for r in members} - {""})
    return f" ({', '.join(shown[:3])})" if shown else ""


def _rooted(root: GroupHang, findings: list[Finding]) -> str:
    still, done = root.ranks_in(), root.finished
    verb = "is" if len(still) == 1 else "are"
    summary = (
        f"{ranks(still)} {verb} still in {root.op}{_lines(root, still)} as {root.label} collective "
        f"#{root.seq}, which {ranks(done)} completed: a {root.op} ends on each rank once its own part "
        f"is done (a non-root once it has the data), so {ranks(done)} {'is' if len(done) == 1 else 'are'} "
        f"not the cause. The ranks still in it disagree on its root (a src that differs by rank) or "
        "wait for a rank that never sent."
    )
    findings.append(
        Finding(
            "hang-rooted-pending",
            "error",
            summary,
            {"group": root.name, "seq": root.seq, "op": root.op, "still_in": still, "finished": done},
            cause="a rooted collective (broadcast, scatter, gather, reduce) called with another src/dst on "
            "some ranks, or behind a condition some ranks skip",
            fix="print the src (dst) each rank passes at that line",
        )
    )
    return summary


def _tie(root: GroupHang, findings: list[Finding]) -> str:
    head = f"{root.label} collective #{root.seq}"
    sides = "; ".join(
        f"{ranks([r])} " + ("is in no collective" if s == ABSENT else f"is in {s}{_lines(root, [r])}")
        for r, s in sorted(root.states.items())
    )
    unknown = f"; {ranks(root.missing)} left no dump" if root.missing else ""
    summary = (
        f"{head}: {sides}{unknown}. Each waits for the other; neither the other groups nor the "
        "ranks' sequences of collectives tell which of them left the program."
    )
    findings.append(
        Finding(
            "hang-tie",
            "error",
            summary,
            {
                "group": root.name,
                "seq": root.seq,
                "ranks": {str(r): s for r, s in sorted(root.states.items())},
            },
            fix="compare the two lines: which one does the script reach on every rank?",
        )
    )
    return summary


def root_findings(a: Analysis, root: GroupHang, findings: list[Finding]) -> str:
    """Findings about the root-cause collective; returns the summary paragraph."""
    if root.how == "rooted":
        return _rooted(root, findings)
    if not root.culprits:
        return _tie(root, findings)
    head = f"{root.label} collective #{root.seq}"
    op = root.op
    ins = sorted(r for r, s in root.states.items() if s == op)
    verb = "is" if len(ins) == 1 else "are"
    went_on = f"; {ranks(root.finished)} completed its part and went on" if root.finished else ""
    in_text = f"{ranks(ins)} {verb} in {op}{_lines(root, ins)}{went_on}"
    evidence = f" ({root.evidence})" if root.evidence else ""
    parts = []
    missing = sorted(set(root.culprits) & set(root.missing))
    if missing:  # one finding for every rank without a dump (a huge world stays one line)
        msg = (
            f"{ranks(missing)} left no dump (dead, or killed before dumping) while {in_text}; "
            "its sizes and line cannot be known."
        )
        findings.append(
            Finding(
                "hang-rank-missing",
                "error",
                msg,
                {"rank": missing[0], "ranks": span(missing), "group": root.name, "seq": root.seq},
                fix="look at that rank's log (crash, OOM kill, lost node)",
            )
        )
        parts.append(msg)
    for rank in sorted(set(root.culprits) - set(missing)):
        state = root.states.get(rank)
        if state == ABSENT:
            msg, finding = _never_entered(a, root, rank, in_text, evidence)
        elif root.expected == ABSENT:
            msg = f"{ranks([rank])} called {state}{_lines(root, [rank])} as {head}, "
            msg += "which the others never call."
            finding = Finding(
                "hang-extra-collective", "error", msg, {"rank": rank, "group": root.name, "seq": root.seq}
            )
        else:
            msg = (
                f"{ranks([rank])} called {state}{_lines(root, [rank])} as {head} while {in_text}; "
                f"it never entered that {op}{evidence}."
            )
            finding = Finding(
                "hang-diverged",
                "error",
                msg,
                {"rank": rank, "group": root.name, "seq": root.seq, "op": state},
            )
        findings.append(finding)
        parts.append(msg)
    return " ".join(parts)


def _never_entered(
    a: Analysis, root: GroupHang, rank: int, in_text: str, evidence: str
) -> tuple[str, Finding]:
    head = f"{root.label} collective #{root.seq}"
    blocked = a.blocked.get(rank)
    last = [e for e in a.dumps[rank].entries if e.group == root.group]
    done = f"its last {root.name} collective (#{last[-1].seq}) completed" if last else "it recorded none"
    if blocked is not None:
        group = next((h.label for h in a.hangs if h.group == blocked.group), blocked.desc or blocked.group)
        shown = line(blocked)
        msg = (
            f"{ranks([rank])} never entered {head} while {in_text}{evidence}; it is blocked in {group} "
            f"collective #{blocked.seq} ({blocked.op})" + (f" at {shown}" if shown else "") + "."
        )
    else:
        stack = a.stacks.get(rank)
        pending = a.p2p_pending.get(rank)
        if stack:
            now = (
                "it reached the end of the script"
                if stack.line == 0
                else f"its Python stack is at {where(stack)}"
            )
        elif pending is not None:
            now = f"it waits in {pending.op}" + (f" at {shown}" if (shown := line(pending)) else "")
        else:
            now = "it is outside communication (compute, I/O, or a branch that skipped the collective)"
        msg = f"{ranks([rank])} never entered {head} while {in_text}{evidence}; {done} and it is in no "
        msg += f"collective: {now}."
    finding = Finding(
        "hang-never-entered",
        "error",
        msg,
        {"rank": rank, "group": root.name, "seq": root.seq, "blocked_elsewhere": blocked is not None},
        fix=None
        if blocked is not None or rank in a.stacks
        else f"run py-spy dump --pid <pid of rank {rank}> to see its line",
    )
    return msg, finding
