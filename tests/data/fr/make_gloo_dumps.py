"""Real gloo flight-recorder dumps of real hangs, 3-4 ranks on the CPU (torch's own recorder).

Run: ``python tests/data/fr/make_gloo_dumps.py tests/data/fr/gloo [SCENARIO...]`` (about 5 s
a scenario). Each scenario's ranks are forked, join a gloo group over TCP on 127.0.0.1 with
``TORCH_FR_BUFFER_SIZE`` set, and run the body below; ``DUMP_AFTER_S`` seconds after the
group formed, a thread in every live rank writes what ``torch._C._distributed_c10d`` dumps
(``_dump_fr_trace()`` pickle, with Python frames, and ``_dump_fr_trace_json()``), as
``SCENARIO/pickle/nccl_trace_rank_R`` (the watchdog's own name) and
``SCENARIO/json/fr-R.json``, then ends the rank (a rank stuck in a collective would wait
for gloo's timeout). gloo never dumps by itself; ``gpudiag run`` does what this thread does.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

DUMP_AFTER_S = 3.0


def skip(rank: int, ws: int, dist, torch) -> None:  # rank 2 skips the third all_reduce
    x = torch.ones(4)
    for step in range(3):
        if rank == 2 and step == 2:
            continue  # a data-dependent branch: rank 2 has no batch left
        dist.all_reduce(x)
    dist.barrier()


def swap(rank: int, ws: int, dist, torch) -> None:  # rank 0 calls two collectives in the other order
    x = torch.ones(4)
    dist.all_reduce(x)
    if rank == 0:
        dist.broadcast(x, 0)
        dist.all_reduce(x)
    else:
        dist.all_reduce(x)
        dist.broadcast(x, 0)


def shapes(rank: int, ws: int, dist, torch) -> None:  # same element count, other shape on rank 1
    x = torch.ones(2, 3) if rank == 1 else torch.ones(3, 2)
    dist.all_reduce(x)
    dist.barrier()


def dead(rank: int, ws: int, dist, torch) -> None:  # rank 2 stops before the second all_reduce
    x = torch.ones(4)
    dist.all_reduce(x)
    if rank == 2:
        # frozen, not exited: its sockets stay open, so the others wait in the collective
        # as they would for a dead host (an exit closes them, gloo raises at once and
        # marks the collective retired); it never dumps. make() kills it at the end.
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(x)


def subgroup(rank: int, ws: int, dist, torch) -> None:  # rank 3 skips a collective of group [1, 2, 3]
    x = torch.ones(4)
    group = dist.new_group([1, 2, 3], group_desc="tail")
    dist.all_reduce(x)
    if rank in (1, 2, 3):
        dist.all_reduce(x, group=group)
        if rank != 3:
            dist.all_reduce(x, group=group)
    dist.barrier()


def straggler(rank: int, ws: int, dist, torch) -> None:  # rank 1 computes for a long time; buffer wraps
    x = torch.ones(4)
    for _ in range(12):
        dist.all_reduce(x)
    if rank == 1:
        time.sleep(60)  # outside any collective
    dist.all_reduce(x)


def healthy(rank: int, ws: int, dist, torch) -> None:
    x = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(x)
    dist.broadcast(x, 0)
    dist.barrier()


#: name → (body, world size, TORCH_FR_BUFFER_SIZE)
SCENARIOS = {
    "skip": (skip, 3, 100),
    "swap": (swap, 3, 100),
    "shapes": (shapes, 3, 100),
    "dead": (dead, 3, 100),
    "subgroup": (subgroup, 4, 100),
    "straggler": (straggler, 3, 6),
    "healthy": (healthy, 3, 100),
}


def rank_main(name: str, rank: int, ws: int, port: int, out: Path) -> None:
    body, _, buffer = SCENARIOS[name]
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(buffer)
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=ws,
        timeout=datetime.timedelta(seconds=60),
    )

    def dump() -> None:
        time.sleep(DUMP_AFTER_S)
        c10d = torch._C._distributed_c10d
        (out / "pickle").mkdir(parents=True, exist_ok=True)
        (out / "json").mkdir(parents=True, exist_ok=True)
        (out / "pickle" / f"nccl_trace_rank_{rank}").write_bytes(bytes(c10d._dump_fr_trace()))
        json_dump = c10d._dump_fr_trace_json()
        (out / "json" / f"fr-{rank}.json").write_bytes(
            json_dump if isinstance(json_dump, bytes) else json_dump.encode()
        )
        time.sleep(2.0)  # every rank has dumped before the first one's exit closes its connections
        os._exit(0)

    threading.Thread(target=dump, daemon=True).start()
    try:  # noqa: SIM105  (the except says why it is expected)
        body(rank, ws, dist, torch)
    except RuntimeError:  # gloo saw a peer die ("Connection closed by peer"): still dump
        pass
    time.sleep(DUMP_AFTER_S * 10)  # (the dump thread ends the rank)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make(name: str, root: Path) -> None:
    _, ws, _ = SCENARIOS[name]
    out = root / name
    port = free_port()
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=rank_main, args=(name, r, ws, port, out)) for r in range(ws)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
            p.join()
    print(name, sorted(str(p.relative_to(root)) for p in out.rglob("*") if p.is_file()))


def p2p(rank: int, ws: int, dist, torch) -> None:  # rank 0 skips its last send; rank 1 waits in recv
    # (below the others, so their stored dumps' lines stay this file's)
    x = torch.ones(4)
    for step in range(3):
        if rank == 0 and step < 2:
            dist.send(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
        dist.all_reduce(x)


SCENARIOS["p2p"] = (p2p, 3, 100)  # gloo records no send/recv entry; their op_ids show


# -- the layouts of issue 43 (below the others, so their stored dumps' lines stay this file's) --


def bcast_root(rank: int, ws: int, dist, torch) -> None:  # rank 2 names itself the broadcast's root
    x = torch.ones(4)
    dist.all_reduce(x)
    dist.broadcast(x, src=2 if rank == 2 else 0)
    dist.all_reduce(x)
    dist.barrier()


def bcast_obj(rank: int, ws: int, dist, torch) -> None:  # broadcast_object_list behind a per-rank condition
    x = torch.ones(4)
    dist.all_reduce(x)
    objects = [{"step": 1}]
    if rank != 2:  # rank 2 never calls it
        dist.broadcast_object_list(objects, src=0)
    dist.all_reduce(x)
    dist.barrier()


def _grid_loop(rank: int, dist, torch, tp, dp) -> None:
    x = torch.ones(4)
    for step in range(3):
        if not (rank == 3 and step == 2):  # rank 3 skips its last tp all_reduce
            dist.all_reduce(x, group=tp)
        dist.all_reduce(x, group=dp)
    dist.barrier()


def mesh2d(rank: int, ws: int, dist, torch) -> None:  # a 2 x 2 DeviceMesh (dp, tp)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    _grid_loop(rank, dist, torch, mesh.get_group("tp"), mesh.get_group("dp"))


def grid2d(rank: int, ws: int, dist, torch) -> None:  # the same 2 x 2 layout from new_group, no names
    tps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    _grid_loop(rank, dist, torch, tps[rank // 2], dps[rank % 2])


def pair_outside(rank: int, ws: int, dist, torch) -> None:  # 2 ranks: rank 1 computes, rank 0 waits
    x = torch.ones(4)
    dist.all_reduce(x)
    if rank == 1:
        time.sleep(60)  # outside any collective
    dist.all_reduce(x)


def p2p_deadlock(rank: int, ws: int, dist, torch) -> None:  # both ranks recv first: neither sends
    x = torch.ones(4)
    dist.all_reduce(x)
    if rank == 0:  # one exchange that works: it takes an op_id, which no entry lists
        dist.send(x, 1)
    else:
        dist.recv(x, 0)
    dist.all_reduce(x)
    dist.recv(x, 1 - rank)
    dist.send(x, 1 - rank)


SCENARIOS["bcast_root"] = (bcast_root, 3, 100)
SCENARIOS["bcast_obj"] = (bcast_obj, 3, 100)
SCENARIOS["mesh2d"] = (mesh2d, 4, 100)
SCENARIOS["grid2d"] = (grid2d, 4, 100)
SCENARIOS["pair_outside"] = (pair_outside, 2, 100)
SCENARIOS["p2p_deadlock"] = (p2p_deadlock, 2, 100)


if __name__ == "__main__":
    root = Path(sys.argv[1])
    for name in sys.argv[2:] or list(SCENARIOS):
        make(name, root)
