"""What a rank is doing now, as the watchdog of ``gpudiag run`` tells the others, and the
sentences the live watchdog says with it (docs/hang.md, "Slow is not stuck").

A rank's :class:`State` — in a collective (its op, number and group), in a point-to-point
``send``/``recv`` (gloo records none: the main thread's stack shows it), outside any
collective, or at the end of its script — with the user's line (the innermost frame of
the main thread outside torch, gpudiag, the standard library and installed packages) and
the bytes its processes have written to storage, is published in the job's store while a
stall is being confirmed. Nothing here imports torch.
"""

from __future__ import annotations

import json
import sys
import sysconfig
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from gpudiag.hang.frames import user_frames, where
from gpudiag.hang.reader import Frame

#: The functions of ``torch.distributed`` that block in a point-to-point transfer.
P2P = frozenset({"send", "recv", "send_object_list", "recv_object_list", "batch_isend_irecv"})
_LIBRARY = tuple(
    str(Path(p).resolve()) + "/"
    for key in ("stdlib", "platstdlib", "purelib", "platlib")
    if (p := sysconfig.get_paths().get(key))
)


@dataclass
class Op:
    """One operation a rank waits in: ``kind`` ``collective`` or ``p2p``; ``name``
    (``all_reduce``, ``recv``); ``seq`` its collective number in ``group`` (0 for p2p);
    ``since`` the wall-clock time it began (seconds since the epoch); ``line``."""

    kind: str
    name: str
    group: str = ""
    seq: int = 0
    since: float = 0.0
    line: str | None = None

    def said(self) -> str:
        """``barrier #2`` (``recv`` for a transfer), as a sentence names it."""
        return f"{self.name} #{self.seq}" if self.kind == "collective" else self.name


@dataclass
class State:
    """One rank's answer: ``where`` (``collective``, ``p2p``, ``outside``, ``finished``),
    its ``op`` when in one, its ``line``, the bytes ``written`` by its processes (None:
    unknown), ``pid``, ``host`` and ``t`` (when it answered)."""

    where: str
    op: Op | None = None
    line: str | None = None
    written: int | None = None
    pid: int = 0
    host: str = ""
    t: float = field(default_factory=time.time)

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def decode(raw: bytes | str) -> State | None:
        """The state a rank published, or None when unreadable."""
        try:
            data = json.loads(raw)
            op = data.pop("op", None)
            return State(**data, op=Op(**op) if isinstance(op, dict) else None)
        except (TypeError, ValueError):
            return None


def _mine(file: str) -> bool:
    """Whether ``file`` is the user's code (not the standard library nor an installed package)."""
    resolved = file if file.startswith("<") else str(Path(file).resolve())
    return not resolved.startswith("<") and not resolved.startswith(_LIBRARY)


def stack_frames(frame: FrameType | None) -> tuple[Frame, ...]:
    """``frame`` and its callers, innermost first, as the reader's frames."""
    out = []
    while frame is not None:
        out.append(Frame(frame.f_code.co_filename, frame.f_lineno or 0, frame.f_code.co_name))
        frame = frame.f_back
    return tuple(out)


def user_line(frames: tuple[Frame, ...]) -> str | None:
    """The innermost frame of the user's own code in ``frames`` (innermost first), as
    ``train.py:26``: torch, gpudiag, the standard library and installed packages skipped."""
    mine = tuple(f for f in frames if _mine(f.file))
    return where(user_frames(mine)[0]) if mine else None


def main_frame() -> FrameType | None:
    """The main thread's innermost Python frame now."""
    return sys._current_frames().get(threading.main_thread().ident or 0)


def p2p_call(frame: FrameType | None) -> str | None:
    """The point-to-point function of ``torch.distributed`` the main thread is blocked in
    (its innermost Python frame is that function), or None."""
    if frame is None:
        return None
    code = frame.f_code
    if code.co_name in P2P and code.co_filename.endswith("distributed_c10d.py"):
        return code.co_name
    return None


def op_name(profiling_name: Any) -> str:
    """``all_reduce`` from the recorder's ``gloo:all_reduce`` / ``nccl:all_reduce``."""
    return str(profiling_name).rpartition(":")[2] or "?"


def _ranks(ranks: list[int]) -> str:
    names = [str(r) for r in sorted(ranks)]
    text = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return ("rank " if len(names) == 1 else "ranks ") + text


def slow(op: Op, waited_s: float, outside: dict[int, str | None]) -> str:
    """The sentence for a stall that resolved: who was outside any collective, where, and
    what the others waited in."""
    what = f"{op.said()}" + (f" at {op.line}" if op.line else "")
    if not outside:
        return f"slow, not hung: {what} completed after {waited_s:.0f} s"
    where_ = "; ".join(
        f"{_ranks([r])} spent {waited_s:.0f} s outside any collective" + (f" at {line}" if line else "")
        for r, line in sorted(outside.items())
    )
    return f"slow, not hung: {where_} while the others waited in {what}"


def blocked(states: dict[int, State], stall_s: float) -> str | None:
    """The live sentence for a job whose ranks wait in point-to-point transfers (gloo's
    recorder lists none, so the dumps alone cannot show it), or None when no rank does."""
    p2p = {r: s for r, s in states.items() if s.where == "p2p" and s.op is not None}
    if not p2p:
        return None
    parts = [
        f"rank {r} in {s.op.name} at {s.op.line or s.line or '?'}" for r, s in sorted(p2p.items()) if s.op
    ]
    others = [r for r, s in states.items() if s.where == "collective" and s.op is not None]
    tail = "".join(
        f"; rank {r} in {states[r].op.said()} at {states[r].op.line or states[r].line or '?'}"  # type: ignore[union-attr]
        for r in sorted(others)
    )
    return (
        f"{_ranks(list(p2p))} blocked for over {stall_s:g} s in point-to-point transfers "
        f"(gloo's flight recorder lists no send/recv; from their stacks): " + "; ".join(parts) + tail
    )


def early_end(finished: list[int], failed: dict[int, Op]) -> str:
    """The sentence for ranks whose collective failed because others had left: ``rank 2
    reached the end of the script after collective #6; ranks 0, 1 entered all_reduce #7
    at job.py:26``."""
    seqs = sorted({op.seq for op in failed.values() if op.seq})
    after = f" after collective #{seqs[0] - 1}" if len(seqs) == 1 and seqs[0] > 1 else ""
    by_op: dict[str, list[int]] = {}
    for rank, op in sorted(failed.items()):
        said = op.said() + (f" at {op.line}" if op.line else "")
        by_op.setdefault(said, []).append(rank)
    entered = "; ".join(f"{_ranks(ranks)} entered {said}" for said, ranks in by_op.items())
    return f"{_ranks(finished)} reached the end of the script{after}; {entered}"


def not_answering(rank: int, pid: int, host: str, here: str, alive_: bool | None) -> str:
    """The sentence for a rank that wrote no dump: alive but not answering, gone, or unknown."""
    if alive_ is None:
        return f"rank {rank} did not answer (pid {pid} on {host or 'another host'}: not checked from {here})"
    if alive_:
        return (
            f"rank {rank} is alive but not answering (pid {pid}): its Python threads do not run — "
            f"the GIL held or native code; py-spy dump --native --pid {pid} shows where"
        )
    return f"rank {rank} is gone (pid {pid} has ended)"


def pending_for(record: dict[str, Any], now_ns: int) -> float:
    """Seconds the oldest collective still pending in a JSON flight record has waited (0: none)."""
    entry = oldest_pending(record)
    return (now_ns - entry["time_created_ns"]) / 1e9 if entry else 0.0


def oldest_pending(record: dict[str, Any]) -> dict[str, Any] | None:
    """The oldest entry of a JSON flight record still pending (not completed, not retired)."""
    oldest = None
    for e in record.get("entries") or ():
        if not isinstance(e, dict) or e.get("state") == "completed" or e.get("retired") is True:
            continue
        created = e.get("time_created_ns")
        if (
            isinstance(created, int)
            and created > 0
            and (oldest is None or created < oldest["time_created_ns"])
        ):
            oldest = e
    return oldest


def load_record(raw: Any) -> dict[str, Any]:
    """A JSON flight record's dict (``{}`` when it is no object)."""
    record = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    return record if isinstance(record, dict) else {}


def progress(record: dict[str, Any]) -> tuple[tuple[tuple[str, str, str], ...], bool]:
    """(each group's last enqueued and completed sequence numbers, whether a group has one
    enqueued past its last completed) from ``pg_status``: reading it costs microseconds,
    the entries about 80 ms for 2,000 (so they are read only once nothing has moved for
    the stall limit; gloo's last completed number can lag, so the entries decide)."""
    key, busy = [], False
    status = record.get("pg_status")
    for group, value in sorted(status.items()) if isinstance(status, dict) else ():
        if not isinstance(value, dict):
            continue
        enqueued, completed = value.get("last_enqueued_collective"), value.get("last_completed_collective")
        key.append((str(group), str(enqueued), str(completed)))
        try:
            busy = busy or int(enqueued) > int(completed)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            busy = True
    return tuple(key), busy


def entry_op(entry: dict[str, Any], line: str | None) -> Op:
    """The :class:`Op` of a JSON flight-record entry."""
    group = entry.get("process_group")
    desc = group[1] if isinstance(group, (list, tuple)) and len(group) > 1 else str(group or "")
    seq = entry.get("collective_seq_id")
    created = entry.get("time_created_ns")
    return Op(
        "collective",
        op_name(entry.get("profiling_name")),
        str(desc),
        seq if isinstance(seq, int) else 0,
        created / 1e9 if isinstance(created, int) else time.time(),
        line,
    )


def thread_stacks() -> dict[str, list[dict[str, Any]]]:
    """Every thread's Python stack, innermost frame first (the flight recorder's order)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = {}
    for ident, frame in sys._current_frames().items():
        frames = [{"filename": f.file, "line": f.line, "name": f.name} for f in stack_frames(frame)]
        out[names.get(ident, str(ident))] = frames
    return out
