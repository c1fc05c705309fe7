"""One job's dumps: which of the dumps given can have been written by one run.

Dumps are found by name in a folder, and names repeat: a rerun with fewer ranks leaves the
earlier run's ``nccl_trace_rank_3`` beside its own, and two jobs' folders get merged. A
verdict on such a mix names an innocent rank (the stale rank 3, "never entered" a
collective of a job it never belonged to). Two dumps cannot be one job when:

- **one ran past the other**: a symmetric collective (all_reduce, barrier…) completes only
  once every member entered it, so when one dump completed the world's collective N, every
  rank's dump records N (or more) — a dump whose world collectives end before N (and whose
  buffer did not wrap) is not of this job: a stale dump of an earlier run. (Dumps are
  taken at one moment — torch's dump on timeout, ``gpudiag run``'s alarm; dumps of a
  running job taken minutes apart are set apart by this rule too);
- **their times contradict** (``time_created_ns``): every member enters a collective that
  completed within its timeout of the first (``timeout_ms``; plus :data:`SLACK_NS` for
  collectives queued behind others and for clocks of different hosts), so two dumps whose
  record of one completed collective lies further apart are of different runs;
- **their world groups differ** (``pg_config`` of group ``"0"``, where the dump lists it:
  NCCL does; gloo lists only the last group created), or a dump's rank is **beyond the
  world** the others' world group lists.

:func:`one_job` keeps the dumps no rule sets apart (times are compared with the median of
the dumps' records: the majority decides) and names each one left out (a note the verdict
shows: ``hang-dump-left-out``); when no strict majority of the dumps is left, or one left
out is a rank inside the job's world, it refuses them all (InputError, exit 2): there is no
one job to judge.
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


def _behind(dumps: list[Dump]) -> dict[int, str]:
    """rank → why: dumps whose world collectives end before one another dump completed."""
    last: dict[int, int] = {}
    done: dict[int, int] = {}
    for d in dumps:
        for e in d.entries:
            if e.group == "0" and not e.is_p2p:
                last[d.rank] = max(last.get(d.rank, 0), e.seq)
                if _symmetric(e) and _completed(d, e):
                    done[d.rank] = max(done.get(d.rank, 0), e.seq)
    if not done:
        return {}
    top = max(done.values())
    who = min(r for r, seq in done.items() if seq == top)
    return {
        d.rank: f"its last world collective is {f'#{last[d.rank]}' if d.rank in last else 'none'}, and "
        f"rank {who} completed #{top}, which needs every rank"
        for d in dumps
        if not d.wrapped and last.get(d.rank, 0) < top
    }


def _apart(dumps: list[Dump]) -> dict[int, str]:
    """rank → why: dumps whose record of a completed collective lies further from the
    others' (their median) than its timeout allows."""
    seen: dict[tuple[str, int], list[tuple[int, Entry, bool]]] = {}
    for d in dumps:
        for e in d.entries:
            if e.created_ns is not None and _symmetric(e):
                seen.setdefault((e.group, e.seq), []).append((d.rank, e, _completed(d, e)))
    out: dict[int, str] = {}
    for (_, seq), records in seen.items():
        if len(records) < 2 or not any(done for _, _, done in records):
            continue
        times = sorted(e.created_ns or 0 for _, e, _ in records)
        middle = times[(len(times) - 1) // 2]
        for rank, e, _ in records:
            apart = abs((e.created_ns or 0) - middle)
            if rank not in out and apart > _timeout(e) + SLACK_NS:
                out[rank] = (
                    f"it recorded {e.desc or e.group} collective #{seq} {apart / 1e9:.0f} s apart "
                    "from the others"
                )
    return out


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
    why = _behind(keep)
    for rank, reason in _apart(keep).items():
        why.setdefault(rank, reason)
    alive = {d.rank: d for d in keep if d.rank not in why}
    notes += [f"{d.path}: not this job's dump ({why[d.rank]}): left out" for d in keep if d.rank in why]
    listed = (max(r, default=-1) for d in alive.values() for r in d.pg_ranks.values())
    world = world_size or max(max(alive, default=-1), max(listed, default=-1)) + 1
    holes = [d for d in dumps if d.rank not in alive and d.rank < world]
    if len(alive) * 2 <= len(dumps) or holes:
        reason = next((n for n in notes if holes and n.startswith(holes[0].path)), notes[0] if notes else "")
        raise InputError(
            f"these dumps cannot be one job's: {reason.removesuffix(': left out')}; give one run's dumps"
        )
    return [alive[r] for r in sorted(alive)], notes
