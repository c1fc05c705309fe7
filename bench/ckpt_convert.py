"""Speed and memory of `gpudiag ckpt convert` on a 1 GiB DataParallel checkpoint.

    .venv/bin/python bench/ckpt_convert.py [--folder DIR] [--repeats 3]

Generates (once, in DIR, default a temporary folder) a 1 GiB checkpoint: 64 tensors of
2048x2048 fp32 plus biases, keys `module.layers.N.weight|bias`, inside
{"epoch", "model_state_dict", "optimizer_state_dict"}. Then, alternately and --repeats times,
in fresh processes:

- `cp IN OUT && sync OUT` (the copy and its fsync: convert fsyncs its output too);
- `gpudiag ckpt convert IN OUT --force` (strips `module.`, checks every record's CRC-32
  as it copies it, reads the small pickle back by weights-only rules, fsyncs, renames);
- the naive script: torch.load, a dict comprehension, torch.save (once: it is slow);
- `python -c "import torch"` for the memory baseline.

Before each timed command the page cache is written back (``os.sync()``, not timed), so no
command pays for the previous one's dirty pages. Peak RSS comes from wait4()'s ru_maxrss
of each child. Prints the medians and, as its last line,
`convert/(cp+sync) wall ratio: R; peak RSS above import torch MiB: M`
(targets: R <= 1.5, M <= 128).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CP_SYNC = 'cp "$1" "$2" && sync "$2"'  # sync FILE: fsync of that file (coreutils 8.24+)
NAIVE = """
import sys, torch
ck = torch.load(sys.argv[1], weights_only=True)
ck["model_state_dict"] = {k.removeprefix("module."): v for k, v in ck["model_state_dict"].items()}
torch.save(ck, sys.argv[2])
"""


def make_checkpoint(path: Path) -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    state = {}
    for i in range(64):
        state[f"module.layers.{i}.weight"] = torch.randn(2048, 2048, generator=g)
        state[f"module.layers.{i}.bias"] = torch.randn(2048, generator=g)
    optimizer = {"state": {}, "param_groups": [{"lr": 0.1, "params": list(range(128))}]}
    torch.save({"epoch": 3, "model_state_dict": state, "optimizer_state_dict": optimizer}, path)


def run(argv: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of a child process, started after a write-back."""
    os.sync()
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{argv[:3]} failed: {proc.stderr.read().decode()[-400:] if proc.stderr else ''}")
    return wall, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--make", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make:
        make_checkpoint(Path(args.make))
        return
    folder = Path(args.folder or tempfile.mkdtemp(prefix="gpudiag-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "dp_1gib.pt"
    if not src.exists():  # in a child, so this process stays small (ru_maxrss counts pre-exec pages)
        subprocess.run([sys.executable, __file__, "--make", str(src)], check=True)
    print(f"checkpoint: {src} ({src.stat().st_size / 2**30:.2f} GiB)")
    gpudiag = str(Path(sys.executable).parent / "gpudiag")
    runs: dict[str, list[tuple[float, float]]] = {"cp": [], "convert": []}
    for _ in range(args.repeats):
        runs["cp"].append(run(["sh", "-c", CP_SYNC, "sh", str(src), str(folder / "cp.pt")]))
        runs["convert"].append(run([gpudiag, "ckpt", "convert", str(src), str(folder / "out.pt"), "--force"]))
    naive = run([sys.executable, "-c", NAIVE, str(src), str(folder / "naive.pt")])
    torch_only = run([sys.executable, "-c", "import torch"])
    cp = statistics.median(w for w, _ in runs["cp"])
    conv = statistics.median(w for w, _ in runs["convert"])
    conv_rss = max(r for _, r in runs["convert"])
    print(f"cp + sync: median {cp:.2f} s")
    print(f"gpudiag ckpt convert: median {conv:.2f} s, peak RSS {conv_rss:.0f} MiB")
    print(f"naive torch.load/torch.save: {naive[0]:.2f} s, peak RSS {naive[1]:.0f} MiB")
    print(f"python -c 'import torch': peak RSS {torch_only[1]:.0f} MiB")
    for name in ("cp.pt", "out.pt", "naive.pt"):
        (folder / name).unlink(missing_ok=True)
    above = conv_rss - torch_only[1]
    print(f"convert/(cp+sync) wall ratio: {conv / cp:.2f}; peak RSS above import torch MiB: {above:.0f}")


if __name__ == "__main__":
    main()
