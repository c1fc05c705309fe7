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

from gpudiag.repro.sweep.hosts import host_key
from gpudiag.repro.sweep.links import localise
from gpudiag.repro.sweep.problems import Problem, leave_one_out_medians, median
from gpudiag.repro.sweep.rules import DEFAULT_RULES, FIGURES

HEALTHY, PROBLEM, NO_RESULT = "healthy", "problem", "no result"


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
    number with no record and no expected host to name it is ``no result`` as ``node #K``.
    Each rule is one function below, adding to the problems and notes of the nodes it finds."""
    rules = dict(rules or DEFAULT_RULES)
    records = sorted(records, key=lambda r: (int(r.get("node", 0)), str(r.get("host"))))
    fleet = _Fleet(records, rules)
    hosts = Counter(host_key(str(r["host"])) for r in records)  # (DNS names: case-insensitive)
    for i, rec in enumerate(records):
        fleet.problems[i] += _own_problems(rec, hosts)
        fleet.notes[i] += [str(n) for n in rec.get("notes") or []]  # (what the node skipped, and why)
    _versions(fleet)
    _topology(fleet)
    _host_facts(fleet)
    _gpu_counts(fleet)
    medians = _figures_against_the_fleet(fleet)
    _figures_against_the_baseline(fleet, baseline or {})
    _links(fleet)
    verdicts = [
        NodeVerdict(
            str(rec["host"]),
            PROBLEM if fleet.problems[i] else HEALTHY,
            fleet.problems[i],
            int(rec.get("node", i)),
            bool(rec.get("simulated")),
            fleet.notes[i],
        )
        for i, rec in enumerate(records)
    ]
    verdicts += _missing(records, hosts, expected_hosts, expected_nodes)
    return FleetVerdict(verdicts, medians, fleet.majority, dict(rules), fleet.notes_of_fleet)


@dataclass
class _Fleet:
    """The records being judged and what the rules found so far (by record index)."""

    records: list[Mapping[str, Any]]
    rules: dict[str, Any]
    problems: dict[int, list[Problem]] = field(default_factory=dict)
    notes: dict[int, list[str]] = field(default_factory=dict)
    majority: dict[str, Any] = field(default_factory=dict)
    notes_of_fleet: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.problems = {i: [] for i in range(len(self.records))}
        self.notes = {i: [] for i in range(len(self.records))}


def _own_problems(rec: Mapping[str, Any], hosts: Counter[str]) -> list[Problem]:
    """What a node's record shows by itself: problems it recorded (node-hung), a host name
    another node has too, no GPU, a local check that failed, wrong all-reduce values."""
    found = [Problem(**p) for p in rec.get("problems") or []]
    if hosts[host_key(str(rec["host"]))] > 1:
        found.append(
            Problem(
                "node-host-duplicate",
                f"{hosts[host_key(str(rec['host']))]} nodes report the host name {rec['host']} "
                "(host names are compared without case)",
            )
        )
    if "gpus" in rec and rec["gpus"] == 0:
        found.append(
            Problem(
                "node-no-gpus",
                "no GPU to check: torch sees no CUDA GPU there and no --machine was given",
                "≥ 1 GPU",
                0,
            )
        )
    for check in rec.get("checks") or []:
        if check.get("status") in ("fail", "error"):
            found.append(
                Problem(
                    "node-check-failed",
                    f"{check['name']} {check['status']}: {check.get('headline', '')}",
                    "pass",
                    ", ".join(check.get("codes") or []) or check["status"],
                )
            )
    allreduce = rec.get("allreduce")
    if isinstance(allreduce, Mapping) and allreduce.get("ok") is False:
        found.append(
            Problem(
                "node-allreduce-wrong",
                "wrong values from the all-reduce across all nodes",
                allreduce.get("expected"),
                f"{allreduce.get('wrong')} wrong element(s)",
            )
        )
    return found


def _versions(fleet: _Fleet) -> None:
    """node-version-differs: a version other than the majority's (or no majority)."""
    for key in fleet.rules.get("versions", []):
        values = [(rec.get("versions") or {}).get(key) for rec in fleet.records]
        value, odd = _odd_ones(values)
        fleet.majority[key] = value
        if value is None and odd:  # a tie: every node differs from some other, none is the odd one
            fleet.notes_of_fleet.append(f"{key}: no majority among {sorted({str(values[i]) for i in odd})}")
        for i in odd:
            fleet.problems[i].append(
                Problem(
                    "node-version-differs",
                    f"{key} differs between nodes, no majority",
                    "one value",
                    values[i],
                )
                if value is None
                else Problem("node-version-differs", f"{key} differs from the majority's", value, values[i])
            )


def _topology(fleet: _Fleet) -> None:
    """node-topology-differs: GPU models and links (hashed) other than the majority's."""
    if not fleet.rules.get("topology_must_match", True):
        return
    digests = [r.get("topology_digest") or None for r in fleet.records]
    value, odd = _odd_ones(digests)
    fleet.majority["topology_digest"] = value
    share = f"{digests.count(value)} of {len(fleet.records)} nodes"
    for i in odd:
        fleet.problems[i].append(
            Problem(
                "node-topology-differs",
                "topology differs between nodes, no majority",
                "one topology",
                digests[i],
            )
            if value is None
            else Problem(
                "node-topology-differs", f"topology differs from the majority's ({share})", value, digests[i]
            )
        )


def _host_facts(fleet: _Fleet) -> None:
    """node-host-differs: a host fact other than the majority's, each node's own name in a
    value (NCCL_DEBUG_FILE=/logs/$(hostname)/…) not counted as a difference."""
    for key in fleet.rules.get("host", []):
        facts = [(rec.get("host_facts") or {}).get(key) for rec in fleet.records]
        same = [
            None if f is None else json.dumps(own_name_out(f, rec), sort_keys=True)
            for f, rec in zip(facts, fleet.records, strict=True)
        ]
        text, odd = _odd_ones(same)
        value = None if text is None else json.loads(text)
        fleet.majority[f"host.{key}"] = value
        for i in odd:
            fleet.problems[i].append(
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


def _gpu_counts(fleet: _Fleet) -> None:
    """node-fewer-gpus: fewer GPUs than the majority (without one: than the most any has)."""
    if not fleet.rules.get("gpus_must_match", True):
        return
    counts = [int(r.get("gpus") or 0) for r in fleet.records]
    value, count = _majority(counts)
    if value is not None and count * 2 <= len(counts):
        value = max(counts)  # no majority: fewer than the most any node has
    fleet.majority["gpus"] = value
    for i, rec in enumerate(fleet.records):
        if value is not None and int(rec.get("gpus") or 0) < value:
            fleet.problems[i].append(
                Problem("node-fewer-gpus", "fewer GPUs than the other nodes", value, rec.get("gpus"))
            )


def _figures_against_the_fleet(fleet: _Fleet) -> dict[str, float | None]:
    """node-figure-low: a figure more than a set fraction below the median of the other
    nodes (simulated figures and too few nodes: a note, not judged). The fleet's medians."""
    rules, records = fleet.rules, fleet.records
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
            fleet.notes_of_fleet.append(
                f"{figure}: measured on CPU virtual devices, not judged (it swings many-fold)"
            )
            continue
        # a pair's figure with two nodes is one link measured from both ends: no outlier
        asked = int(rules.get("min_nodes", 2))
        least = max(asked, 3 if figure == "pair_busbw_gbps" else 2)
        if len(have) < least:
            if len(have) > 1:  # (one node alone has nothing to be compared with: no note)
                why = f"the rules' min_nodes {asked}" if asked >= least else "3 (two ends of one link)"
                fleet.notes_of_fleet.append(
                    f"{figure}: not judged against the fleet: {len(have)} node(s) have it, fewer than {why}"
                )
            continue
        others = leave_one_out_medians([v for _, v in have])
        for (i, value), other in zip(have, others, strict=True):
            if other is not None and value < limit * other:
                fleet.problems[i].append(
                    Problem(
                        "node-figure-low",
                        f"{figure} more than {1 - limit:.0%} below the median of the other nodes",
                        f"≥ {limit:g} × {other:.3g}",
                        round(value, 4),
                    )
                )
    return medians


def _figures_against_the_baseline(fleet: _Fleet, baseline: Mapping[str, Mapping[str, float]]) -> None:
    """node-below-baseline: a figure below the baseline's fraction of the expected figure for
    the node's machine type."""
    limit = float(fleet.rules.get("baseline_fraction", 0.8))
    for i, rec in enumerate(fleet.records):
        for figure, want in baseline.get(str(rec.get("machine_type")), {}).items():
            if _figure(rec, figure) and float(rec["figures"][figure]) < limit * want:
                fleet.problems[i].append(
                    Problem(
                        "node-below-baseline",
                        f"{figure} below the baseline for {rec.get('machine_type')}",
                        f"≥ {limit:g} × {want:g}",
                        round(float(rec["figures"][figure]), 4),
                    )
                )


def _links(fleet: _Fleet) -> None:
    """The pairwise link test's culprits and notes (links.localise)."""
    index = {int(rec["node"]): i for i, rec in enumerate(fleet.records)}
    link_problems, link_notes = localise(fleet.records, fleet.rules)
    for node, problem in link_problems.items():
        if node in index:
            fleet.problems[index[node]].append(problem)
    for node, note in link_notes.items():
        if node in index:
            fleet.notes[index[node]].append(note)


def _missing(
    records: Sequence[Mapping[str, Any]],
    hosts: Counter[str],
    expected_hosts: Sequence[str],
    expected_nodes: int,
) -> list[NodeVerdict]:
    """node-missing: an expected host with no record, or a node number the launcher started
    whose record never arrived (when no expected host names it)."""
    out = []
    seen = set(hosts) | {h.split(".")[0] for h in hosts}  # (Slurm lists short names; hosts may be FQDNs)
    missing = 0
    for host in expected_hosts:
        if host_key(host) not in seen:
            seen.add(host_key(host))
            missing += 1
            problem = Problem(
                "node-missing", "expected, but never joined the sweep or never answered", "a result", None
            )
            out.append(NodeVerdict(host, NO_RESULT, [problem]))
    numbers = {int(r.get("node", -1)) for r in records}
    unnamed = [k for k in range(expected_nodes) if k not in numbers]
    if len(unnamed) > missing:  # (an expected host already names each missing node)
        for k in unnamed:
            problem = Problem(
                "node-missing", "started by the launcher, but its record never arrived", "a result", None
            )
            out.append(NodeVerdict(f"node #{k}", NO_RESULT, [problem], k))
    return out


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
