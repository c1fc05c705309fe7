"""``gpudiag hang`` on large, deep flight-recorder buffers: read + analyse + judge of a
3-rank job's dumps of 20,000 entries each, every entry recorded 30 frames deep.

    .venv/bin/python bench/hang_read.py [--ranks 3] [--entries 20000] [--depth 30] [--repeats 3]

The dumps are real: ``--ranks`` gloo ranks (forked, TCP on 127.0.0.1, torch's flight
recorder with ``TORCH_FR_BUFFER_SIZE=--entries``) each run ``--entries`` all_reduces from a
call chain ``--depth`` frames below the script's own (the recorder keeps every frame: torch's
two, the chain's, the script's), then write ``_dump_fr_trace()`` as torch's names
(``nccl_trace_rank_<R>``, what ``fr_trace`` reads). Rank 2 then skips one last all_reduce
so the verdict has a culprit. Then, ``--repeats`` times in this process, the whole of
``gpudiag hang DIR`` but the printing: :func:`read_dumps`, :func:`analyse`, :func:`judge`,
timed by the wall clock and by this process's CPU time (the machine's other load moves
the CPU time least).

The last line is ``read + analyse 3 ranks x 20000 entries x 30 frames: W s wall, C s CPU``
(the best of the repeats; target <= 5 s, issue 43).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _rank(rank: int, ws: int, port: int, out: str, entries: int, depth: int) -> None:
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(entries)
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=ws,
        timeout=datetime.timedelta(seconds=120),
    )
    x = torch.ones(4)

    def chain(n: int) -> None:
        if n:
            chain(n - 1)
            return
        for _ in range(entries - 1):
            dist.all_reduce(x)
        if rank != 2:
            work = dist.all_reduce(x, async_op=True)  # (rank 2 skips it: the others wait)
            del work

    chain(depth - 4)  # (torch's two frames, chain's base and _rank: depth in all)
    time.sleep(1.0)
    data = bytes(torch._C._distributed_c10d._dump_fr_trace())
    Path(out, f"nccl_trace_rank_{rank}").write_bytes(data)
    os._exit(0)


def make(folder: Path, ranks: int, entries: int, depth: int) -> None:
    """Real dumps of a ``ranks``-rank gloo job into ``folder`` (module docstring)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=_rank, args=(r, ranks, port, str(folder), entries, depth)) for r in range(ranks)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
        if p.is_alive():
            p.kill()
            p.join()
    missing = [r for r in range(ranks) if not (folder / f"nccl_trace_rank_{r}").is_file()]
    if missing:
        raise SystemExit(f"ranks {missing} wrote no dump")


def judge_folder(folder: Path) -> tuple[float, float, Any]:
    """(wall s, CPU s, verdict) of gpudiag hang's read + analyse + judge of ``folder``."""
    from gpudiag.hang.analysis import analyse
    from gpudiag.hang.reader import read_dumps
    from gpudiag.hang.result import judge

    wall, cpu = time.perf_counter(), time.process_time()
    result = judge(analyse(read_dumps([str(folder)])))
    return time.perf_counter() - wall, time.process_time() - cpu, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--entries", type=int, default=20_000)
    parser.add_argument("--depth", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        make(folder, args.ranks, args.entries, args.depth)
        sizes = [p.stat().st_size for p in sorted(folder.iterdir())]
        print(f"made {args.ranks} dumps in {time.perf_counter() - start:.1f} s: {sizes} bytes")
        runs = []
        for _ in range(args.repeats):
            wall, cpu, result = judge_folder(folder)
            runs.append((wall, cpu))
            culprits = result.to_json()["culprit_ranks"]
            print(f"  wall {wall:.2f} s, CPU {cpu:.2f} s: {result.verdict}, culprits {culprits}")
    wall, cpu = min(runs)
    print(
        f"read + analyse {args.ranks} ranks x {args.entries} entries x {args.depth} frames: "
        f"{wall:.2f} s wall, {min(c for _, c in runs):.2f} s CPU"
    )


if __name__ == "__main__":
    sys.exit(main())
