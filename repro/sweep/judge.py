"""Judging a fleet: per-node records → a verdict per node (pure: no processes, no torch).

A node is ``healthy``, has a ``problem`` (each with a code, what was expected and what was
measured), or has ``no result`` (an expected host that never joined or never answered).
Outliers are judged against the fleet, never against a fixed number (unless a baseline
of expected figures per machine type is given):

- a figure more than a set fraction below the median of the *other* nodes
  (``node-figure-low``) — one sort of the fleet's values, then the median without each
  node in O(1) (:func:`leave_one_out_medians`), so 10,000 nodes judge in milliseconds;
- a version or topology different from the majority's, fewer GPUs than the most common
  count (``node-version-differs``, ``node-topology-differs``, ``node-fewer-gpus``); no
  GPU at all (``node-no-gpus``: nothing there was checked, so never healthy);
- a local check that failed (``node-check-failed``), wrong values from the all-node
  all-reduce (``node-allreduce-wrong``), a rank that hung (``node-hung``, recorded by the run);
- the pairwise link test (:func:`localise`): pairs of nodes in round 1; the nodes of a slow
  or corrupting pair are re-paired with known-good nodes in the next rounds; a node bad
  in both is the culprit (``node-link-slow``, ``node-link-corrupt``), one fine the second
  time is cleared.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpudiag.codes import lookup
from gpudiag.repro.sweep.hosts import host_key
from gpudiag.repro.sweep.rules import DEFAULT_RULES, FIGURES

HEALTHY, PROBLEM, NO_RESULT = "healthy", "problem", "no result"


@dataclass
class Problem:
    """One thing wrong with a node: a stable code, a sentence, expected vs measured."""

    code: str
    message: str
    expected: Any = None
    measured: Any = None

    def __post_init__(self) -> None:
        lookup(self.code)  # a registered finding code (gpudiag.codes), or UnknownCode

    def to_json(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "message": self.message,
            "expected": self.expected,
            "measured": self.measured,
        }


@dataclass
class NodeVerdict:
    host: str
    status: str
    problems: list[Problem] = field(default_factory=list)
    node: int | None = None
    simulated: bool = False
    notes: list[str] = field(default_factory=list)  # what was cleared or could not be judged

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "node": self.node,
            "status": self.status,
            "simulated": self.simulated,
            "problems": [p.to_json() for p in self.problems],
            "notes": self.notes,
        }


@dataclass
class FleetVerdict:
    """Every node's verdict (in node order, missing hosts last) and the fleet's figures."""

    nodes: list[NodeVerdict]
    medians: dict[str, float | None]
    majority: dict[str, Any]
    rules: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    failed: bool = False  # the sweep itself did not finish (a collective hung)

    @property
    def exit_code(self) -> int:
        """0 when every node is healthy; 1 for a problem, a missing node, a sweep that
        did not finish."""
        return 0 if all(v.status == HEALTHY for v in self.nodes) and not self.failed else 1

    @property
    def named(self) -> list[NodeVerdict]:
        return [v for v in self.nodes if v.status != HEALTHY]

    @property
    def simulated(self) -> bool:
        return any(v.simulated for v in self.nodes)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": "gpudiag.sweep/1",
            "healthy": sum(v.status == HEALTHY for v in self.nodes),
            "problem": sum(v.status == PROBLEM for v in self.nodes),
            "no_result": sum(v.status == NO_RESULT for v in self.nodes),
            "simulated": self.simulated,
            "medians": self.medians,
            "majority": self.majority,
            "notes": self.notes,
            "nodes": [v.to_json() for v in self.nodes],
            "rules": self.rules,
        }


def leave_one_out_medians(values: Sequence[float]) -> list[float | None]:
    """For each position, the median of every *other* value (None when there is no other).

    One sort (n log n), then O(1) per value: removing the element at sorted position k
    shifts the ones above it down by one, so the median of the rest is read off the full
    sorted list at an index that depends only on whether it lies below or above k."""
    n = len(values)
    if n < 2:
        return [None] * n
    order = sorted(range(n), key=values.__getitem__)
    ranked = [values[i] for i in order]
    out: list[float | None] = [None] * n
    rest = n - 1

    def at(j: int, k: int) -> float:  # element j of the sorted list without position k
        return ranked[j] if j < k else ranked[j + 1]

    for k, i in enumerate(order):
        if rest % 2:
            out[i] = at(rest // 2, k)
        else:
            out[i] = (at(rest // 2 - 1, k) + at(rest // 2, k)) / 2
    return out


def median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _majority(values: Iterable[Any]) -> tuple[Any, int]:
    """The most common value and its count (ties: the first seen)."""
    counts = Counter(values)
    if not counts:
        return None, 0
    return counts.most_common(1)[0]


def _odd_ones(values: Sequence[Any]) -> tuple[Any, list[int]]:
    """The value more than half of the nodes that reported one share (None: there is
    none), and the nodes that differ from it — or, on a tie between different values,
    every node that reported one (each differs from some other; none is the odd one).
    ``None`` in ``values``: the node did not report it."""
    reported = [(i, v) for i, v in enumerate(values) if v is not None]
    value, count = _majority(v for _, v in reported)
    if value is not None and count * 2 > len(reported):
        return value, [i for i, v in reported if v != value]
    if len({v for _, v in reported}) > 1:
        return None, [i for i, _ in reported]
    return None, []


# -- the pairwise link test -------------------------------------------------------------


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
    others = leave_one_out_medians([figures[p][0] for p in keys])  # type: ignore[misc]
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


# -- the whole fleet --------------------------------------------------------------------


def judge(
    records: Sequence[Mapping[str, Any]],
    *,
    expected_hosts: Sequence[str] = (),
    rules: Mapping[str, Any] | None = None,
    baseline: Mapping[str, Mapping[str, float]] | None = None,
    expected_nodes: int = 0,
) -> FleetVerdict:
    """A verdict per node (records in any order) and per expected host without a record;
    ``expected_nodes``: how many nodes the launcher started (node numbers 0…N−1) — a node
    number with no record and no expected host to name it is ``no result`` as ``node #K``."""
    rules = dict(rules or DEFAULT_RULES)
    baseline = baseline or {}
    records = sorted(records, key=lambda r: (int(r.get("node", 0)), str(r.get("host"))))
    problems: dict[int, list[Problem]] = {i: [] for i in range(len(records))}
    notes: dict[int, list[str]] = {i: [] for i in range(len(records))}
    fleet_notes: list[str] = []

    hosts = Counter(host_key(str(r["host"])) for r in records)  # (DNS names: case-insensitive)
    for i, rec in enumerate(records):
        problems[i] += [Problem(**p) for p in rec.get("problems") or []]
        notes[i] += [str(n) for n in rec.get("notes") or []]  # (what the node skipped, and why)
        if hosts[host_key(str(rec["host"]))] > 1:
            problems[i].append(
                Problem(
                    "node-host-duplicate",
                    f"{hosts[host_key(str(rec['host']))]} nodes report the host name {rec['host']} "
                    "(host names are compared without case)",
                )
            )
        if "gpus" in rec and rec["gpus"] == 0:
            problems[i].append(
                Problem(
                    "node-no-gpus",
                    "no GPU to check: torch sees no CUDA GPU there and no --machine was given",
                    "≥ 1 GPU",
                    0,
                )
            )
        for check in rec.get("checks") or []:
            if check.get("status") in ("fail", "error"):
                problems[i].append(
                    Problem(
                        "node-check-failed",
                        f"{check['name']} {check['status']}: {check.get('headline', '')}",
                        "pass",
                        ", ".join(check.get("codes") or []) or check["status"],
                    )
                )
        allreduce = rec.get("allreduce")
        if isinstance(allreduce, Mapping) and allreduce.get("ok") is False:
            problems[i].append(
                Problem(
                    "node-allreduce-wrong",
                    "wrong values from the all-reduce across all nodes",
                    allreduce.get("expected"),
                    f"{allreduce.get('wrong')} wrong element(s)",
                )
            )

    # majority: versions, topology, GPU count
    majority: dict[str, Any] = {}
    for key in rules.get("versions", []):
        values = [(rec.get("versions") or {}).get(key) for rec in records]
        value, odd = _odd_ones(values)
        majority[key] = value
        if value is None and odd:  # a tie: every node differs from some other, none is the odd one
            fleet_notes.append(f"{key}: no majority among {sorted({str(values[i]) for i in odd})}")
        for i in odd:
            problems[i].append(
                Problem(
                    "node-version-differs",
                    f"{key} differs between nodes, no majority",
                    "one value",
                    values[i],
                )
                if value is None
                else Problem("node-version-differs", f"{key} differs from the majority's", value, values[i])
            )
    if rules.get("topology_must_match", True):
        digests = [r.get("topology_digest") or None for r in records]
        value, odd = _odd_ones(digests)
        majority["topology_digest"] = value
        share = f"{digests.count(value)} of {len(records)} nodes"
        for i in odd:
            problems[i].append(
                Problem(
                    "node-topology-differs",
                    "topology differs between nodes, no majority",
                    "one topology",
                    digests[i],
                )
                if value is None
                else Problem(
                    "node-topology-differs",
                    f"topology differs from the majority's ({share})",
                    value,
                    digests[i],
                )
            )
    for key in rules.get("host", []):
        facts = [(rec.get("host_facts") or {}).get(key) for rec in records]
        # each node's own name in a value (NCCL_DEBUG_FILE=/logs/$(hostname)/…) is not a difference
        same = [
            None if f is None else json.dumps(own_name_out(f, rec), sort_keys=True)
            for f, rec in zip(facts, records, strict=True)
        ]
        text, odd = _odd_ones(same)
        value = None if text is None else json.loads(text)
        majority[f"host.{key}"] = value
        for i in odd:
            problems[i].append(
                Problem(
                    "node-host-differs",
                    f"host fact {key} differs between nodes, no majority",
                    "one value",
                    facts[i],
                )
                if text is None
                else Problem(
                    "node-host-differs", f"host fact {key} differs from the majority's", value, facts[i]
                )
            )
    if rules.get("gpus_must_match", True):
        counts = [int(r.get("gpus") or 0) for r in records]
        value, count = _majority(counts)
        if value is not None and count * 2 <= len(counts):
            value = max(counts)  # no majority: fewer than the most any node has
        majority["gpus"] = value
        for i, rec in enumerate(records):
            if value is not None and int(rec.get("gpus") or 0) < value:
                problems[i].append(
                    Problem("node-fewer-gpus", "fewer GPUs than the other nodes", value, rec.get("gpus"))
                )

    # figures: the median of the other nodes
    medians: dict[str, float | None] = {}
    for figure in FIGURES:
        limit = float(rules.get("figures", {}).get(figure, {}).get("min_fraction_of_median", 0.8))
        have = [(i, float(rec["figures"][figure])) for i, rec in enumerate(records) if _figure(rec, figure)]
        medians[figure] = median([v for _, v in have])
        if (
            have
            and not rules.get("judge_simulated_figures")
            and all(records[i].get("simulated") for i, _ in have)
        ):
            fleet_notes.append(f"{figure}: measured on CPU virtual devices, not judged (it swings many-fold)")
            continue
        # a pair's figure with two nodes is one link measured from both ends: no outlier
        asked = int(rules.get("min_nodes", 2))
        least = max(asked, 3 if figure == "pair_busbw_gbps" else 2)
        if len(have) < least:
            if len(have) > 1:  # (one node alone has nothing to be compared with: no note)
                why = f"the rules' min_nodes {asked}" if asked >= least else "3 (two ends of one link)"
                fleet_notes.append(
                    f"{figure}: not judged against the fleet: {len(have)} node(s) have it, fewer than {why}"
                )
            continue
        others = leave_one_out_medians([v for _, v in have])
        for (i, value), other in zip(have, others, strict=True):
            if other is not None and value < limit * other:
                problems[i].append(
                    Problem(
                        "node-figure-low",
                        f"{figure} more than {1 - limit:.0%} below the median of the other nodes",
                        f"≥ {limit:g} × {other:.3g}",
                        round(value, 4),
                    )
                )
    for i, rec in enumerate(records):
        expected = baseline.get(str(rec.get("machine_type")), {})
        limit = float(rules.get("baseline_fraction", 0.8))
        for figure, want in expected.items():
            if _figure(rec, figure) and float(rec["figures"][figure]) < limit * want:
                problems[i].append(
                    Problem(
                        "node-below-baseline",
                        f"{figure} below the baseline for {rec.get('machine_type')}",
                        f"≥ {limit:g} × {want:g}",
                        round(float(rec["figures"][figure]), 4),
                    )
                )

    # the pairwise link test
    index = {int(rec["node"]): i for i, rec in enumerate(records)}
    link_problems, link_notes = localise(records, rules)
    for node, problem in link_problems.items():
        if node in index:
            problems[index[node]].append(problem)
    for node, note in link_notes.items():
        if node in index:
            notes[index[node]].append(note)

    verdicts = [
        NodeVerdict(
            str(rec["host"]),
            PROBLEM if problems[i] else HEALTHY,
            problems[i],
            int(rec.get("node", i)),
            bool(rec.get("simulated")),
            notes[i],
        )
        for i, rec in enumerate(records)
    ]
    seen = set(hosts) | {h.split(".")[0] for h in hosts}  # (Slurm lists short names; hosts may be FQDNs)
    missing = 0
    for host in expected_hosts:
        if host_key(host) not in seen:
            seen.add(host_key(host))
            missing += 1
            verdicts.append(
                NodeVerdict(
                    host,
                    NO_RESULT,
                    [
                        Problem(
                            "node-missing",
                            "expected, but never joined the sweep or never answered",
                            "a result",
                            None,
                        )
                    ],
                )
            )
    numbers = {int(r.get("node", -1)) for r in records}
    unnamed = [k for k in range(expected_nodes) if k not in numbers]
    if len(unnamed) > missing:  # (an expected host already names each missing node)
        for k in unnamed:
            verdicts.append(
                NodeVerdict(
                    f"node #{k}",
                    NO_RESULT,
                    [
                        Problem(
                            "node-missing",
                            "started by the launcher, but its record never arrived",
                            "a result",
                            None,
                        )
                    ],
                    k,
                )
            )
    return FleetVerdict(verdicts, medians, majority, dict(rules), fleet_notes)


def _figure(rec: Mapping[str, Any], figure: str) -> bool:
    value = (rec.get("figures") or {}).get(figure)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


#: What stands for a node's own name in the host facts compared (:func:`own_name_out`).
OWN_NAME = "<host>"


def own_name_out(value: Any, record: Mapping[str, Any]) -> Any:
    """``value`` with the node's own names — its ``host``, the other names it goes by
    (``aliases``: the kernel's name under ``GPUDIAG_HOSTNAME``), each also without its
    domain — replaced by :data:`OWN_NAME` as whole words in every string, so paths that
    hold each node's name compare equal across nodes."""
    aliases = record.get("aliases")
    names = [record.get("host"), *(aliases if isinstance(aliases, list) else [])]
    words = {w for n in names if isinstance(n, str) and n for w in (n, n.split(".")[0]) if w}
    if not words:
        return value
    pattern = re.compile(
        r"(?<![\w.-])(?:"
        + "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))
        + r")(?![\w-])"
    )

    def walk(item: Any) -> Any:
        if isinstance(item, str):
            return pattern.sub(OWN_NAME, item)
        if isinstance(item, Mapping):
            return {k: walk(v) for k, v in item.items()}
        if isinstance(item, list):
            return [walk(v) for v in item]
        return item

    return walk(value)
