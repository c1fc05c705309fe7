"""Which rank is stuck, in which collective: the analysis of one job's flight-recorder dumps.

Per process group (its members rebuilt from the entries, since gloo's ``pg_config`` names
only the last group created; the world group ``"0"`` is every rank; NCCL's ``pg_config``
adds its listed ranks): the first collective sequence number N that some member has not
completed. What a completion proves depends on the operation:

- a **symmetric** collective (all_reduce, all_gather, barrier, reduce_scatter, all_to_all)
  completes on one member only once every member entered it: one member's completion of N
  means N is done for every member;
- a **rooted** one (broadcast, scatter, gather, reduce: :data:`ROOTED`) completes on a
  non-root once it has its data, and on the root once its data has left, whatever the
  other ranks do: a completion counts for that rank alone (a non-root that received its
  broadcast and went on is not the culprit; the ranks still in it are never shown done).

At N each member with a dump is *in* a collective (its op; ``finished`` when it completed
its own part of a rooted one) or *absent* (its entries in the group end before N); the
expected op is the **majority**'s, never rank 0's. A member without a dump is *missing*.

Across groups, **cause before consequence** (:mod:`.causes`): a group whose absent ranks
are all blocked in other hung groups waits because of them; a rank that is in no
collective (computing, in I/O, finished) or has no dump is where waiting ends. The root
groups' first collective is the verdict's ``collective``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from gpudiag.errors import InputError
from gpudiag.hang.reader import Dump, Entry, Frame

ABSENT = "(not in a collective)"
#: Collectives with a root (``src``/``dst``): a completion on one rank proves nothing about
#: the others (torch's names; NCCL's out-of-place variants too).
ROOTED = frozenset({"broadcast", "scatter", "gather", "reduce", "_broadcast_oop", "_reduce_oop"})
#: Most group memberships all dumps together may claim (``pg_config`` ranks of every group):
#: a 2 MB dump of groups listing 100,000 ranks each made 3 GB of sets.
MAX_MEMBERSHIPS = 2_000_000


def is_rooted(op: str) -> bool:
    """Whether ``op`` (``broadcast``, ``gather``…) is a collective with a root."""
    return op.split(" ", 1)[0] in ROOTED


def span(ranks: list[int] | set[int]) -> str:
    """``0-3, 7, 9-12``: ranks as runs of consecutive numbers (huge worlds stay one line)."""
    out: list[str] = []
    ordered = sorted(ranks)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        first, last = ordered[i], ordered[j]
        out.append(
            str(first) if first == last else f"{first}, {last}" if last == first + 1 else f"{first}-{last}"
        )
        i = j + 1
    return ", ".join(out)


def mesh_dim(desc: str) -> str | None:
    """The DeviceMesh dimension a group description names (``mesh_tp`` → ``tp``), if any."""
    if desc.startswith("mesh_") and desc not in ("mesh_default",) and len(desc) > 5:
        return desc[5:]
    return None


@dataclass
class GroupHang:
    """Group ``group`` (``desc``) waits at collective ``seq``: ``states`` maps each member
    with a dump to its op at ``seq`` or :data:`ABSENT`; ``finished`` the members that
    completed their own part of it (a rooted op); ``expected`` is the majority's (None on
    a tie); ``culprits`` the ranks that caused it; ``missing`` members without a dump;
    ``cause`` the root group it waits for (None: a root); ``how`` what named the culprits
    (``majority``, ``outside`` — the only members in no collective —, ``program`` — the
    rank whose sequence of collectives left the others' —, ``subgroup``, or ``tie``)."""

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
    finished: list[int] = field(default_factory=list)
    how: str = "majority"
    #: what showed the culprits, in words, where more than the group's own states did
    evidence: str = ""

    @property
    def label(self) -> str:
        """``tail (ranks 1-3)``, ``mesh dimension tp (ranks 2, 3)``, ``group 4 (ranks 0, 2)``."""
        dim = mesh_dim(self.desc)
        if dim is not None:
            name = f"mesh dimension {dim}"
        else:
            name = self.desc if self.desc and self.desc != "undefined" else f"group {self.group}"
        return f"{name} (ranks {span(self.members)})"

    @property
    def name(self) -> str:
        """The group's description (``default_pg``, ``mesh_tp``), else its name."""
        return self.desc if self.desc and self.desc != "undefined" else self.group

    @property
    def op(self) -> str | None:
        """The operation the group waits in: the expected one, else the one most members are in."""
        if self.expected not in (None, ABSENT):
            return self.expected
        ops = Counter(s for s in self.states.values() if s != ABSENT).most_common(1)
        return ops[0][0] if ops else None

    def ranks_in(self) -> list[int]:
        """Members still in the collective (not those that finished their part of it)."""
        op = self.op
        done = set(self.finished)
        return sorted(r for r, s in self.states.items() if s == op and r not in done)

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
    #: files read but not judged, each with the reason (not a dump; another job's dump)
    skipped: list[str] = field(default_factory=list)

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
    world = given if given is not None else max(seen, listed)
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


def _members(dumps: list[Dump], ws: int) -> tuple[dict[str, str], dict[str, set[int]]]:
    """Each group's description and members: the ranks with entries in it, the ranks its
    ``pg_config`` lists (NCCL), every rank for the world group ``"0"``."""
    names: dict[str, str] = {}
    members: dict[str, set[int]] = {}
    for d in dumps:
        for e in d.entries:
            if not e.is_p2p:
                names.setdefault(e.group, e.desc)
                members.setdefault(e.group, set()).add(d.rank)
    claimed = 0
    for d in dumps:
        for name, ranks in d.pg_ranks.items():
            if name and name in members and name != "0":
                claimed += len(ranks)
                if claimed > MAX_MEMBERSHIPS:
                    raise InputError(
                        f"{d.path}: the dumps' pg_config lists more than {MAX_MEMBERSHIPS:,} group "
                        "memberships, more than gpudiag hang judges"
                    )
                members[name].update(r for r in ranks if 0 <= r < ws)
    if "0" in members:
        members["0"] = set(range(ws))
    return names, members


def analyse(dumps: list[Dump], world_size: int | None = None) -> Analysis:
    """The hung groups of one job (module docstring); ``world_size`` when no dump tells it.
    ``dumps`` may carry ``skipped`` notes (:class:`~gpudiag.hang.reader.Dumps`)."""
    if not dumps:
        raise InputError("no flight-recorder dumps given")
    skipped = list(getattr(dumps, "skipped", []))
    from gpudiag.hang.job import one_job

    dumps, left_out = one_job(list(dumps), world_size)
    skipped += left_out
    ws = _world_size(dumps, world_size)
    by_rank = {d.rank: d for d in dumps}
    names, members = _members(dumps, ws)
    seqs: dict[str, dict[int, dict[int, Entry]]] = {}  # group -> rank -> seq -> entry
    done: dict[str, set[int]] = {}  # group -> sequence numbers done for every member
    own: dict[str, dict[int, set[int]]] = {}  # group -> rank -> sequence numbers it completed
    for d in dumps:
        for e in d.entries:
            if e.is_p2p:
                continue
            seqs.setdefault(e.group, {}).setdefault(d.rank, {})[e.seq] = e
            if e.completed or d.last_completed.get(e.pg_id, -1) >= e.status_id:
                own.setdefault(e.group, {}).setdefault(d.rank, set()).add(e.seq)
                if not is_rooted(e.op):
                    done.setdefault(e.group, set()).add(e.seq)

    def finished(group: str, rank: int, seq: int) -> bool:
        return seq in done.get(group, set()) or seq in own.get(group, {}).get(rank, set())

    blocked: dict[int, Entry] = {}
    for d in dumps:
        last = [e for e in d.entries if not e.is_p2p]
        if last and not finished(last[-1].group, d.rank, last[-1].seq):
            blocked[d.rank] = last[-1]

    hangs: list[GroupHang] = []
    result = Analysis(ws, by_rank, hangs, blocked, sorted(set(range(ws)) - set(by_rank)), skipped=skipped)
    result.unrecorded = {d.rank: n for d in dumps if (n := unrecorded(d))}
    for d in dumps:  # (the last operation: a p2p one pending means the rank waits there)
        final = max(d.entries, key=lambda e: e.record_id, default=None)
        if final is not None and final.is_p2p and not final.completed:
            result.p2p_pending[d.rank] = final
    for name in sorted(seqs, key=lambda n: (len(members[n]), n)):
        recorded = seqs[name]
        _mismatches(result, name, recorded, done.get(name, set()))
        pending = sorted({s for rank, per in recorded.items() for s in per if not finished(name, rank, s)})
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
        hang = GroupHang(
            name, names[name], sorted(members[name]), seq, states, entries, expected, culprits, missing
        )
        hang.finished = sorted(r for r in entries if finished(name, r, seq))
        if len(votes) == 1 and expected != ABSENT and not missing:
            sizes = {_signature(e) for e in entries.values()}
            if len(sizes) == 1 and not hang.finished:
                result.all_entered.append((name, seq, str(expected)))
                continue
        if not culprits and missing and not tie:
            hang.culprits = missing
        hangs.append(hang)
    from gpudiag.hang.causes import resolve

    resolve(result)
    result.hangs.sort(key=lambda h: (h.cause is not None, len(h.members), h.group))
    return result


def unrecorded(dump: Dump) -> int:
    """How many operations ``dump``'s gloo groups ran that it has no entry for: the gaps in
    each group's op_ids (from 1, or from the oldest entry kept when the buffer wrapped),
    and past the last entry up to what ``pg_status`` says was enqueued. gloo (torch 2.14)
    records no send or recv, but each takes an op_id."""
    ids: dict[int, list[int]] = {}
    for e in dump.entries:
        if e.backend == "gloo" and e.op_id is not None and not e.is_p2p:
            ids.setdefault(e.pg_id, []).append(e.op_id)
    missing = 0
    for pg, found in ids.items():
        found = sorted(set(found))
        start = found[0] if dump.wrapped else 1
        last = max(found[-1], dump.last_completed.get(pg, -1))
        missing += max(0, last - start + 1 - len(found))
    return missing


def _mismatches(
    result: Analysis, name: str, recorded: dict[int, dict[int, Entry]], completed: set[int]
) -> None:
    """Completed collectives whose members recorded other sizes or dtypes."""
    common = set.intersection(*(set(per) for per in recorded.values())) if len(recorded) > 1 else set()
    for seq in sorted(common & completed):
        sigs = {rank: _signature(per[seq]) for rank, per in recorded.items()}
        if len(set(sigs.values())) > 1:
            result.mismatches.append((name, recorded[min(recorded)][seq].desc, seq, sigs))
