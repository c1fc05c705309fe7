"""gpudiag sweep's judging is linear in the number of nodes: synthetic fleets of 1,000 and
10,000 nodes (no processes), each written as results.jsonl, then read back, judged and
summarised (SUMMARY.md) as ``gpudiag sweep --summary --format markdown`` does.

    .venv/bin/python bench/sweep_outliers.py [--small 1000] [--large 10000] [--repeats 3]

The fleet: 8-GPU nodes with figures spread ±5 %, 1 % of them outliers of every kind (a
slow figure, another driver, another topology, a GPU fewer, a failed check) and round 1
of the pairwise link test for every node. Checks that every planted outlier is named and
nobody else. Prints the best time of each size and, as its last line, the ratio of the
two per node (1.0: linear), beside the same ratio for ``json.loads`` of the lines alone
(no judging: what memory and caches alone cost a larger fleet on this machine).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpudiag.repro.sweep.results import NODE_SCHEMA, results_jsonl, summary_markdown
from gpudiag.repro.sweep.run import rejudge, without_gc


def fleet(n: int, seed: int = 0) -> tuple[list[dict[str, Any]], set[str]]:
    """``n`` synthetic node records and the hosts planted as outliers."""
    rng = random.Random(seed)
    records, planted = [], set()
    for i in range(n):
        rec: dict[str, Any] = {
            "schema": NODE_SCHEMA,
            "host": f"node{i:05d}",
            "node": i,
            "rank": i * 8,
            "simulated": False,
            "machine_type": "8x NVIDIA H100 80GB HBM3",
            "gpus": 8,
            "topology_digest": "3f2a9c0d11e4b7aa",
            "versions": {
                "nvidia_driver": "560.35.03",
                "cuda_runtime": "12.6",
                "nccl_runtime": "2.21.5",
                "torch": "2.5.1",
            },
            "checks": [
                {"name": c, "status": "pass", "codes": [], "headline": "ok"}
                for c in ("env", "topology", "peer", "nancheck")
            ],
            "figures": {"intra_busbw_gbps": 420 * rng.uniform(0.95, 1.05), "pair_busbw_gbps": None},
            "allreduce": {"ok": True, "wrong": 0, "expected": 1.0},
            "pairs": [],
            "problems": [],
        }
        if i % 100 == 37:
            kind = (i // 100) % 5
            planted.add(rec["host"])
            if kind == 0:
                rec["figures"]["intra_busbw_gbps"] *= 0.5
            elif kind == 1:
                rec["versions"]["nvidia_driver"] = "550.54.15"
            elif kind == 2:
                rec["topology_digest"] = "0000000000000000"
            elif kind == 3:
                rec["gpus"] = 7
            else:
                rec["checks"][3] = {
                    "name": "nancheck",
                    "status": "fail",
                    "codes": ["link-corruption"],
                    "headline": "x",
                }
        records.append(rec)
    for a in range(0, n - 1, 2):  # round 1 of the pairwise link test, all fine
        for me, peer in ((a, a + 1), (a + 1, a)):
            bw = 48 * rng.uniform(0.97, 1.03)
            records[me]["pairs"].append({"round": 1, "peer": peer, "busbw_gbps": bw, "ok": True, "wrong": 0})
            records[me]["figures"]["pair_busbw_gbps"] = bw
    return records, planted


def measure(n: int, repeats: int) -> tuple[float, float]:
    """Best seconds of (--summary's read + judge + SUMMARY.md, json.loads of the lines alone)."""
    records, planted = fleet(n)
    best = bare = float("inf")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "results.jsonl"
        path.write_text(results_jsonl(records))
        lines = path.read_bytes().splitlines()
        for _ in range(repeats):
            with without_gc():
                start = time.perf_counter()
                parsed = [json.loads(line) for line in lines]
                bare = min(bare, time.perf_counter() - start)
            del parsed
            start = time.perf_counter()
            verdict, data = rejudge(str(path))  # what gpudiag sweep --summary does
            with without_gc():
                summary = summary_markdown(verdict, data.records, data.run)
            best = min(best, time.perf_counter() - start)
        named = {v.host for v in verdict.named}
        assert named == planted, (len(named), len(planted), sorted(named ^ planted)[:5])
        print(
            f"{n} nodes: {best:.3f} s (read + judge + SUMMARY.md of {len(summary) // 1024} KiB), "
            f"{len(named)} named; json.loads of the lines alone {bare:.3f} s"
        )
    return best, bare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=1000)
    parser.add_argument("--large", type=int, default=10000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    small, small_bare = measure(args.small, args.repeats)
    large, large_bare = measure(args.large, args.repeats)
    ratio = (large / args.large) / (small / args.small)
    bare = (large_bare / args.large) / (small_bare / args.small)
    print(f"per-node time {args.large} vs {args.small} nodes: {ratio:.2f} (json.loads alone: {bare:.2f})")


if __name__ == "__main__":
    main()
