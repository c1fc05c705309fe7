"""The pairwise link test's plan and judgement (pure): pairs of nodes in round 1
(:func:`first_round`); the nodes of a slow or corrupting pair re-paired with known-good
nodes in the next rounds (:func:`next_round`); a node bad in both is the culprit
(``node-link-slow``, ``node-link-corrupt``), one fine the second time is cleared
(:func:`localise`). ``between.py`` runs the rounds; ``judge.py`` reads their outcome."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpudiag.repro.sweep.problems import Problem, leave_one_out_medians, median
from gpudiag.repro.sweep.rules import DEFAULT_RULES


def pair_rounds(
    records: Sequence[Mapping[str, Any]],
) -> dict[int, dict[tuple[int, int], list[Mapping[str, Any]]]]:
    """round → (node a, node b) → the two nodes' entries of that pair test."""
    rounds: dict[int, dict[tuple[int, int], list[Mapping[str, Any]]]] = {}
    for rec in records:
        for entry in rec.get("pairs") or []:
            a, b = sorted((int(rec["node"]), int(entry["peer"])))
            rounds.setdefault(int(entry["round"]), {}).setdefault((a, b), []).append(entry)
    return rounds


def pair_figures(entries: list[Mapping[str, Any]]) -> tuple[float | None, bool]:
    """A pair's bus bandwidth (the slower end's) and whether both ends saw the right values."""
    bws = [float(e["busbw_gbps"]) for e in entries if isinstance(e.get("busbw_gbps"), (int, float))]
    return (min(bws) if bws else None), all(bool(e.get("ok")) for e in entries)


def first_round(nodes: Sequence[int]) -> list[tuple[int, int]]:
    """Round 1: neighbours in node order; with an odd count the last node waits for round 2."""
    ordered = sorted(nodes)
    return [(ordered[i], ordered[i + 1]) for i in range(0, len(ordered) - 1, 2)]


def judge_round(
    pairs: Mapping[tuple[int, int], list[Mapping[str, Any]]],
    slow_fraction: float,
    reference: float | None = None,
) -> dict[tuple[int, int], str]:
    """Each pair → ``good``, ``slow`` or ``corrupt``. Slow: below ``slow_fraction`` of
    ``reference`` (default: the median of the round's other pairs; one pair alone is
    never slow)."""
    figures = {pair: pair_figures(entries) for pair, entries in pairs.items()}
    keys = [p for p in figures if figures[p][0] is not None]
    others = leave_one_out_medians([figures[p][0] for p in keys])
    refs = dict(zip(keys, others, strict=True))
    out = {}
    for pair, (bw, ok) in figures.items():
        ref = reference if reference is not None else refs.get(pair)
        if not ok:
            out[pair] = "corrupt"
        elif bw is not None and ref is not None and bw < slow_fraction * ref:
            out[pair] = "slow"
        else:
            out[pair] = "good"
    return out


def next_round(
    all_nodes: Sequence[int], history: Mapping[int, Mapping[tuple[int, int], str]]
) -> list[tuple[int, int]]:
    """The pairs of the next round: every node not yet cleared (in a bad pair whose partner
    was not known-good, or never paired) with a distinct known-good node; none when
    nothing is left to tell apart or no node is known-good."""
    good, culprits = _standing(history)
    waiting = [n for n in sorted(all_nodes) if n not in good and n not in culprits]
    partners = sorted(good)
    return [(w, partners[i]) for i, w in enumerate(waiting[: len(partners)])]


def _standing(
    history: Mapping[int, Mapping[tuple[int, int], str]],
) -> tuple[set[int], dict[int, tuple[str, int]]]:
    """(known-good nodes, culprits: node → (slow | corrupt, the round that proved it))."""
    good: set[int] = set()
    culprits: dict[int, tuple[str, int]] = {}
    for rnd in sorted(history):
        for (a, b), outcome in history[rnd].items():
            if outcome == "good":
                good |= {a, b}
                continue
            for node, partner in ((a, b), (b, a)):
                if partner in good and node not in good:  # bad with a known-good partner
                    culprits.setdefault(node, (outcome, rnd))
    return good, culprits


def localise(
    records: Sequence[Mapping[str, Any]], rules: Mapping[str, Any]
) -> tuple[dict[int, Problem], dict[int, str]]:
    """The culprits of the pairwise link test (node → Problem) and notes per node (cleared,
    or left unresolved for want of a known-good node)."""
    rounds = pair_rounds(records)
    hosts = {int(r["node"]): str(r["host"]) for r in records}
    frac = float(rules.get("pair_slow_fraction", DEFAULT_RULES["pair_slow_fraction"]))
    history: dict[int, dict[tuple[int, int], str]] = {}
    reference: float | None = None
    for rnd in sorted(rounds):
        history[rnd] = judge_round(rounds[rnd], frac, reference)
        if reference is None:  # later rounds compare with round 1's good pairs
            fine = [pair_figures(rounds[rnd][p])[0] for p, o in history[rnd].items() if o == "good"]
            reference = median([g for g in fine if g is not None])
    good, culprits = _standing(history)
    good_since: dict[int, int] = {}  # node → the first round it was in a good pair
    for rnd in sorted(history):
        for pair, outcome in history[rnd].items():
            for member in pair if outcome == "good" else ():
                good_since.setdefault(member, rnd)
    problems: dict[int, Problem] = {}
    notes: dict[int, str] = {}

    def name(node: int) -> str:
        return hosts.get(node, f"node #{node}")

    for node, (outcome, rnd) in culprits.items():
        pair = next(p for p in rounds[rnd] if node in p)
        partner = pair[0] if pair[1] == node else pair[1]
        bw, _ = pair_figures(rounds[rnd][pair])
        where = f"with known-good {name(partner)} (round {rnd}; also {outcome} with a partner before)"
        if outcome == "corrupt":
            problems[node] = Problem(
                "node-link-corrupt",
                f"wrong values in the pair all-reduce {where}",
                "exact sums",
                "wrong values",
            )
        else:
            expected = None if reference is None else f"≥ {frac:g} × {reference:.3g} GB/s"
            problems[node] = Problem(
                "node-link-slow",
                f"slow pair all-reduce {where}",
                expected,
                None if bw is None else f"{bw:.3g} GB/s",
            )
    for rnd in sorted(history):
        for (a, b), outcome in history[rnd].items():
            if outcome == "good":
                continue
            for node, partner in ((a, b), (b, a)):
                if node in culprits or node in problems or good_since.get(node, rnd + 1) < rnd:
                    continue  # (a known-good partner already)
                if node in good:
                    notes[node] = (
                        f"cleared: {outcome} with {name(partner)} in round {rnd}, "
                        "fine with a known-good node later"
                    )
                    continue
                own = [e for e in rounds[rnd][(a, b)] if int(e["peer"]) == partner]
                if outcome == "corrupt" and own and not own[0].get("ok"):  # it received wrong values
                    problems[node] = Problem(
                        "node-link-corrupt",
                        f"received wrong values in the pair all-reduce with {name(partner)} "
                        f"(round {rnd}; no known-good node to re-pair with)",
                        "exact sums",
                        f"{own[0].get('wrong')} wrong element(s)",
                    )
                else:
                    notes[node] = (
                        f"{outcome} pair with {name(partner)} in round {rnd}; "
                        "no known-good node was left to tell which of the two"
                    )
    return problems, notes
