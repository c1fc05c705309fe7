"""The watchdog of ``gpudiag run``: a thread per rank that ends a hung job with a verdict.

Every ``poll_s`` seconds it reads this rank's flight record's ``pg_status``
(``_dump_fr_trace_json(includeCollectives=False)``, torch's private function, through
``getattr``); when nothing has moved for ``stall_s`` it reads the entries, and when a
collective has been pending longer than
``stall_s`` seconds, or another rank has raised the alarm in the job's store (a client of
torchrun's TCP store at ``MASTER_ADDR:MASTER_PORT``), it writes into ``out``:

- ``fr_rank<R>.pkl`` — the rank's dump (``_dump_fr_trace``, with Python frames),
- ``stacks/rank<R>.json`` — the Python stack of every thread (what no dump shows: where a
  rank outside any collective is),

then the first rank to notice waits (at most ``gather_s``) for every rank's files, prints
the verdict of :mod:`gpudiag.hang` on stderr, and every rank ends with exit 1 instead of
waiting for the backend's timeout. Until then it writes nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

#: Store keys, under the job's run id.
_ALARM = "gpudiag/hang/alarm"
_DUMPED = "gpudiag/hang/dumped"
_DONE = "gpudiag/hang/done"
_FINISHED = "gpudiag/hang/finished"


def pending_for(record: dict[str, Any], now_ns: int) -> float:
    """Seconds the oldest collective still pending in a JSON flight record has waited (0: none)."""
    oldest = 0.0
    for e in record.get("entries") or ():
        if not isinstance(e, dict) or e.get("state") == "completed" or e.get("retired") is True:
            continue
        created = e.get("time_created_ns")
        if isinstance(created, int) and created > 0:
            oldest = max(oldest, (now_ns - created) / 1e9)
    return oldest


def _load(raw: Any) -> dict[str, Any]:
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


def thread_stacks() -> dict[str, list[dict[str, Any]]]:
    """Every thread's Python stack, innermost frame first (the flight recorder's order)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = {}
    for ident, frame in sys._current_frames().items():
        frames = []
        f: Any = frame
        while f is not None:
            frames.append({"filename": f.f_code.co_filename, "line": f.f_lineno, "name": f.f_code.co_name})
            f = f.f_back
        out[names.get(ident, str(ident))] = frames
    return out


class Watchdog(threading.Thread):
    """One rank's watchdog (module docstring); ``start()`` it before the user's script runs."""

    def __init__(self, stall_s: float, out: Path, poll_s: float = 1.0, gather_s: float = 15.0):
        super().__init__(name="gpudiag-hang-watchdog", daemon=True)
        self.stall_s, self.out, self.poll_s, self.gather_s = stall_s, out, poll_s, gather_s
        self.by = "gpudiag run"  # who says so on stderr ("gpudiag.watch" when armed from code)
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.store: Any = None
        self.finished = False  # the script ended on this rank (set by finish())
        self.stopping = threading.Event()  # set: the thread ends at its next poll (bench)
        # held by the one thread that dumps and ends the rank: a rank whose script ended
        # sees the alarm both in finish() and in this thread, and must count once
        self.ending = threading.Lock()

    def _connect(self) -> Any:
        import datetime

        import torch.distributed as dist

        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            return None
        store = dist.TCPStore(addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=30))
        return dist.PrefixStore(f"gpudiag-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}", store)

    def run(self) -> None:
        try:
            import torch.distributed as dist
        except Exception:
            return
        last_key: Any = None
        since = checked = time.monotonic()
        while not self.stopping.wait(self.poll_s):
            if not dist.is_available() or not dist.is_initialized():
                continue
            try:
                if self.store is None:
                    self.store = self._connect()
                if self.store is not None and self.store.check([_ALARM]):
                    return self._end(leader=False)
                key, busy = progress(_load(self._dump(json_format=True, collectives=False)))
                now = time.monotonic()
                if key != last_key:
                    last_key, since = key, now
                    continue
                if not busy or now - since <= self.stall_s or now - checked <= self.stall_s:
                    continue
                checked = now  # no progress for stall_s with a collective enqueued: read the entries
                record = _load(self._dump(json_format=True, collectives=True))
            except Exception:
                continue
            if pending_for(record, time.time_ns()) > self.stall_s:
                leader = self.store is None or self.store.add(_ALARM, 1) == 1
                return self._end(leader)

    def finish(self) -> None:
        """The script ended normally on this rank: wait until every rank has ended (then
        return) or another rank raises the alarm (then dump, saying so, and end with 1) —
        a rank that ends while the others wait in a collective is the hang's cause, and
        its exit would turn their wait into a "connection closed" error that says nothing."""
        try:
            import torch.distributed as dist

            if self.store is None and dist.is_available() and dist.is_initialized():
                self.store = self._connect()
        except Exception:
            return
        if self.store is None:
            return
        self.finished = True
        try:
            self.store.add(_FINISHED, 1)
            while self.store.add(_FINISHED, 0) < self.world_size:
                if self.store.check([_ALARM]):
                    self._end(leader=False)
                time.sleep(0.2)
        except Exception:
            return

    @staticmethod
    def _dump(json_format: bool, collectives: bool = True) -> Any:
        """This rank's flight record through torch's private functions (``getattr``): NCCL
        keeps its own recorder (``_dump_nccl_trace``), gloo's is ``_dump_fr_trace`` (which
        takes ``backend=`` from torch 2.15)."""
        import torch
        import torch.distributed as dist

        c10d = getattr(torch._C, "_distributed_c10d", None)
        suffix = "_json" if json_format else ""
        backend = str(dist.get_backend())
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

    def _write(self) -> None:
        (self.out / "stacks").mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(Exception):  # (a rank whose recorder cannot dump is named missing)
            (self.out / f"fr_rank{self.rank}.pkl").write_bytes(bytes(self._dump(json_format=False)))
        stacks = json.dumps({**thread_stacks(), "_finished": self.finished}, indent=1)
        (self.out / "stacks" / f"rank{self.rank}.json").write_text(stacks)

    def _end(self, leader: bool) -> None:
        if not self.ending.acquire(blocking=False):  # the other thread (finish() or run()) ends it
            while True:
                time.sleep(60)
        try:
            self._write()
            if self.store is not None:
                self.store.add(_DUMPED, 1)
            if leader:
                self._verdict()
            elif self.store is not None:
                deadline = time.monotonic() + self.gather_s + 10
                while time.monotonic() < deadline and not self.store.check([_DONE]):
                    time.sleep(0.2)
        finally:
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
        from gpudiag.hang.reader import read_dumps
        from gpudiag.hang.result import judge

        try:
            result = judge(
                analyse(read_dumps([str(self.out)]), self.world_size), stacks_dir=self.out / "stacks"
            )
            (self.out / "verdict.json").write_text(json.dumps(result.to_json(), indent=2) + "\n")
            sys.stderr.write(
                f"{self.by}: a collective stalled for over {self.stall_s:g} s; dumps in {self.out}\n"
            )
            from gpudiag.render.hang import text

            text(result, sys.stderr)
        except Exception as exc:  # the job ends either way
            sys.stderr.write(f"{self.by}: dumps in {self.out}; analysis failed: {exc}\n")
        if self.store is not None:
            self.store.set(_DONE, "1")
