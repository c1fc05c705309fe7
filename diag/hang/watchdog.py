"""The watchdog of ``gpudiag run``: a thread per rank that ends a hung job with a verdict,
and only a hung one (docs/hang.md).

Every ``poll_s`` seconds it reads this rank's flight record's ``pg_status``
(``_dump_fr_trace_json(includeCollectives=False)``, torch's private function, through
``getattr``); when nothing has moved for ``stall_s`` with a collective enqueued, it reads
the entries. A rank *suspects* a stall when a collective has been pending longer than
``stall_s`` seconds, or its main thread has sat in one ``send``/``recv`` that long (gloo
records no point-to-point entry: the stack shows it). It then leads a confirmation round
in the job's store (a client of torchrun's TCP store at ``MASTER_ADDR:MASTER_PORT``):
every rank publishes what it is doing (:class:`~gpudiag.hang.live.State`), and the stall
is confirmed only when, after ``confirm_s`` (default ``max(10, stall_s / 2)``), the same
operation is still pending and no rank outside any collective is writing to storage
(``/proc/PID/io``). A stall that resolves is said (``slow, not hung: …``) and the job goes
on. A confirmed one raises the alarm, and every rank writes into ``out``:

- ``fr_rank<R>.pkl`` — the rank's dump (``_dump_fr_trace``, with Python frames),
- ``stacks/rank<R>.json`` — the Python stack of every thread,

then the leader waits (at most ``gather_s``) for every rank's files, prints the verdict
of :mod:`gpudiag.hang` on stderr (with what the live states add: point-to-point waits, a
rank alive but not answering), and every rank ends its script's child processes and
exits 1 instead of waiting for the backend's timeout. Until then it writes nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gpudiag.hang import live, procs
from gpudiag.hang.live import Op, State, entry_op, oldest_pending, progress, thread_stacks
from gpudiag.hang.live import load_record as _load

#: Store keys, under the job's run id.
_ALARM = "gpudiag/hang/alarm"
_DUMPED = "gpudiag/hang/dumped"
_DONE = "gpudiag/hang/done"
_FINISHED = "gpudiag/hang/finished"
_LEFT = "gpudiag/hang/left"  # ranks whose script ended, however
_RESOLVED = "gpudiag/hang/resolved"  # confirmation rounds closed
_LEAD = "gpudiag/hang/lead/"  # + round: who leads it
_STATE = "gpudiag/hang/state/"  # + round/rank: a rank's State
_PID = "gpudiag/hang/pid/"  # + rank: {pid, host}
_FIN = "gpudiag/hang/fin/"  # + rank: its script reached its end
_FAILED = "gpudiag/hang/failed/"  # + rank: the op its script failed in
_EARLY = "gpudiag/hang/early"
#: Seconds a rank whose collective failed waits for the others' word before saying who left.
EARLY_WAIT_S = 5.0


def dump_record(backend: str | None, json_format: bool, collectives: bool = True) -> Any:
    """This rank's flight record through torch's private functions (``getattr``): NCCL
    keeps its own recorder (``_dump_nccl_trace``), gloo's is ``_dump_fr_trace`` (which
    takes ``backend=`` from torch 2.15). ``backend`` None: the default group's (one is
    kept by the watchdog: the recorder still dumps after ``destroy_process_group``)."""
    import torch
    import torch.distributed as dist

    c10d = getattr(torch._C, "_distributed_c10d", None)
    suffix = "_json" if json_format else ""
    backend = backend or str(dist.get_backend())
    nccl = getattr(c10d, f"_dump_nccl_trace{suffix}", None)
    kwargs = {"includeCollectives": False} if not collectives else {}
    if backend == "nccl" and nccl is not None:
        return nccl(**kwargs)
    dump = getattr(c10d, f"_dump_fr_trace{suffix}", None)
    if dump is None:
        raise RuntimeError("this torch has no flight recorder dump")
    try:
        return dump(backend=backend, **kwargs)
    except TypeError:  # torch < 2.15: one recorder, no backend argument
        return dump(**kwargs)


def confirm_window(stall_s: float) -> float:
    """Seconds a suspected stall must hold before the job is ended: ``max(10, stall_s / 2)``."""
    return max(10.0, stall_s / 2)


class Watchdog(threading.Thread):
    """One rank's watchdog (module docstring); ``start()`` it before the user's script runs."""

    def __init__(
        self,
        stall_s: float,
        out: Path,
        poll_s: float = 1.0,
        gather_s: float = 15.0,
        confirm_s: float | None = None,
    ):
        super().__init__(name="gpudiag-hang-watchdog", daemon=True)
        self.stall_s, self.out, self.poll_s, self.gather_s = stall_s, out, poll_s, gather_s
        self.confirm_s = confirm_window(stall_s) if confirm_s is None else confirm_s
        self.by = "gpudiag run"  # who says so on stderr ("gpudiag.watch" when armed from code)
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.store: Any = None
        self.backend: str | None = None  # (kept: the recorder still dumps after destroy_process_group)
        self.finished = False  # the script ended on this rank (set by finish())
        self.stopping = threading.Event()  # set: the thread ends at its next poll (bench)
        # held by the one thread that dumps and ends the rank: a rank whose script ended
        # sees the alarm both in finish() and in this thread, and must count once
        self.ending = threading.Lock()
        self.states: dict[int, State] = {}  # the ranks' last answers (a round's leader)
        self.suspected: Op | None = None  # the operation a confirmed stall held
        self._round: tuple[Op, dict[int, str | None]] | None = None  # (op, ranks seen outside) it leads
        self._said = threading.Lock()
        self._key: Any = None  # pg_status as last seen, when it changed, when entries were read
        self._since = self._checked = time.monotonic()
        self._p2p: tuple[Any, int, float] | None = None  # (frame, its instruction, since when)
        self._ops: tuple[Any, Op | None] = (None, None)  # (pg_status key, the pending op then)

    # -- the store ---------------------------------------------------------------------

    def _connect(self) -> Any:
        import datetime

        import torch.distributed as dist

        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            return None
        client = dist.TCPStore(addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=30))
        store = dist.PrefixStore(f"gpudiag-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}", client)
        store.set(f"{_PID}{self.rank}", json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
        return store

    def connect_now(self) -> None:
        """Join the job's store now, from the starting thread, when torchrun's agent holds
        it (``TORCHELASTIC_USE_AGENT_STORE``): the rank's pid is known to the others even
        if its Python threads soon stop running (native code holding the GIL)."""
        if self.store is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            with contextlib.suppress(Exception):
                self.store = self._connect()

    def _open_round(self) -> tuple[int, bool]:
        """(the current confirmation round, whether someone leads it)."""
        r = int(self.store.add(_RESOLVED, 0))
        return r, bool(self.store.check([f"{_LEAD}{r}"]))

    def _get(self, key: str) -> bytes | None:
        return self.store.get(key) if self.store.check([key]) else None

    # -- what this rank is doing -------------------------------------------------------

    def _pending(self, key: Any) -> Op | None:
        """The oldest collective pending on this rank (entries read once per ``key``)."""
        if self._ops[0] != key:
            entry = oldest_pending(_load(self._dump(json_format=True, collectives=True)))
            self._ops = (key, entry_op(entry, self._line()) if entry else None)
        return self._ops[1]

    def _line(self) -> str | None:
        return live.user_line(live.stack_frames(live.main_frame()))

    def _p2p_op(self) -> Op | None:
        """The send/recv the main thread sits in, since when it has (None: none)."""
        frame = live.main_frame()
        name = live.p2p_call(frame)
        if frame is None or name is None:
            self._p2p = None
            return None
        if self._p2p is None or self._p2p[0] is not frame or self._p2p[1] != frame.f_lasti:
            self._p2p = (frame, frame.f_lasti, time.time())
        return Op("p2p", name, since=self._p2p[2], line=live.user_line(live.stack_frames(frame)))

    def _suspect(self) -> Op | None:
        """The operation this rank has waited in longer than ``stall_s``, or None."""
        key, busy = progress(_load(self._dump(json_format=True, collectives=False)))
        now = time.monotonic()
        if key != self._key:
            self._key, self._since = key, now
        if busy:
            self._p2p = None
            if now - self._since <= self.stall_s or now - self._checked <= self.stall_s:
                return None
            self._checked = now  # no progress for stall_s with a collective enqueued: the entries
            op = self._pending(key)
            return op if op is not None and time.time() - op.since > self.stall_s else None
        op = self._p2p_op()
        return op if op is not None and time.time() - op.since > self.stall_s else None

    def _still(self, op: Op) -> bool:
        """Whether ``op`` is still pending on this rank."""
        if op.kind == "p2p":
            now = self._p2p_op()
            return now is not None and now.since == op.since
        key, _ = progress(_load(self._dump(json_format=True, collectives=False)))
        if key == self._key:
            return True
        pending = self._pending(key)
        return pending is not None and (pending.group, pending.seq) == (op.group, op.seq)

    def state(self) -> State:
        """What this rank is doing now (published during a confirmation round)."""
        pid = os.getpid()
        if self.finished:
            return State("finished", pid=pid, host=socket.gethostname())
        op = self._p2p_op()
        if op is None:
            key, busy = progress(_load(self._dump(json_format=True, collectives=False)))
            op = self._pending(key) if busy else None
        written = procs.written_bytes([pid, *procs.descendants()])
        where = op.kind if op is not None else "outside"
        return State(where, op, self._line(), written, pid, socket.gethostname())

    def _publish(self, r: int) -> None:
        if self.store is not None:
            self.store.set(f"{_STATE}{r}/{self.rank}", self.state().encode())

    def _read_states(self, r: int) -> dict[int, State]:
        if self.store is None:
            return {self.rank: self.state()}
        out = {}
        for rank in range(self.world_size):
            raw = self._get(f"{_STATE}{r}/{rank}")
            state = State.decode(raw) if raw is not None else None
            if state is not None:
                out[rank] = state
        return out

    # -- the loop ----------------------------------------------------------------------

    def run(self) -> None:
        try:
            import torch.distributed as dist
        except Exception:
            return
        tried = False
        while not self.stopping.wait(self.poll_s):
            try:
                if self.store is None and not tried:  # (at once: a rank may soon stop answering)
                    tried, self.store = True, self._connect()
                if self.backend is None:
                    if not dist.is_available() or not dist.is_initialized():
                        continue
                    self.backend = str(dist.get_backend())
                if self.store is None:
                    self.store = self._connect()
                r = 0
                if self.store is not None:
                    if self.store.check([_ALARM]):
                        return self._end(leader=False)
                    r, led = self._open_round()
                    if led:
                        self._publish(r)
                op = self._suspect()
                if op is None:
                    continue
                if self.store is not None and self.store.add(f"{_LEAD}{r}", 1) != 1:
                    continue  # another rank leads this round
                if self._confirm(op, r):
                    self.suspected = op
                    return self._end(leader=True)
            except Exception:
                continue

    def _confirm(self, op: Op, r: int) -> bool:
        """Lead round ``r`` for ``op``: True when the stall is confirmed (the alarm raised),
        False when it resolved (said on stderr; the round closed)."""
        start, grew_at, last = time.monotonic(), {}, {}  # type: ignore[var-annotated]
        self._round = (op, {})
        while not self.stopping.wait(self.poll_s):
            if self.store is not None and self.store.check([_ALARM]):
                return True
            if not self._still(op):
                self._resolved()
                return False
            self._publish(r)
            self.states = self._read_states(r)
            for rank, s in self.states.items():
                if s.where == "outside" and rank != self.rank:
                    self._round[1][rank] = s.line
                    if (
                        s.written is not None
                        and rank in last
                        and s.t > last[rank][0]
                        and s.written > last[rank][1]
                    ):
                        grew_at[rank] = time.monotonic()
                if s.written is not None and (rank not in last or s.t > last[rank][0]):
                    last[rank] = (s.t, s.written)
            writing = [k for k, t in grew_at.items() if time.monotonic() - t <= 3 * self.poll_s]
            if time.monotonic() - start >= self.confirm_s and not writing:
                self._round = None
                if self.store is not None:
                    self.store.add(_ALARM, 1)
                return True
        return False

    def _resolved(self) -> None:
        """The round this rank leads ends: its operation completed (or the script went on
        past it): said once, the round closed."""
        with self._said:
            if self._round is None:
                return
            op, outside = self._round
            self._round = None
            self._say(live.slow(op, time.time() - op.since, outside))
            if self.store is not None:
                with contextlib.suppress(Exception):
                    self.store.add(_RESOLVED, 1)

    def _say(self, text: str) -> None:
        with contextlib.suppress(Exception):
            sys.stderr.write(f"{self.by}: {text}\n")
            sys.stderr.flush()

    # -- the script's end ----------------------------------------------------------------

    def _finish_store(self) -> Any:
        if self.store is None and (self.backend is not None or _initialized()):
            with contextlib.suppress(Exception):
                self.store = self._connect()
        return self.store

    def finish(self) -> None:
        """The script ended normally on this rank: wait until every rank's script has
        ended (then return) or another rank raises the alarm (then dump, saying so, and
        end with 1) — a rank that ends while the others wait in a collective is the hang's
        cause, and its exit would turn their wait into a "connection closed" error."""
        self._resolved()  # (a round this rank leads: its script went on past the operation)
        store = self._finish_store()
        if store is None:
            return
        self.finished = True
        try:
            store.add(_FINISHED, 1)
            store.set(f"{_FIN}{self.rank}", "1")
            store.add(_LEFT, 1)
            while store.add(_LEFT, 0) < self.world_size:
                if store.check([_ALARM]):
                    self._end(leader=False)
                time.sleep(0.2)
        except Exception:
            return

    def left(self) -> None:
        """The script ended otherwise (an error, a non-zero exit): no rank waits for it."""
        self._resolved()
        with contextlib.suppress(Exception):
            if self._finish_store() is not None:
                self.store.add(_LEFT, 1)

    def failed(self, exc: BaseException, line: str | None) -> None:
        """The script raised ``exc`` at ``line``: when it is a collective that failed
        because another rank had reached the end of its script (gloo's "connection closed
        by peer" after its ``destroy_process_group()``), the first such rank says so once
        the others have told which op they were in; they wait for it (every wait bounded:
        their exit makes torchrun end the job)."""
        store = self._finish_store()
        if store is None or not (isinstance(exc, RuntimeError) and "by peer" in str(exc)):
            return
        with contextlib.suppress(Exception):
            deadline = time.monotonic() + EARLY_WAIT_S
            while int(store.add(_FINISHED, 0)) == 0:  # (the rank that left may still be on its way)
                if time.monotonic() > deadline:
                    return  # no rank reached its end: the script's own error
                time.sleep(0.1)
            entries = _load(self._dump(json_format=True, collectives=True)).get("entries") or [None]
            op = entry_op(entries[-1], line) if isinstance(entries[-1], dict) else Op("collective", "?")
            store.set(f"{_FAILED}{self.rank}", json.dumps(op.__dict__))
            if int(store.add(_EARLY, 1)) != 1:
                while time.monotonic() < deadline + EARLY_WAIT_S and not store.check([_EARLY + "/said"]):
                    time.sleep(0.1)
                return
            while time.monotonic() < deadline + EARLY_WAIT_S:
                if int(store.add(_EARLY, 0)) + int(store.add(_FINISHED, 0)) >= self.world_size:
                    break
                time.sleep(0.1)
            finished = [r for r in range(self.world_size) if store.check([f"{_FIN}{r}"])]
            failed = {}
            for rank in range(self.world_size):
                raw = self._get(f"{_FAILED}{rank}")
                if raw is not None:
                    failed[rank] = Op(**json.loads(raw))
            self._say(live.early_end(finished, failed))
            store.set(_EARLY + "/said", "1")

    # -- ending the job ----------------------------------------------------------------

    def _dump(self, json_format: bool, collectives: bool = True) -> Any:
        return dump_record(self.backend, json_format, collectives)

    def _write(self) -> None:
        from gpudiag.hang.outdir import Folder

        with Folder(self.out) as folder:
            with contextlib.suppress(Exception):  # (a rank whose recorder cannot dump is named missing)
                folder.write(f"fr_rank{self.rank}.pkl", bytes(self._dump(json_format=False)))
            stacks = json.dumps({**thread_stacks(), "_finished": self.finished}, indent=1)
            with folder.sub("stacks") as sub:
                sub.write(f"rank{self.rank}.json", stacks.encode())

    def _end(self, leader: bool) -> None:
        if not self.ending.acquire(blocking=False):  # the other thread (finish() or run()) ends it
            while True:
                time.sleep(60)
        try:
            try:
                self._write()
            except OSError as exc:
                self._say(f"rank {self.rank} could not write its dump into {self.out}: {exc}")
            if self.store is not None:
                self.store.add(_DUMPED, 1)
            if leader:
                self._verdict()
            elif self.store is not None:
                deadline = time.monotonic() + self.gather_s + 10
                while time.monotonic() < deadline and not self.store.check([_DONE]):
                    time.sleep(0.2)
        finally:
            with contextlib.suppress(Exception):
                procs.end_descendants()
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(1)

    def _verdict(self) -> None:
        deadline = time.monotonic() + self.gather_s
        while self.store is not None and time.monotonic() < deadline:
            if self.store.add(_DUMPED, 0) >= self.world_size:
                break
            time.sleep(0.2)
        from gpudiag.hang.analysis import analyse
        from gpudiag.hang.outdir import Folder
        from gpudiag.hang.reader import read_dumps
        from gpudiag.hang.result import judge

        try:
            result = judge(
                analyse(read_dumps([str(self.out)]), self.world_size), stacks_dir=self.out / "stacks"
            )
            said = self._live_words(result.analysis.dumps)
            data = result.to_json()
            if said:
                data["live"] = said
            with Folder(self.out) as folder:
                folder.write("verdict.json", (json.dumps(data, indent=2) + "\n").encode())
            what = "a send/recv" if self.suspected and self.suspected.kind == "p2p" else "a collective"
            self._say(
                f"{what} stalled for over {self.stall_s:g} s (and {self.confirm_s:g} s more to confirm it); "
                f"dumps in {self.out}"
            )
            for sentence in said:
                self._say(sentence)
            from gpudiag.render.hang import text

            text(result, sys.stderr)
        except Exception as exc:  # the job ends either way
            self._say(f"dumps in {self.out}; analysis failed: {exc}")
        if self.store is not None:
            self.store.set(_DONE, "1")

    def _live_words(self, dumped: Any) -> list[str]:
        """What the live states add to the dumps' verdict: ranks in point-to-point waits,
        ranks that wrote no dump — alive but not answering, or gone."""
        said = []
        p2p = live.blocked(self.states, self.stall_s)
        if p2p:
            said.append(p2p)
        here = socket.gethostname()
        for rank in range(self.world_size):
            if rank in dumped or self.store is None:
                continue
            raw = self._get(f"{_PID}{rank}")
            if raw is None:
                continue
            known = json.loads(raw)
            same = known.get("host") == here
            said.append(
                live.not_answering(
                    rank,
                    known.get("pid", 0),
                    known.get("host", ""),
                    here,
                    procs.alive(known.get("pid", 0)) if same else None,
                )
            )
        return said


def _initialized() -> bool:
    try:
        import torch.distributed as dist

        return bool(dist.is_available() and dist.is_initialized())
    except Exception:
        return False
