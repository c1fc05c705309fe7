"""The collectives between nodes: each with a deadline and its progress in the group's
store, so a rank that hangs is named (which rank, which collective). The all-gather of
the records, the all-reduce across every rank with a value check, and the pairwise link
test's rounds (:mod:`gpudiag.repro.sweep.judge` plans and judges them)."""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from gpudiag.errors import GpudiagError
from gpudiag.repro.sweep.budget import SKIPPED, WRITE_RESERVE_S, Budget
from gpudiag.repro.sweep.links import first_round, judge_round, next_round, pair_figures, pair_rounds
from gpudiag.repro.sweep.node import Identity, SweepOptions
from gpudiag.repro.sweep.problems import median
from gpudiag.repro.sweep.rules import load_rules

MAX_ROUNDS = 4  # of the pairwise link test: round 1, then at most 3 re-pairing rounds
#: The collectives ``--inject-stall`` can make this node miss (a hang rehearsed).
STALLABLE = (
    "gather-records",
    "allreduce-all",
    "gather-allreduce",
    "pair-round1",
    "gather-round1",
    "gather-bundles",
)


class CollectiveHung(GpudiagError):
    """A collective did not finish by its deadline."""

    def __init__(self, name: str, seq: int, detail: str):
        super().__init__(f"{name} (collective #{seq}) did not finish: {detail}")
        self.name, self.seq = name, seq


class Progress:
    """Each rank's place among the sweep's collectives, kept in the group's store: before
    a collective ``"<seq> in <name>"``, after it ``"<seq> out <name>"``. When one times
    out, :meth:`stuck` reads every rank's entry and names the ranks that are behind.

    The store is the one the group was made with (``env://``'s TCPStore), reached through
    torch's ``distributed_c10d._get_default_store`` — a private function (present in torch
    2.15), so guarded: without it nothing is marked and a hang is reported unnamed."""

    def __init__(self, dist: Any, rank: int, world: int):
        self.rank, self.world, self.seq = rank, world, 0
        self.store: Any = None
        default_store = getattr(dist.distributed_c10d, "_get_default_store", None)
        if default_store is not None:
            with contextlib.suppress(Exception):
                self.store = dist.PrefixStore("gpudiag-sweep/", default_store())

    def mark(self, state: str, name: str) -> None:
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.set(f"at/{self.rank}", f"{self.seq} {state} {name}")

    def post(self, key: str, value: str) -> None:
        """Leave ``value`` in the store under ``key`` (best effort)."""
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.set(key, value)

    def posted(self, key: str) -> str | None:
        """What :meth:`post` left under ``key``, or None (never waits)."""
        if self.store is None:
            return None
        try:
            return self.store.get(key).decode() if self.store.check([key]) else None
        except Exception:
            return None

    def check_in(self) -> None:
        """Say this rank still answers (after a collective failed: :meth:`silent`)."""
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.set(f"alive/{self.rank}", str(self.seq))

    def silent(self, wait_s: float) -> list[int]:
        """The ranks that have not checked in (:meth:`check_in`) within ``wait_s`` seconds:
        those that stopped answering — a process that ended, a node gone. [] without a store."""
        if self.store is None:
            return []
        end = time.monotonic() + wait_s
        missing = list(range(self.world))
        while missing:
            with contextlib.suppress(Exception):
                missing = [r for r in missing if not self.store.check([f"alive/{r}"])]
            if not missing or time.monotonic() > end:
                break
            time.sleep(0.1)
        return missing

    def stuck(self, waiting_in: str = "the next collective") -> list[tuple[int, str]]:
        """(rank, where) for the ranks furthest behind; [] when none stands out.
        ``waiting_in``: the collective the others timed out in."""
        if self.store is None:
            return []
        places: dict[int, tuple[int, str, str]] = {}
        for rank in range(self.world):
            key = f"at/{rank}"
            try:
                value = self.store.get(key).decode() if self.store.check([key]) else "0 out start"
                seq, state, name = value.split(" ", 2)
                places[rank] = (int(seq), state, name)
            except Exception:
                places[rank] = (0, "out", "start")
        lowest = min(p[0] for p in places.values())
        behind = [r for r, p in places.items() if p[0] == lowest]
        if len(behind) == self.world and len({p[1] for p in places.values()}) == 1:
            return []
        out = []
        for rank in behind:
            seq, state, name = places[rank]
            where = (
                f"inside {name} (collective #{seq})"
                if state == "in"
                else f"after {name}, never entered {waiting_in}"
            )
            out.append((rank, where))
        return out


class Between:
    """The collectives between nodes, each with a deadline and tracked progress."""

    def __init__(
        self,
        ident: Identity,
        options: SweepOptions,
        backend: str,
        timeout: float | None = None,
        budget: Budget | None = None,
    ):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.ident, self.options, self.backend = ident, options, backend
        self.device = torch.device(f"cuda:{ident.local_rank}") if backend == "nccl" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.progress = Progress(dist, ident.rank, ident.world)
        self.timeout = options.phase_timeout if timeout is None else timeout  # each collective's
        self.deadline = datetime.timedelta(seconds=self.timeout)
        self.budget = budget or Budget(None)
        #: Python objects (records, rounds, bundles) travel over gloo: under NCCL a side
        #: group on the CPU (as torch's monitored_barrier does), so they neither occupy the
        #: GPUs nor meet NCCL's watchdog, which tears the process down on a timeout.
        self.objects: Any = None
        if backend == "nccl":
            with self.collective("new-group-gloo"):
                self.objects = dist.new_group(backend="gloo", timeout=self.deadline)

    @contextlib.contextmanager
    def collective(self, name: str) -> Iterator[None]:
        self.progress.seq += 1
        if self.options.stall == name:  # rehearsal: this rank never arrives
            time.sleep(self.options.phase_timeout * 2)
        self.progress.mark("in", name)
        if self.options.stall == f"{name}:kill":  # rehearsal: this node dies inside it
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            yield
        except Exception as exc:
            if isinstance(exc, CollectiveHung):
                raise
            raise CollectiveHung(
                name, self.progress.seq, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            ) from None
        self.progress.mark("out", name)

    def gather_to_first(self, name: str, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on rank 0 (``gather_object``); the other ranks get []."""
        out: list[Any] = [None] * self.ident.world
        with self.collective(name):
            self.dist.gather_object(obj, out if self.ident.rank == 0 else None, dst=0, group=self.objects)
        return out if self.ident.rank == 0 else []

    def wait(self, work: Any) -> None:
        if not work.wait(timeout=self.deadline):
            raise RuntimeError(f"no answer within {self.timeout:g} s")

    def all_gather(self, name: str, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.ident.world
        with self.collective(name):
            self.dist.all_gather_object(out, obj, group=self.objects)
        return out

    def allreduce_all(self, faults: Any) -> dict[str, Any]:
        """Every rank contributes rank+1; each element must come back as W(W+1)/2."""
        from gpudiag.runtime.faults import corrupt

        torch, n = self.torch, self.options.nbytes // 4
        buf = torch.full((n,), float(self.ident.rank + 1), dtype=torch.float32, device=self.device)
        expected = self.ident.world * (self.ident.world + 1) / 2
        start = time.perf_counter()
        with self.collective("allreduce-all"):
            self.wait(self.dist.all_reduce(buf, async_op=True))
        seconds = time.perf_counter() - start
        if self.ident.leader:
            for fault in faults.due_on_rank(self.ident.node, 1):
                buf = corrupt(buf, fault)
        wrong = int((buf != expected).sum().item())
        return {
            "ok": wrong == 0,
            "wrong": wrong,
            "expected": expected,
            "elements": n,
            "seconds": round(seconds, 6),
        }

    def pair_groups(self, rnd: int, ranks: list[tuple[int, int]]) -> list[Any]:
        """One process group per pair of the round, created by every rank in the same order
        (``new_group`` is collective; measured: groups made with
        ``use_local_synchronization=True`` hung on gloo once pairs were re-formed)."""
        with self.collective(f"new-groups-round{rnd}"):
            return [self.dist.new_group(sorted(pair)) for pair in ranks]

    def pair_test(self, rnd: int, group: Any, peer_node: int, faults: Any) -> dict[str, Any]:
        """This leader's side of one pair: ``iters`` timed all-reduces, then one checked."""
        from gpudiag.runtime.faults import corrupt

        torch, dist = self.torch, self.dist
        n = self.options.nbytes // 4
        name = f"pair-round{rnd}"
        with self.collective(name):
            buf = torch.ones(n, dtype=torch.float32, device=self.device)
            self.wait(dist.all_reduce(buf, group=group, async_op=True))  # warm-up
            seconds = math.inf  # the fastest of the timed all-reduces: robust to a busy host
            for _ in range(self.options.repeats):
                start = time.perf_counter()
                if self.options.delay:
                    time.sleep(self.options.delay)
                self.wait(dist.all_reduce(buf, group=group, async_op=True))
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                seconds = min(seconds, time.perf_counter() - start)
            buf.fill_(float(self.ident.node + 1))
            self.wait(dist.all_reduce(buf, group=group, async_op=True))
        for fault in faults.due(peer_node, self.ident.node, rnd):
            buf = corrupt(buf, fault)
        expected = float(self.ident.node + 1 + peer_node + 1)
        wrong = int((buf != expected).sum().item())
        busbw = self.options.nbytes / seconds / 1e9  # two ranks: busbw = algbw × 2(2−1)/2
        return {
            "round": rnd,
            "peer": peer_node,
            "busbw_gbps": round(busbw, 6),
            "ok": wrong == 0,
            "wrong": wrong,
        }


@dataclass
class Outcome:
    """What the between-node phase has learnt so far, kept as it goes so that rank 0 can
    still write the results when a later collective hangs."""

    records: dict[int, dict[str, Any]] = field(default_factory=dict)  # node → record
    notes: list[str] = field(default_factory=list)
    bundles: dict[str, bytes] = field(default_factory=dict)  # host → zip (rank 0)
    failure: GpudiagError | Exception | None = None
    stuck: list[tuple[int, str]] = field(default_factory=list)  # (rank, where) behind the others

    def ordered(self) -> list[dict[str, Any]]:
        return [self.records[k] for k in sorted(self.records)]


def between_nodes(b: Between, record: dict[str, Any] | None, out: Outcome) -> None:
    """The all-gather of records, the all-node all-reduce (results all-gathered), the
    pairwise rounds (each round's results all-gathered, so every rank plans the next round
    from the same facts). ``out.records`` holds every leader's record as it grows."""
    from gpudiag.runtime.faults import FaultPlan

    ident = b.ident
    faults = FaultPlan.parse(list(b.options.inject))
    gathered = b.all_gather(
        "gather-records", None if record is None else {"record": record, "rank": ident.rank}
    )
    leaders = {g["record"]["node"]: g["rank"] for g in gathered if g is not None}
    out.records = {g["record"]["node"]: g["record"] for g in gathered if g is not None}
    result = b.allreduce_all(faults)
    for item in b.all_gather("gather-allreduce", None if record is None else (ident.node, result)):
        if item is not None:
            out.records[item[0]]["allreduce"] = item[1]
    rules = load_rules(b.options.rules)
    history: dict[int, Any] = {}
    pairs = first_round(list(leaders))
    rnd = 1
    while pairs:
        if rnd > MAX_ROUNDS:
            out.notes.append(f"pairwise link test stopped after {MAX_ROUNDS} rounds; nodes left untested")
            break
        entry = None
        began = time.monotonic()
        groups = b.pair_groups(rnd, [(leaders[x], leaders[y]) for x, y in pairs])
        for (x, y), group in zip(pairs, groups, strict=True):
            if record is not None and ident.node in (x, y):
                entry = b.pair_test(rnd, group, y if ident.node == x else x, faults)
        mine = {
            "entry": None if entry is None else (ident.node, entry),
            "left": b.budget.left(),  # (every rank decides on the next round from the same numbers)
            "took": time.monotonic() - began,
        }
        shared = b.all_gather(f"gather-round{rnd}", mine)
        least, took = min(g["left"] for g in shared), max(g["took"] for g in shared)
        for item in (g["entry"] for g in shared):
            if item is not None:
                rec = out.records[item[0]]
                rec["pairs"] = [*(rec.get("pairs") or []), item[1]]
                bws = [p["busbw_gbps"] for p in rec["pairs"] if isinstance(p.get("busbw_gbps"), (int, float))]
                rec.setdefault("figures", {})["pair_busbw_gbps"] = max(bws) if bws else None
        rounds = pair_rounds(out.ordered())
        reference = None
        if rnd > 1:  # later rounds compare with round 1's good pairs
            good = [pair_figures(rounds[1][p])[0] for p, o in history[1].items() if o == "good"]
            reference = median([g for g in good if g is not None])
        history[rnd] = judge_round(rounds.get(rnd, {}), float(rules["pair_slow_fraction"]), reference)
        pairs = next_round(list(leaders), history)
        rnd += 1
        if pairs and least - WRITE_RESERVE_S < took:  # (the last round's time, again)
            out.notes.append(
                f"pairwise link test: round {rnd} {SKIPPED} ({max(0.0, least):.1f} s left on the node "
                f"with the least; a round took {took:.1f} s); nodes left untested"
            )
            break
