"""Which rank is stuck, in which collective: the analysis of one job's flight-recorder dumps.

Per process group (its members rebuilt from the entries, since gloo's ``pg_config`` names
only the last group created; the world group is every rank; NCCL's ``pg_config`` adds its
listed ranks): the first collective sequence number N that no member reports completed
(one member's completed report of N means every member entered N). At N each member with
a dump is *in* a collective (its op) or *absent* (its entries in the group end before N);
the expected op is the **majority**'s, never rank 0's; the others are the group's culprits
(a tie is reported as a tie, with no culprit). A member without a dump is *missing*.

Across groups, **cause before consequence**: a group whose absent ranks are all blocked in
another hung group's collective waits because of that group (when two groups wait on each
other, the smaller — the sub-group — is the cause). The root group's collective is the
verdict's ``collective``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from gpudiag.errors import InputError
from gpudiag.hang.reader import Dump, Entry, Frame

ABSENT = "(not in a collective)"


@dataclass
class GroupHang:
    """Group ``group`` (``desc``) waits at collective ``seq``: ``states`` maps each member
    with a dump to its op at ``seq`` or :data:`ABSENT`; ``expected`` is the majority's
    (None on a tie); ``culprits`` the ranks that differ from it; ``missing`` members
    without a dump; ``cause`` the group it waits for (None: a root)."""

    group: str
    desc: str
    members: list[int]
    seq: int
    states: dict[int, str]
    entries: dict[int, Entry]
    expected: str | None
    culprits: list[int]
    missing: list[int]
    cause: str | None = None

    @property
    def label(self) -> str:
        return self.desc if self.desc and self.desc != "undefined" else f"group {self.group}"

    def ranks_in(self) -> list[int]:
        return sorted(r for r, s in self.states.items() if s != ABSENT and s == self.expected)

    def absent(self) -> list[int]:
        return sorted(r for r, s in self.states.items() if s == ABSENT)


@dataclass
class Analysis:
    """What :func:`analyse` found: ``world_size``, the dumps, every hung group (roots
    first), each rank's pending entry (``blocked``), the mismatched sizes of completed
    collectives, and the groups where every member entered the same pending collective."""

    world_size: int
    dumps: dict[int, Dump]
    hangs: list[GroupHang]
    blocked: dict[int, Entry]
    missing: list[int]
    mismatches: list[tuple[str, str, int, dict[int, str]]] = field(default_factory=list)
    all_entered: list[tuple[str, int, str]] = field(default_factory=list)
    #: rank → the user's line in its main thread's stack (``gpudiag run`` wrote it), if any
    stacks: dict[int, Frame] = field(default_factory=dict)
    #: rank → operations its gloo groups ran that no entry lists (:func:`unrecorded`)
    unrecorded: dict[int, int] = field(default_factory=dict)
    #: rank → its last recorded operation, when that is a send or recv not completed
    p2p_pending: dict[int, Entry] = field(default_factory=dict)

    @property
    def roots(self) -> list[GroupHang]:
        return [h for h in self.hangs if h.cause is None]


#: Most ranks of one job judged (as many as dump files one run reads: ``reader.MAX_FILES``):
#: every rank without a dump is named, so a file named ``fr_rank9999999`` made ten million.
MAX_WORLD = 100_000


def _world_size(dumps: list[Dump], given: int | None) -> int:
    seen = max((d.rank for d in dumps), default=-1) + 1
    listed = max((max(r, default=-1) for d in dumps for r in d.pg_ranks.values()), default=-1) + 1
    if given is not None and given < seen:
        raise InputError(f"--world-size {given}: there is a dump of rank {seen - 1}")
    world = max(given or 0, seen, listed)
    if world > MAX_WORLD:
        source = (
            f"{max(dumps, key=lambda d: d.rank).path} (rank {seen - 1})"
            if seen == world
            else f"a pg_config listing rank {listed - 1}"
            if listed == world
            else f"--world-size {given}"
        )
        raise InputError(f"{source}: a job of {world} ranks, more than the {MAX_WORLD:,} gpudiag hang judges")
    return world


def _signature(e: Entry) -> str:
    return f"{e.op} {e.input_sizes} {e.input_dtypes}"


def analyse(dumps: list[Dump], world_size: int | None = None) -> Analysis:
    """The hung groups of one job (module docstring); ``world_size`` when no dump tells it."""
    if not dumps:
        raise InputError("no flight-recorder dumps given")
    ws = _world_size(dumps, world_size)
    by_rank = {d.rank: d for d in dumps}
    names: dict[str, str] = {}
    members: dict[str, set[int]] = {}
    seqs: dict[str, dict[int, dict[int, Entry]]] = {}  # group -> rank -> seq -> entry
    done: dict[str, set[int]] = {}  # group -> sequence numbers some member completed
    for d in dumps:
        for e in d.entries:
            if e.is_p2p:
                continue
            names.setdefault(e.group, e.desc)
            members.setdefault(e.group, set()).add(d.rank)
            seqs.setdefault(e.group, {}).setdefault(d.rank, {})[e.seq] = e
            if e.completed or d.last_completed.get(e.pg_id, -1) >= e.status_id:
                done.setdefault(e.group, set()).add(e.seq)
        for name, ranks in d.pg_ranks.items():
            if name and name in members:
                members[name].update(r for r in ranks if r < ws)
    for name, desc in names.items():
        if name == "0" or desc == "default_pg":
            members[name] = set(range(ws))
    blocked: dict[int, Entry] = {}
    for d in dumps:
        last = [e for e in d.entries if not e.is_p2p]
        if last and not (last[-1].completed or last[-1].seq in done.get(last[-1].group, set())):
            blocked[d.rank] = last[-1]

    hangs: list[GroupHang] = []
    result = Analysis(ws, by_rank, hangs, blocked, sorted(set(range(ws)) - set(by_rank)))
    result.unrecorded = {d.rank: n for d in dumps if (n := unrecorded(d))}
    for d in dumps:  # (the last operation: a p2p one pending means the rank waits there)
        final = max(d.entries, key=lambda e: e.record_id, default=None)
        if final is not None and final.is_p2p and not final.completed:
            result.p2p_pending[d.rank] = final
    for name in sorted(seqs, key=lambda n: (len(members[n]), n)):
        recorded = seqs[name]
        completed = done.get(name, set())
        pending = sorted({s for per in recorded.values() for s in per} - completed)
        _mismatches(result, name, recorded, completed)
        if not pending:
            continue
        seq = pending[0]
        states: dict[int, str] = {}
        entries: dict[int, Entry] = {}
        for rank in sorted(members[name] & set(by_rank)):
            mine = recorded.get(rank, {})
            if seq in mine:
                states[rank], entries[rank] = mine[seq].op, mine[seq]
            elif not mine and by_rank[rank].wrapped:
                continue  # its buffer lost this group's entries: unknown
            elif max(mine, default=0) < seq:
                states[rank] = ABSENT
        missing = sorted(members[name] - set(by_rank))
        votes = Counter(states.values()).most_common()
        tie = len(votes) > 1 and votes[0][1] == votes[1][1]
        expected = None if tie or not votes else votes[0][0]
        culprits = [] if expected is None else sorted(r for r, s in states.items() if s != expected)
        if len(votes) == 1 and expected != ABSENT and not missing:
            sizes = {_signature(e) for e in entries.values()}
            if len(sizes) == 1:
                result.all_entered.append((name, seq, str(expected)))
                continue
        if not culprits and missing and not tie:
            culprits = missing
        hangs.append(
            GroupHang(
                name, names[name], sorted(members[name]), seq, states, entries, expected, culprits, missing
            )
        )
    _causes(result)
    result.hangs.sort(key=lambda h: (h.cause is not None, len(h.members), h.group))
    return result


def unrecorded(dump: Dump) -> int:
    """How many operations ``dump``'s gloo groups ran that it has no entry for: the gaps in
    each group's op_ids (from 1, or from the oldest entry kept when the buffer wrapped).
    gloo (torch 2.14) records no send or recv, but each takes an op_id."""
    ids: dict[int, list[int]] = {}
    for e in dump.entries:
        if e.backend == "gloo" and e.op_id is not None and not e.is_p2p:
            ids.setdefault(e.pg_id, []).append(e.op_id)
    missing = 0
    for found in ids.values():
        found = sorted(set(found))
        start = found[0] if dump.wrapped else 1
        missing += max(0, found[-1] - start + 1 - len(found))
    return missing


def _causes(result: Analysis) -> None:
    """Each hung group whose absent ranks are all blocked in one other hung group waits
    for it; of two groups waiting on each other, the larger waits for the smaller."""
    hung = {h.group: h for h in result.hangs}
    edges: dict[str, str] = {}
    for h in result.hangs:
        absent = h.absent()
        targets = {result.blocked[r].group for r in absent if r in result.blocked}
        if absent and len(targets) == 1 and all(r in result.blocked for r in absent):
            target = targets.pop()
            if target in hung and target != h.group:
                edges[h.group] = target
    for g, target in list(edges.items()):
        if edges.get(target) == g:  # a cycle of two: the sub-group is the cause
            if len(hung[target].members) < len(hung[g].members):
                edges.pop(target, None)
            elif len(hung[g].members) < len(hung[target].members):
                edges.pop(g, None)
    for g, target in edges.items():
        hung[g].cause = target
    for h in result.hangs:  # a root whose majority tied: the sub-group's absent ranks are its cause
        if (
            h.cause is None
            and not h.culprits
            and h.absent()
            and any(x.cause == h.group for x in result.hangs)
        ):
            h.culprits = h.absent()


def _mismatches(
    result: Analysis, name: str, recorded: dict[int, dict[int, Entry]], completed: set[int]
) -> None:
    """Completed collectives whose members recorded other sizes or dtypes."""
    common = set.intersection(*(set(per) for per in recorded.values())) if len(recorded) > 1 else set()
    for seq in sorted(common & completed):
        sigs = {rank: _signature(per[seq]) for rank, per in recorded.items()}
        if len(set(sigs.values())) > 1:
            result.mismatches.append((name, recorded[min(recorded)][seq].desc, seq, sigs))
