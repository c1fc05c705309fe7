"""Speed and memory of `gpudiag ckpt convert DIR OUT.pt` on a ~1 GiB DCP checkpoint.

    .venv/bin/python bench/ckpt_dcp.py [--folder DIR] [--repeats 3]

Generates (once, in DIR, default a temporary folder) a 1 GiB distributed checkpoint the way
FSDP2 saves one: a 2-rank gloo job, 64 tensors of 2048x2048 fp32 each sharded by rows
(Shard(0), a DTensor per rank), written by `torch.distributed.checkpoint.save` — two
`__R_0.distcp` files of 512 MiB. Then, alternately and --repeats times, in fresh processes:

- `cat DIR/*.distcp > OUT && sync OUT`: reading the checkpoint's bytes once and writing them
  once, fsynced (convert fsyncs its output too);
- `gpudiag ckpt convert DIR OUT.pt --force` (every chunk's CRC-32 checked, each tensor
  assembled from its two chunks, written, the output's pickle read back, fsync, rename);
- once, torch's own `dcp_to_torch_save` (loads everything, then torch.save).

Before each timed command the page cache is written back (``os.sync()``, not timed). Peak
RSS from wait4()'s ru_maxrss. The largest tensor is 16 MiB; the baseline is the RSS of
`python -c "import gpudiag.repro.checkpoint.dcp_convert"` (the interpreter and the code).
Last line: `convert/(cat+sync) wall ratio: R; peak RSS above baseline / largest tensor M`
(targets: R <= 1.5; M about 1 — memory follows the largest tensor, not the checkpoint).
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

TENSORS, ROWS, COLS = 64, 2048, 2048
LARGEST = ROWS * COLS * 4
CAT_SYNC = 'cat "$1"/*.distcp > "$2" && sync "$2"'
TORCH = """
import sys, warnings
warnings.simplefilter("ignore")
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
"""


def _rank(rank: int, world: int, folder: str) -> bytes:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    rows = ROWS // world
    state = {
        f"layers.{i}.weight": DTensor.from_local(
            torch.randn(rows, COLS, generator=g),
            mesh,
            [Shard(0)],
            run_check=False,
            shape=(ROWS, COLS),
            stride=(COLS, 1),
        )
        for i in range(TENSORS)
    }
    dcp.save({"model": state}, checkpoint_id=folder)
    return b""


def make_checkpoint(folder: Path) -> None:
    from gpudiag.runtime.launch import launch

    folder.mkdir(parents=True, exist_ok=True)
    launch(_rank, 2, args=(str(folder),), timeout=600)


def run(argv: list[str]) -> tuple[float, float, float]:
    """(wall seconds, peak RSS MiB, CPU seconds) of a child process, started after a
    write-back (CPU: user + system, which a loaded machine does not inflate as it does wall)."""
    os.sync()
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{argv[:3]} failed: {proc.stderr.read().decode()[-400:] if proc.stderr else ''}")
    return wall, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime


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
    src = folder / "dcp_1gib"
    if not (src / ".metadata").exists():  # in a child: this process stays small
        subprocess.run([sys.executable, __file__, "--make", str(src)], check=True)
    size = sum(p.stat().st_size for p in src.iterdir())
    print(f"checkpoint: {src} ({size / 2**30:.2f} GiB in {len(list(src.iterdir()))} files)")
    gpudiag = str(Path(sys.executable).parent / "gpudiag")
    runs: dict[str, list[tuple[float, float, float]]] = {"cat": [], "convert": []}
    out = folder / "out.pt"
    for _ in range(args.repeats):
        runs["cat"].append(run(["sh", "-c", CAT_SYNC, "sh", str(src), str(folder / "cat.bin")]))
        runs["convert"].append(run([gpudiag, "ckpt", "convert", str(src), str(out), "--force"]))
    theirs = run([sys.executable, "-c", TORCH, str(src), str(folder / "torch.pt")])
    base = run([sys.executable, "-c", "import gpudiag.repro.checkpoint.dcp_convert"])
    cat = statistics.median(w for w, _, _ in runs["cat"])
    conv = statistics.median(w for w, _, _ in runs["convert"])
    conv_rss = max(r for _, r, _ in runs["convert"])
    cat_cpu = statistics.median(c for _, _, c in runs["cat"])
    conv_cpu = statistics.median(c for _, _, c in runs["convert"])
    print(f"os.getloadavg(): {os.getloadavg()[0]:.1f} (a busy machine slows convert's CPU share most)")
    each = [round(w, 2) for w, _, _ in runs["cat"]]
    print(f"cat + sync: median {cat:.2f} s, CPU {cat_cpu:.2f} s; each: {each}")
    print(
        f"gpudiag ckpt convert: median {conv:.2f} s, CPU {conv_cpu:.2f} s, peak RSS {conv_rss:.0f} MiB; "
        f"each: {[round(w, 2) for w, _, _ in runs['convert']]}"
    )
    print(f"torch dcp_to_torch_save: {theirs[0]:.2f} s, peak RSS {theirs[1]:.0f} MiB")
    print(f"baseline (python + gpudiag's converter imported): peak RSS {base[1]:.0f} MiB")
    for name in ("cat.bin", "out.pt", "torch.pt"):
        (folder / name).unlink(missing_ok=True)
    above = (conv_rss - base[1]) * 2**20 / LARGEST
    ratio = conv / cat
    print(f"convert/(cat+sync) wall ratio: {ratio:.2f}; peak RSS above baseline / largest tensor {above:.2f}")


if __name__ == "__main__":
    main()
