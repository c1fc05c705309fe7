"""Cause before consequence: which hung group is the root, and who its culprits are.

A rank blocked in a collective waits for the members that are not in it. Following those
waits from group to group ends at a rank that is in no collective (computing, in I/O, in
a send or recv gloo does not record, finished) or has no dump — the culprit — or at a
member that called another collective than the group's majority. Per hung group
(:class:`~gpudiag.hang.analysis.GroupHang`):

- every member in the same **rooted** collective, some having finished their part (a
  non-root that received its broadcast), the others still in it: a root; no member is
  named (they disagree on the root, a wrong ``src``, or the root's data never left);
- members in **different** collectives: a root; the majority's op is the expected one;
- one collective, and absent members **outside** any collective or missing: a root, and
  those are its culprits — also in a 2-member group (a two-rank job whose rank 1 computes
  while rank 0 waits is not a tie) — unless most members are outside and only a few
  entered it, which makes the few the culprits (``hang-extra-collective``);
- one collective, and every absent member **blocked in other hung groups**: a consequence
  of the group those lead to.

Groups that only wait on each other (tp × dp layouts: rank 2 waits in tp for rank 3, which
waits in the world's barrier for rank 2) are resolved by the **program**: every rank of an
SPMD job runs the same sequence of collectives, so the first record where one rank's
(group role, op) differs from the majority's names the rank that left it (the role is the
group's description — ``mesh_tp`` — or its place among the rank's groups). Failing that,
the smaller group of a cycle is the cause (a sub-group's skipped collective leaves the
others waiting in the larger one); with groups of one size, a tie is said as a tie.
"""

from __future__ import annotations

from collections import Counter

from gpudiag.hang.groups import ABSENT, Analysis, GroupHang, is_rooted
from gpudiag.hang.reader import Dump


def resolve(a: Analysis) -> None:
    """Set each hung group's ``culprits``, ``how`` and ``cause`` (module docstring)."""
    hung = {h.group: h for h in a.hangs}
    edges: dict[str, set[str]] = {}
    for h in a.hangs:
        target = _classify(a, h, hung)
        if target:
            edges[h.group] = target
    unresolved = [h for h in a.hangs if h.group in edges and _root_of(h.group, edges, hung) is None]
    unresolved += [h for h in a.hangs if h.group not in edges and h.how == "tie"]
    if unresolved:
        found = program_deviants(a.dumps)
        if found is not None:
            deviants = set(found[0])
            _, record, majority, theirs = found
            for h in unresolved:
                others = {s for r, s in h.states.items() if r not in deviants and s != ABSENT}
                reference = others.pop() if len(others) == 1 else h.op  # (the op the others are in)
                left = sorted(
                    r for r in deviants if (r in h.states and h.states[r] != reference) or r in h.missing
                )
                if left:
                    h.culprits, h.how = left, "program"
                    if h.expected is None and reference is not None:
                        h.expected = reference
                    steps = "; ".join(f"rank {r}: {theirs[r]}" for r in left if r in theirs)
                    h.evidence = (
                        f"its sequence of collectives left the others' at record {record}: "
                        f"they called {majority}, {steps}"
                    )
                    edges.pop(h.group, None)
    for h in a.hangs:  # a cycle nobody left: its smallest group is the cause
        if h.group in edges and _root_of(h.group, edges, hung) is None:
            cycle = _reach(h.group, edges)
            smallest = min(len(hung[g].members) for g in cycle)
            small = [hung[g] for g in sorted(cycle) if len(hung[g].members) == smallest]
            if len(small) == 1 and all(len(hung[g].members) > smallest for g in cycle if g != small[0].group):
                small[0].culprits, small[0].how = small[0].absent(), "subgroup"
                small[0].evidence = "the smaller group of those waiting on each other"
                edges.pop(small[0].group, None)
    for h in a.hangs:
        if h.group in edges:
            root = _root_of(h.group, edges, hung)
            if root is not None:
                h.cause, h.culprits = root, []
            else:  # waits in a cycle no evidence breaks: a tie
                edges.pop(h.group)
                h.culprits, h.how = [], "tie"


def _classify(a: Analysis, h: GroupHang, hung: dict[str, GroupHang]) -> set[str]:
    """Decide ``h`` alone where its members say enough; the groups it waits for when it
    is a consequence (empty set: ``h`` is a root, or a tie)."""
    ops = Counter(s for s in h.states.values() if s != ABSENT)
    absent = h.absent()
    elsewhere = {r: a.blocked[r].group for r in absent if r in a.blocked and a.blocked[r].group in hung}
    loose = [r for r in absent if r not in elsewhere]  # in no collective (or in an unhung one)
    if len(ops) == 1 and not absent and not h.missing:
        op = next(iter(ops))
        if is_rooted(op) and h.finished:
            h.culprits, h.how, h.expected = [], "rooted", op
        return set()
    if len(ops) > 1:
        if h.expected is None:
            h.how = "tie"
        return set()
    if loose or h.missing:
        if h.expected == ABSENT and not h.missing and len(loose) == len(absent):
            h.culprits = sorted(r for r, s in h.states.items() if s != ABSENT)
        else:
            h.culprits = sorted(set(loose) | set(h.missing))
            h.how = "majority" if h.expected not in (None, ABSENT) else "outside"
        return set()
    targets = set(elsewhere.values()) - {h.group}
    if not targets:
        h.how = "tie" if h.expected is None else h.how
    return targets


def _reach(start: str, edges: dict[str, set[str]]) -> set[str]:
    seen = {start}
    todo = [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _root_of(start: str, edges: dict[str, set[str]], hung: dict[str, GroupHang]) -> str | None:
    """The first group reachable from ``start`` that is a root (not itself waiting)."""
    order = [start]
    seen = {start}
    i = 0
    while i < len(order):
        g = order[i]
        i += 1
        if g not in edges and g != start:
            return g
        for nxt in sorted(edges.get(g, ())):
            if nxt not in seen and nxt in hung:
                seen.add(nxt)
                order.append(nxt)
    return None


def _roles(dump: Dump) -> dict[str, str]:
    """Group name → its role in this rank's program: ``world``, the description (``mesh_tp``,
    a user's ``group_desc``), else ``#i`` — its place among the rank's groups by creation
    (gloo names groups by a counter every rank advances alike)."""
    descs: dict[str, str] = {}
    for e in dump.entries:
        if not e.is_p2p:
            descs.setdefault(e.group, e.desc)
    others = sorted(
        (g for g in descs if g != "0"), key=lambda g: (not g.isdigit(), int(g) if g.isdigit() else 0, g)
    )
    roles = {g: descs[g] if descs[g] not in ("", "undefined") else f"#{i}" for i, g in enumerate(others)}
    roles["0"] = "world"
    return roles


#: What :func:`program_deviants` returns: the ranks, the record, the majority's step, theirs.
Deviation = tuple[list[int], int, str, dict[int, str]]


def program_deviants(dumps: dict[int, Dump]) -> Deviation | None:
    """The ranks whose sequence of collectives first left the majority's: (ranks, record
    id, the majority's ``role op``, each deviant's); None when the ranks never disagree or
    the first disagreement has no strict majority (two ranks). Only ranks with the same
    roles are compared (a rank outside a sub-group runs another program by design), and
    point-to-point entries make programs differ by design (pipelines): dumps holding any
    are not compared."""
    classes: dict[frozenset[str], dict[int, dict[int, str]]] = {}
    for rank, dump in dumps.items():
        if any(e.is_p2p for e in dump.entries):
            return None
        roles = _roles(dump)
        mine = {e.record_id: f"{roles.get(e.group, e.group)} {e.op}" for e in dump.entries}
        classes.setdefault(frozenset(roles.values()), {})[rank] = mine
    found: list[Deviation] = []
    for programs in classes.values():
        if len(programs) >= 3:
            one = _first_deviation(programs)
            if one is not None:
                found.append(one)
    if not found:
        return None
    ranks = sorted({r for f in found for r in f[0]})
    first = min(found, key=lambda f: f[1])
    return ranks, first[1], first[2], {r: s for f in found for r, s in f[3].items()}


def _first_deviation(programs: dict[int, dict[int, str]]) -> Deviation | None:
    steps: dict[int, dict[int, str]] = {}
    for rank, mine in programs.items():
        for record, step in mine.items():
            steps.setdefault(record, {})[rank] = step
    for record in sorted(steps):
        votes = Counter(steps[record].values()).most_common()
        if len(votes) < 2:
            continue
        if votes[0][1] * 2 <= sum(n for _, n in votes) or votes[0][1] < 2:
            return None
        majority = votes[0][0]
        left = {r: s for r, s in steps[record].items() if s != majority}
        return sorted(left), record, majority, left
    return None
