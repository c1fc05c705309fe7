"""How ``nccl_torch2.11_ws1_h200.rank0.pkl`` was made: a real NCCL flight-recorder dump from
one GPU (world size 1), run on a lent H200 on 2026-11-27 (torch 2.11.0+cu130, NCCL 2.28.9) as

    TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_FR_BUFFER_SIZE=2000 \\
      python3 -m torch.distributed.run --standalone --nproc-per-node 1 make_nccl_dump.py OUTDIR
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(out: Path) -> None:
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    rank = dist.get_rank()
    x = torch.ones(1 << 20, device="cuda")
    for _ in range(5):
        dist.all_reduce(x)
    dist.broadcast(x, 0)
    dist.all_reduce(x, group=dist.new_group([0]))
    dist.all_gather([torch.empty_like(x)], x)
    dist.barrier()
    torch.cuda.synchronize()
    c10d = torch._C._distributed_c10d
    for name in ("_dump_nccl_trace", "_dump_fr_trace"):
        dump = getattr(c10d, name, None)
        if dump is not None:
            (out / f"{name}.rank{rank}.pkl").write_bytes(dump())
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
