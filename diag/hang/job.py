"""One job's dumps: which of the dumps given can have been written by one run.

Dumps are found by name in a folder, and names repeat: a rerun with fewer ranks leaves the
earlier run's ``nccl_trace_rank_3`` beside its own, and two jobs' folders get merged. A
verdict on such a mix names an innocent rank (the stale rank 3, "never entered" a
collective of a job it never belonged to). Two dumps cannot be one job when:

- **one ran past the other**: a symmetric collective (all_reduce, barrier…) completes only
  once every member entered it, so when one dump completed the world's collective N, every
  rank's dump records N (or more) — a dump whose world collectives end before N (and whose
  buffer did not wrap) is not of this job: a stale dump of an earlier run;
- **their times contradict** (``time_created_ns``): every member enters a collective that
  completed within its timeout of the first (``timeout_ms``; plus :data:`SLACK_NS` for
  collectives queued behind others and for clocks of different hosts), so two dumps whose
  record of one completed collective lies further apart are of different runs;
- **their world groups differ** (``pg_config`` of group ``"0"``, where the dump lists it:
  NCCL does; gloo lists only the last group created), or a dump's rank is **beyond the
  world** the others' world group lists.

:func:`one_job` keeps the largest set of dumps without a contradiction and names each one
left out (a note the verdict shows: ``hang-dump-left-out``); when no strict majority of
the dumps agrees, it refuses them all (InputError, exit 2): there is no one job to judge.
"""

from __future__ import annotations

from collections import Counter

from gpudiag.errors import InputError
from gpudiag.hang.reader import Dump, Entry

#: Beyond a collective's timeout, how far apart two ranks may record it: a collective queued
#: behind others (async, DDP's buckets) starts its timeout late; hosts' clocks differ.
SLACK_NS = 60_000_000_000
_ROOTED = frozenset({"broadcast", "scatter", "gather", "reduce", "_broadcast_oop", "_reduce_oop"})


def _symmetric(e: Entry) -> bool:
    return not e.is_p2p and e.op.split(" ", 1)[0] not in _ROOTED


def _completed(dump: Dump, e: Entry) -> bool:
    return e.completed or dump.last_completed.get(e.pg_id, -1) >= e.status_id


def _contradicts(a: Dump, b: Dump) -> str | None:
    """Why ``a`` cannot be of the same run as ``b`` (None: it can)."""
    mine = [e.seq for e in a.entries if e.group == "0" and not e.is_p2p]
    done = [e.seq for e in b.entries if e.group == "0" and _symmetric(e) and _completed(b, e)]
    if done and not a.wrapped and max(mine, default=0) < max(done):
        last = f"#{max(mine)}" if mine else "none"
        return (
            f"its last world collective is {last}, and rank {b.rank} completed #{max(done)}, "
            "which needs every rank"
        )
    times = {(e.group, e.seq): e for e in a.entries if _symmetric(e) and e.created_ns is not None}
    for e in b.entries:
        other = times.get((e.group, e.seq))
        if other is None or e.created_ns is None or not (_completed(b, e) or _completed(a, other)):
            continue
        timeout_ns = max(_timeout(e), _timeout(other))
        if abs(other.created_ns - e.created_ns) > timeout_ns + SLACK_NS:
            apart = abs(other.created_ns - e.created_ns) / 1e9
            return (
                f"it recorded {e.desc or e.group} collective #{e.seq} {apart:.0f} s apart from rank {b.rank}"
            )
    return None


def _timeout(e: Entry) -> int:
    return e.timeout_ms * 1_000_000 if e.timeout_ms is not None else 30 * 60 * 1_000_000_000


def _world(dump: Dump) -> int | None:
    ranks = dump.pg_ranks.get("0")
    return len(ranks) if ranks else None


def one_job(dumps: list[Dump], world_size: int | None) -> tuple[list[Dump], list[str]]:
    """The dumps that are one job, and a note per dump left out (module docstring)."""
    if len(dumps) < 2 and world_size is None:
        return dumps, []
    notes: list[str] = []
    worlds = Counter(w for d in dumps if (w := _world(d)) is not None)
    world = world_size or (worlds.most_common(1)[0][0] if worlds else None)
    keep: list[Dump] = []
    for d in dumps:
        w = _world(d)
        if world is not None and w is not None and w != world:
            notes.append(f"{d.path}: its world group has {w} ranks, the job's {world}: another job's dump")
        elif world is not None and world_size is None and d.rank >= world:
            notes.append(
                f"{d.path}: rank {d.rank}, beyond the job's {world} ranks: an earlier, larger run's dump"
            )
        else:
            keep.append(d)
    conflicts: dict[int, dict[int, str]] = {d.rank: {} for d in keep}
    for a in keep:
        for b in keep:
            why = _contradicts(a, b) if a is not b else None
            if why is not None:
                conflicts[a.rank].setdefault(b.rank, why)
                conflicts[b.rank].setdefault(a.rank, f"rank {a.rank}'s dump: {why}")
    alive = {d.rank: d for d in keep}
    while any(conflicts[r].keys() & alive.keys() for r in alive):
        # leave out the dump that contradicts most others; of equals, the oldest (a stale one)
        worst = max(
            alive,
            key=lambda r: (len(conflicts[r].keys() & alive.keys()), -_newest(alive[r])),
        )
        other = min(conflicts[worst].keys() & alive.keys())
        notes.append(f"{alive[worst].path}: not this job's dump ({conflicts[worst][other]}): left out")
        del alive[worst]
    listed = (max(r, default=-1) for d in alive.values() for r in d.pg_ranks.values())
    world = world_size or max(max(alive, default=-1), max(listed, default=-1)) + 1
    holes = [d for d in dumps if d.rank not in alive and d.rank < world]
    if len(alive) * 2 <= len(dumps) or holes:
        why = next((n for n in notes if holes and n.startswith(holes[0].path)), notes[0] if notes else "")
        raise InputError(
            f"these dumps cannot be one job's: {why.removesuffix(': left out')}; give one run's dumps"
        )
    return [alive[r] for r in sorted(alive)], notes


def _newest(dump: Dump) -> int:
    return max((e.created_ns for e in dump.entries if e.created_ns is not None), default=0)
