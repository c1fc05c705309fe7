"""Real NCCL flight-recorder dumps and NCCL_DEBUG=INFO log on one GPU (world size 1)."""

import os, sys, torch, torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
r = dist.get_rank()
x = torch.ones(1 << 20, device="cuda")
for _ in range(5):
    dist.all_reduce(x)
dist.broadcast(x, 0)
g = dist.new_group([0])
dist.all_reduce(x, group=g)
y = [torch.empty_like(x)]
dist.all_gather(y, x)
dist.barrier()
torch.cuda.synchronize()
c = torch._C._distributed_c10d
for name in ("_dump_nccl_trace", "_dump_fr_trace"):
    f = getattr(c, name, None)
    if f:
        try:
            open(f"{out}/{name}.rank{r}.pkl", "wb").write(f())
        except Exception as e:
            print(name, "failed", e)
for name in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):
    f = getattr(c, name, None)
    if f:
        try:
            open(f"{out}/{name}.rank{r}.json", "w").write(f())
        except Exception as e:
            print(name, "failed", e)
print("dumps written", os.listdir(out))
dist.destroy_process_group()
