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

from gpudiag.errors import InputError
from gpudiag.hang.causes import resolve
from gpudiag.hang.groups import ABSENT, ROOTED, Analysis, GroupHang, is_rooted, mesh_dim, span
from gpudiag.hang.job import one_job
from gpudiag.hang.reader import Dump, Entry

__all__ = [
    "ABSENT",
    "MAX_WORLD",
    "ROOTED",
    "Analysis",
    "GroupHang",
    "analyse",
    "is_rooted",
    "mesh_dim",
    "span",
]

#: Most group memberships all dumps together may claim (``pg_config`` ranks of every group):
#: a 2 MB dump of groups listing 100,000 ranks each made 3 GB of sets.
MAX_MEMBERSHIPS = 2_000_000


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
        first = next(iter(recorded.values()))[seq]
        same = (first.op, first.input_sizes, first.input_dtypes)
        if all(
            (per[seq].op, per[seq].input_sizes, per[seq].input_dtypes) == same for per in recorded.values()
        ):
            continue  # (compared as they are: formatting every collective's sizes cost seconds)
        sigs = {rank: _signature(per[seq]) for rank, per in recorded.items()}
        if len(set(sigs.values())) > 1:
            result.mismatches.append((name, recorded[min(recorded)][seq].desc, seq, sigs))
