"""gpudiag sweep over 8 "nodes" on this machine, each a torchrun of its own on 127.0.0.1
(gloo, CPU virtual devices laid out by a machine file per node, a host name per node from
GPUDIAG_HOSTNAME), with the issue's scenarios planted:

- node2: a link fault (``--inject '*->*:bitflip'``: what it receives is corrupted, in its
  own peer/nancheck and between nodes);
- node4: made slow (``--inject-delay 0.5``: 0.5 s before each of its transfers);
- node6: a different machine file (every GPU pair over SYS instead of NV4);
- node8: expected (``--expect-hosts node[0-8]``) but never started.

    .venv/bin/python bench/sweep_nodes.py [--nodes 8] [--keep FOLDER] [--checks LIST]

Everything is simulated (CPU virtual devices). CPU figures on a shared machine swing up
to fivefold between processes, so the rules file used here judges a figure low below
0.05 × the median of the other nodes (the default, for GPUs, is 0.8); the slow node is
~100× slower. Prints SUMMARY.md,
the wall time and, as its last line, how many planted culprits were named with the right
code and how many nodes were named wrongly.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpudiag.repro.sweep.rehearse import LOOSE_RULES, Node, rehearse
from gpudiag.repro.sweep.run import rejudge

SEED = Path(__file__).resolve().parent.parent / "diag" / "examples" / "seed_8gpu_machine.json"
#: host → a code its verdict must carry.
EXPECTED = {
    "node2": "node-link-corrupt",
    "node4": "node-link-slow",
    "node6": "node-topology-differs",
    "node8": "node-missing",
}


def machine(folder: Path, link: str, gpus: int = 2) -> str:
    doc = json.loads(SEED.read_text())
    doc["labels"], doc["gpus"] = doc["labels"][:gpus], doc["gpus"][:gpus]
    doc["matrix"] = [["X" if i == j else link for j in range(gpus)] for i in range(gpus)]
    doc["description"] = f"{gpus} GPUs, every pair over {link} (from the seed machine)"
    name = f"machine-{gpus}gpu-{link}.json"
    (folder / name).write_text(json.dumps(doc, indent=1))
    return name  # (the nodes run in that folder: their command lines stay short)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--keep", metavar="FOLDER", help="Copy the sweep folder here.")
    parser.add_argument("--checks", default="env,topology,peer,nancheck")
    parser.add_argument("--deadline", type=float, default=600)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sweep-nodes-") as tmp:
        folder = Path(tmp)
        normal, other = machine(folder, "NV4"), machine(folder, "SYS")
        extra = {
            "node2": ["--inject", "*->*:bitflip"],
            "node4": ["--inject-delay", "0.5"],
        }
        nodes = [
            Node(f"node{i}", other if i == 6 else normal, extra.get(f"node{i}", []))
            for i in range(args.nodes)
        ]
        (folder / "loose-rules.json").write_text(json.dumps(LOOSE_RULES))
        common = ["--quick", "--rules", "loose-rules.json", "--checks", args.checks]
        common += ["--expect-hosts", f"node[0-{args.nodes}]"]
        start = time.perf_counter()
        finished = rehearse(nodes, "sweep", common, deadline=args.deadline, cwd=folder)
        wall = time.perf_counter() - start
        if any(f.returncode is None for f in finished) or not (folder / "sweep" / "results.jsonl").exists():
            for f in finished:
                print(f"--- {f.host}: exit {f.returncode}\n{f.output[-2000:]}")
            raise SystemExit("the sweep did not finish")
        summary = (folder / "sweep" / "SUMMARY.md").read_text()
        print(summary)
        verdict, _ = rejudge(str(folder / "sweep"))
        named = {v.host: [p.code for p in v.problems] for v in verdict.named}
        right = sum(1 for host, code in EXPECTED.items() if code in named.get(host, []))
        wrong = sorted(set(named) - set(EXPECTED))
        if args.keep:
            shutil.copytree(folder / "sweep", args.keep, dirs_exist_ok=False)
        print(f"wall time {wall:.1f} s for {args.nodes} nodes; rank 0 exit {finished[0].returncode}")
        print(
            f"named right: {right}/{len(EXPECTED)}; named wrongly: {len(wrong)}"
            + (f" ({', '.join(wrong)})" if wrong else "")
        )


if __name__ == "__main__":
    main()
